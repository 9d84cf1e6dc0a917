"""Benchmark the client's verification of servers (petals_chain/client/verification.py); JSON output.

Sections (`--sections`, default all), each measured in this run:

- `calibrate`: the honest-pair distribution behind the comparison bound. Random sessions of
  SmolLM2-135M's blocks (all 30, in this process: no swarm) run as a server runs them (a prompt
  step, then 1-token decode steps, batched with another session's rows) in one dtype and as a spot
  check recomputes them (one stateless forward of the whole history) in another, for every ordered
  pair of `--calibrate-dtypes` (a mixed-dtype swarm's pairs included); the relative row errors'
  maximum and quantiles, against the bound `hidden_compare.tolerance_for` gives the pair.
- `detect`: detection latency on a live swarm of the tiny random Llama (6 blocks): two honest
  servers and one per corruption mode (`launch-server --test-corrupt`), each holding all blocks. Per
  mode, check probability p and probation on/off (`--probation`), `--trials` sessions whose chain
  starts on the corrupting server and that use only it and the honest ones (every trial a client new
  to the server; after:N's server first serves N honest sessions of the client), generating
  `--detect-tokens` greedy tokens (`--rare-detect-tokens` for rare:P); per trial the chain step whose
  audit caught the server (steps counted from the prompt step = 1), the step at which the verdict
  was in, the steps from the first wrong row's step to the catch, and whether the output equals HF
  greedy; rare:P against the issue's 1/(P p) and this design's ~1/P + 1/p.
- `overhead`: tokens/s of greedy generation with spot checks at p = `--overhead-p` against none, on a
  3-server swarm of SmolLM2-135M (each server holds all 30 blocks, so every hop has a second and a
  third opinion), the two alternating session by session in the same run (paired ratio, median).
- `honest`: false positives: short honest sessions on that swarm (float32: the exact path) with
  p = 1 (every step audits every row since the last audit), `--honest-concurrency` at a time, for
  `--honest-sessions` sessions or `--honest-budget-s` seconds, whichever ends first; counts
  sessions, audits, rows compared, mismatches and catches.
- `honest-mixed`: the same on a mixed-dtype swarm (one float32 server, one bfloat16, SmolLM2 on
  each): float32 sessions checked by the bfloat16 server and bfloat16 sessions checked by the
  float32 one, in turn (the tolerance path).
- `detect-mixed`: detection across dtypes, live: SmolLM2-135M servers with all 30 blocks, each
  corrupting server (`--detect-mixed-modes`, in float32 and in bfloat16) checked only by two honest
  servers of the other dtype (so the audit judges rows by their median, `hidden_compare`); per
  mode and dtype `--trials` sessions of the corrupting server's dtype starting on it, at
  `--detect-mixed-p` with probation on: the step that caught it, and whether the output equals HF
  greedy in the session's dtype and what the same session gives through an honest server of the
  other dtype (after the catch the other dtype's servers serve the rest, casting, so the tokens may
  differ from the session dtype's HF without any server being wrong: reported, not asserted).

Writes `--out` (default results/bench_verify.json) and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402


def calibrate(sessions: int, prompt_tokens: int, decode_steps: int, dtypes: list[str]) -> dict:
    """Relative row errors between a session's rows as a server computes them (a prompt step, then
    1-token decode steps batched with another session's rows) in one dtype and as a spot check
    recomputes them (one stateless forward of the whole history) in another: every ordered pair of
    `dtypes`, the same dtype included (a mixed-dtype swarm's pairs compare a float32 session with a
    bfloat16 checker and the other way round)."""
    from petals_chain.algorithms.hidden_compare import row_errors, tolerance_for
    from petals_chain.models.checkpoint import resolve_model_path
    from petals_chain.runtime.block_range import BlockRange, StepInput
    from petals_chain.runtime.client_head import ClientHead

    path = resolve_model_path("smollm2-135m", show_progress=False)
    head = ClientHead(path, dtype="float32", model_path=path)
    gen = torch.Generator().manual_seed(0)
    ranges = {d: BlockRange(path, 0, head.config.num_hidden_layers, dtype=d) for d in dtypes}
    errors: dict[tuple[str, str], list[float]] = {(a, b): [] for a in dtypes for b in dtypes}
    # a session's median row error: what a cross-dtype audit of all its rows is judged by (hidden_compare)
    medians: dict[tuple[str, str], list[float]] = {(a, b): [] for a in dtypes for b in dtypes}
    for _ in range(sessions):
        n = prompt_tokens + decode_steps
        x = head.embed_batched(torch.randint(0, head.config.vocab_size, (n,), generator=gen))
        other = head.embed_batched(torch.randint(0, head.config.vocab_size, (n,), generator=gen))
        served, checked = {}, {}
        for d, br in ranges.items():
            xd, od = x.to(br.dtype), other.to(br.dtype)
            kv, kv_other = br.allocate_kv(n), br.allocate_kv(n)
            rows = [br.forward([StepInput(kv, xd[:prompt_tokens]), StepInput(kv_other, od[:prompt_tokens])])[0]]
            for i in range(prompt_tokens, n):  # decode steps batched with another session's
                rows.append(br.forward([StepInput(kv, xd[i : i + 1]), StepInput(kv_other, od[i : i + 1])])[0])
            served[d] = torch.cat(rows)
            checked[d] = br.forward_stateless(xd.unsqueeze(0))[0]
        for a, b in errors:
            session_errors = row_errors(served[a], checked[b])
            errors[a, b].extend(session_errors.tolist())
            medians[a, b].append(float(session_errors.median()))
        print(f"calibrate: session {_ + 1}/{sessions} done", flush=True)
    out = {}
    for (a, b), errs in errors.items():
        errs.sort()
        bound = tolerance_for(getattr(torch, a), getattr(torch, b))
        out[f"{a} served, {b} check"] = {
            "rows": len(errs),
            "max": errs[-1],
            "p99": errs[int(0.99 * (len(errs) - 1))],
            "median": statistics.median(errs),
            "bound": bound,
            "margin": bound / errs[-1],
            "over_bound": sum(e > bound for e in errs),
            "session_median_max": max(medians[a, b]),
            "sessions_median_over_bound": sum(m > bound for m in medians[a, b]),
        }
        print(f"calibrate {a} served, {b} check: {out[f'{a} served, {b} check']}", flush=True)
    return {
        "sessions": sessions,
        "prompt_tokens": prompt_tokens,
        "decode_steps": decode_steps,
        "blocks": head.config.num_hidden_layers,
        "pairs": out,
    }


def rotating_chains(peers: list[str]):
    """A chain provider for the honest sessions: single-hop chains on `peers` in turn, session by
    session (thread-safe: sessions open from several threads)."""
    import threading

    from petals_chain.client.routing import ChainProvider
    from petals_chain.errors import NoChainError
    from petals_chain.wire.messages import Hop

    class RotatingChains(ChainProvider):
        def __init__(self):
            self.peers = peers
            self._lock = threading.Lock()
            self._turn = 0

        def find_chain(self, start, end, *, exclude=frozenset(), max_length=0, session_id="", adapter=None):
            with self._lock:
                self._turn += 1
                turn = self._turn
            free = [p for p in self.peers if p not in exclude]
            if not free:  # a mixed-dtype path has one serving peer, avoided for a while after a mismatch
                raise NoChainError(f"every serving peer of this path is excluded ({len(self.peers)} of them)")
            return [Hop(free[turn % len(free)], start, end)]

    return RotatingChains()


def _client(model_path, swarm, first_peer, allowed=None, dtype="float32", **config):
    from petals_chain.client.model import DistributedModelForCausalLM
    from petals_chain.client.verification import VerificationConfig
    from tests.swarm_helpers import ListedChains

    order = [first_peer] + [sp.peer_id for sp in swarm.servers if sp.peer_id != first_peer]
    if allowed is not None:
        order = [p for p in order if p in allowed]
    num_blocks = json.loads((Path(model_path) / "config.json").read_text())["num_hidden_layers"]
    return DistributedModelForCausalLM.from_pretrained(
        str(model_path),
        initial_peers=swarm.initial_peers,
        provider=ListedChains(order, num_blocks),
        allowed_servers=allowed,
        prefix_reuse=False,
        dtype=dtype,
        verification=VerificationConfig(**config),
    )


def _expected_steps(mode: str, p: float) -> dict:
    """What the steps to a catch are compared with: for rare:P, the issue's 1/(P p) (an audit that
    compared only the sampled step's rows) and this design's ~1/P + 1/p (the first corrupted step,
    then the next audit, which covers every row since the last); else 1/p (no probation)."""
    if mode.startswith("rare:"):
        rate = float(mode.split(":")[1])
        return {"expected_sampled_step_only": 1 / (rate * p), "expected_history_audit": 1 / rate + 1 / p}
    return {"expected_without_probation": 1 / p}


def _trial(model, prompt, tokens: int, trial: int, peer_id: str, *, probation: bool = True, **generate_kwargs):
    """One detection trial: the client meets the servers as a new client would (convictions forgotten, and
    probation unless `probation` is False), with other sampled steps each trial. Returns (output ids as lists,
    the session's chain steps, the first catch of `peer_id` or None, verification restarts, seconds)."""
    verification = model.backend.verification
    verification.forget(probation=probation)
    verification.rng.seed(1000 * trial + 17)
    t0 = time.perf_counter()
    with model.inference_session(max_length=prompt.shape[1] + tokens) as session:
        out = model.generate(prompt, max_new_tokens=tokens, do_sample=False, **generate_kwargs)
        steps = session.chain.verifier.steps
    first = next((c for c in verification.stats.catches if c.peer_id == peer_id), None)
    return out.tolist(), steps, first, session.verification_restarts, time.perf_counter() - t0


def detect(
    probabilities: list[float], trials: int, tokens: int, modes: list[str], probations: list[bool], rare_tokens: int
) -> dict:
    """Per mode, check probability and probation on/off: `trials` sessions starting on the corrupting
    server. Each mode's sessions may use only its server and the two honest ones (so the other
    corrupting servers neither check them nor count them as sessions); every trial meets the server
    as a new client would (convictions and probation forgotten), except after:N, whose server first
    serves N honest sessions of the same client (it passes probation there, as it would)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from petals_chain.swarm.local import LocalSwarm

    tmp = Path(tempfile.mkdtemp(prefix="bench-verify-"))
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
    )
    hf = LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp)
    prompt = torch.tensor([[5, 17, 42, 9, 77, 3, 21, 64]])
    n_tokens = {m: rare_tokens if m.startswith("rare") else tokens for m in modes}
    references = {
        n: hf.generate(prompt, max_new_tokens=n, do_sample=False, eos_token_id=None).tolist()
        for n in set(n_tokens.values())
    }
    names = ["honest0", "honest1"] + [f"corrupt-{m}" for m in modes]
    per_server = [[], []] + [["--test-corrupt", m, "--test-corrupt-seed", str(i)] for i, m in enumerate(modes)]
    results = []
    with LocalSwarm(
        str(tmp),
        [(0, 6)] * len(names),
        server_args=["--num-threads", "1"],
        per_server_args=per_server,
        names=names,
        start_timeout_s=600,
    ) as swarm:
        honest = {swarm.servers[0].peer_id, swarm.servers[1].peer_id}
        for mode, sp in zip(modes, swarm.servers[2:]):
            allowed = honest | {sp.peer_id}
            n = n_tokens[mode]
            after_n = int(mode.split(":")[1]) if mode.startswith("after:") else 0
            for probation in probations:
                for p in probabilities:
                    model = _client(tmp, swarm, sp.peer_id, allowed, check_probability=p, seed=17, probation=probation)
                    verification = model.backend.verification
                    try:
                        for _ in range(after_n):  # its honest sessions (the server counts sessions since its start)
                            model.generate(prompt, max_new_tokens=4, do_sample=False, eos_token_id=None)
                        for trial in range(trials):
                            out, steps, first, restarts, seconds = _trial(
                                model, prompt, n, trial, sp.peer_id, probation=not after_n, eos_token_id=None
                            )
                            wrong_step = None if first is None else max(1, first.position - prompt.shape[1] + 2)
                            row = {
                                "mode": mode,
                                "p": p,
                                "probation": probation,
                                "trial": trial,
                                "caught": first is not None,
                                "caught_by_probation": None if first is None else first.probation,
                                "caught_at_step": None if first is None else first.detected_at_step,
                                "convicted_at_step": None if first is None else first.convicted_at_step,
                                "first_wrong_step": wrong_step,
                                "steps_after_first_wrong": None
                                if first is None
                                else first.detected_at_step - wrong_step + 1,
                                "chain_steps": steps,
                                "restarts": restarts,
                                "equals_hf": out == references[n],
                                "seconds": seconds,
                            }
                            results.append(row)
                            print(f"detect {row}", flush=True)
                        stats = verification.stats.to_json()
                        stats.pop("catches")
                        print(f"detect {mode} p={p} probation={probation}: {stats}", flush=True)
                    finally:
                        model.backend.shutdown()
    summary = {}
    for mode in modes:
        for probation in probations:
            for p in probabilities:
                rows = [r for r in results if r["mode"] == mode and r["p"] == p and r["probation"] == probation]
                caught = [r for r in rows if r["caught"]]
                at = sorted(r["caught_at_step"] for r in caught)
                summary[f"{mode}@{p}{'' if probation else ' no-probation'}"] = {
                    "trials": len(rows),
                    "tokens": n_tokens[mode],
                    "caught": len(caught),
                    "all_equal_hf": all(r["equals_hf"] for r in rows),
                    "caught_at_step": at,
                    "median_caught_at_step": statistics.median(at) if at else None,
                    "max_caught_at_step": max(at, default=None),
                    "max_convicted_at_step": max((r["convicted_at_step"] for r in caught), default=None),
                    "median_steps_after_first_wrong": statistics.median([r["steps_after_first_wrong"] for r in caught])
                    if caught
                    else None,
                    **_expected_steps(mode, p),
                }
    return {"tokens": tokens, "rare_tokens": rare_tokens, "trials": trials, "results": results, "summary": summary}


def detect_mixed(modes: list[str], p: float, trials: int, tokens: int) -> dict:
    """Corrupting servers of each dtype checked only by honest servers of the other: the cross-dtype
    audit (median row rule) on a live swarm. Every trial meets the corrupting server as a new client."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from petals_chain.models.checkpoint import resolve_model_path
    from petals_chain.swarm.local import LocalSwarm

    path = resolve_model_path("smollm2-135m", show_progress=False)
    tok = AutoTokenizer.from_pretrained(path)
    prompt = tok("The three primary colors are", return_tensors="pt").input_ids
    dtypes = ("float32", "bfloat16")
    references = {}
    for d in dtypes:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, d)).eval()
        references[d] = hf.generate(prompt, max_new_tokens=tokens, do_sample=False).tolist()
        del hf
    names, per_server = [], []
    for d in dtypes:  # two honest checkers of each dtype
        for i in range(2):
            names.append(f"honest-{d}-{i}")
            per_server.append(["--dtype", d])
    for j, (d, m) in enumerate((d, m) for d in dtypes for m in modes):
        names.append(f"corrupt-{d}-{m}")
        per_server.append(["--dtype", d, "--test-corrupt", m, "--test-corrupt-seed", str(3 + j)])
    results = []
    with LocalSwarm(
        "smollm2-135m",
        [(0, 30)] * len(names),
        server_args=["--num-threads", "1"],
        per_server_args=per_server,
        names=names,
        start_timeout_s=600,
    ) as swarm:
        by_name = {n: sp.peer_id for n, sp in zip(names, swarm.servers)}
        for d in dtypes:
            other = "bfloat16" if d == "float32" else "float32"
            checkers = {by_name[f"honest-{other}-{i}"] for i in range(2)}
            # what the session gives once failed over: a session of dtype d through an honest server of the
            # other dtype (it casts the steps in and its replies back), unchecked
            honest = by_name[f"honest-{other}-0"]
            model = _client(path, swarm, honest, {honest}, dtype=d)
            try:
                references[f"{d} via honest {other}"] = _trial(model, prompt, tokens, 0, honest)[0]
            finally:
                model.backend.shutdown()
            for m in modes:
                bad = by_name[f"corrupt-{d}-{m}"]
                model = _client(
                    path, swarm, bad, checkers | {bad}, dtype=d, check_probability=p, seed=17, probation=True
                )
                verification = model.backend.verification
                try:
                    for trial in range(trials):
                        out, steps, first, _, seconds = _trial(model, prompt, tokens, trial, bad)
                        row = {
                            "mode": m,
                            "dtype": d,
                            "checker_dtype": other,
                            "p": p,
                            "trial": trial,
                            "caught": first is not None,
                            "caught_at_step": None if first is None else first.detected_at_step,
                            "convicted_at_step": None if first is None else first.convicted_at_step,
                            "verdict": None if first is None else str(first.verdict),
                            "chain_steps": steps,
                            "equals_hf_same_dtype": out == references[d],
                            "equals_hf_checker_dtype": out == references[other],
                            "equals_honest_mixed_chain": out == references[f"{d} via honest {other}"],
                            "seconds": seconds,
                        }
                        results.append(row)
                        print(f"detect-mixed {row}", flush=True)
                    stats = verification.stats.to_json()
                    stats.pop("catches")
                    print(f"detect-mixed {d} {m}: {stats}", flush=True)
                    results[-1]["verification"] = stats
                finally:
                    model.backend.shutdown()
    summary = {}
    for d in dtypes:
        for m in modes:
            rows = [r for r in results if r["mode"] == m and r["dtype"] == d]
            summary[f"{m} ({d}, checked by {rows[0]['checker_dtype']})"] = {
                "trials": len(rows),
                "caught": sum(r["caught"] for r in rows),
                "caught_at_step": [r["caught_at_step"] for r in rows],
                "equal_hf_same_dtype": sum(r["equals_hf_same_dtype"] for r in rows),
                "equal_hf_checker_dtype": sum(r["equals_hf_checker_dtype"] for r in rows),
                "equal_honest_mixed_chain": sum(r["equals_honest_mixed_chain"] for r in rows),
            }
    return {"p": p, "tokens": tokens, "trials": trials, "results": results, "summary": summary}


def smollm2_swarm():
    from petals_chain.swarm.local import LocalSwarm

    return LocalSwarm("smollm2-135m", [(0, 30)] * 3, server_args=["--num-threads", "1"], start_timeout_s=600)


def overhead(swarm, p: float, pairs: int, tokens: int) -> dict:
    from transformers import AutoTokenizer

    from petals_chain.models.checkpoint import resolve_model_path

    path = resolve_model_path("smollm2-135m", show_progress=False)
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [
        "The history of the printing press",
        "A recipe for bread needs",
        "In the year 1900 the city of",
        "The main ideas of thermodynamics are",
        "To learn a language quickly, one should",
    ]
    model = _client(path, swarm, swarm.servers[0].peer_id, check_probability=0.0, seed=5)
    rows = []
    try:
        model.generate(tok(prompts[0], return_tensors="pt").input_ids, max_new_tokens=4, do_sample=False)  # warm-up
        for i in range(pairs):
            ids = tok(prompts[i % len(prompts)], return_tensors="pt").input_ids
            order = [0.0, p] if i % 2 == 0 else [p, 0.0]
            pair = {}
            for q in order:
                t0 = time.perf_counter()
                out = model.generate(ids, max_new_tokens=tokens, do_sample=False, check_probability=q)
                pair[q] = ((out.shape[1] - ids.shape[1]) / (time.perf_counter() - t0), out.tolist())
            rows.append(
                {
                    "pair": i,
                    "tok_s_off": pair[0.0][0],
                    "tok_s_on": pair[p][0],
                    "ratio": pair[p][0] / pair[0.0][0],
                    "same_output": pair[p][1] == pair[0.0][1],
                }
            )
            print(f"overhead {rows[-1]}", flush=True)
        stats = model.backend.verification.stats.to_json()
    finally:
        model.backend.shutdown()
    ratios = [r["ratio"] for r in rows]
    return {
        "p": p,
        "pairs": pairs,
        "tokens": tokens,
        "median_ratio": statistics.median(ratios),
        "overhead_pct": 100 * (1 - statistics.median(ratios)),
        "rows": rows,
        "verification": stats,
        "load_avg": os.getloadavg(),
    }


def honest(swarm, sessions: int, budget_s: float, tokens: int, concurrency: int, paths: list[tuple]) -> dict:
    """False positives: honest sessions with every step audited (p = 1), `concurrency` at a time, for
    `sessions` sessions or `budget_s` seconds, whichever ends first. `paths`: (name, client dtype,
    serving peers, allowed peers) of each kind of session, the sessions shared among them in turn
    (a mixed-dtype swarm: float32 sessions on the float32 server checked by the bfloat16 one, and
    bfloat16 sessions the other way round). Short sessions: prompts of 4-11 random tokens, `tokens`
    new ones, so a session is a prompt step and `tokens - 1` decode steps, each audited."""
    import threading

    from petals_chain.models.checkpoint import resolve_model_path

    path = resolve_model_path("smollm2-135m", show_progress=False)
    clients = []
    out: dict = {"tokens": tokens, "check_probability": 1.0, "concurrency": concurrency, "paths": {}}
    try:
        for name, dtype, serving, allowed in paths:
            model = _client(path, swarm, serving[0], allowed, dtype=dtype, check_probability=1.0, seed=11)
            model.backend.provider = rotating_chains(serving)
            clients.append((name, model))
        lock = threading.Lock()
        state = {"started": 0, "running": 0, "done": 0, "failed": []}
        t0 = time.perf_counter()

        def worker(index: int) -> None:
            gen = torch.Generator().manual_seed(1000 + index)
            while True:
                with lock:
                    # completed sessions count toward `sessions`: a failed one (no chain while the path's
                    # only server is avoided) is counted apart and does not end the run early
                    if state["done"] + state["running"] >= sessions or time.perf_counter() - t0 > budget_s:
                        return
                    state["running"] += 1
                    n = state["started"]
                    state["started"] += 1
                _, model = clients[n % len(clients)]
                ids = torch.randint(100, 20000, (1, 4 + n % 8), generator=gen)
                try:
                    model.generate(ids, max_new_tokens=tokens, do_sample=False)
                except Exception as e:  # counted and shown, never a false positive
                    with lock:
                        state["running"] -= 1
                        state["failed"].append(f"{type(e).__name__}: {e}")
                    # back off: the path's server is avoided for the ban's 15 s after a mismatch
                    time.sleep(1.0)
                    continue
                with lock:
                    state["running"] -= 1
                    state["done"] += 1
                    if state["done"] % 50 == 0:
                        print(f"honest: {state['done']} sessions in {time.perf_counter() - t0:.0f} s", flush=True)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out["seconds"] = time.perf_counter() - t0
        out["sessions"] = state["done"]
        out["failed_sessions"] = len(state["failed"])
        out["failures"] = state["failed"][:5]
        total = {"mismatches": 0, "catches": 0, "rows_verified": 0, "audits": 0, "cheap_rejections": 0}
        for name, model in clients:
            stats = model.backend.verification.stats.to_json()
            out["paths"][name] = stats
            for k in total:
                total[k] += len(stats[k]) if k == "catches" else stats[k]
        out.update(total)
        out["false_positives"] = total["mismatches"] + total["cheap_rejections"]
        print(f"honest: {out}", flush=True)
    finally:
        for _, model in clients:
            model.backend.shutdown()
    return out


def mixed_swarm():
    """SmolLM2-135M on two servers holding all 30 blocks: one float32, one bfloat16."""
    from petals_chain.swarm.local import LocalSwarm

    return LocalSwarm(
        "smollm2-135m",
        [(0, 30)] * 2,
        server_args=["--num-threads", "1"],
        per_server_args=[["--dtype", "float32"], ["--dtype", "bfloat16"]],
        names=["f32", "bf16"],
        start_timeout_s=600,
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default="calibrate,detect,detect-mixed,overhead,honest,honest-mixed")
    p.add_argument("--out", default=str(REPO / "results" / "bench_verify.json"))
    p.add_argument("--calibrate-sessions", type=int, default=8)
    p.add_argument("--calibrate-tokens", type=int, default=24, help="prompt tokens, and as many decode steps")
    p.add_argument("--probabilities", default="0.05,0.1,0.2")
    p.add_argument("--modes", default="noise,rare:0.01,rare:0.05,skip-last,after:2")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--detect-tokens", type=int, default=60)
    p.add_argument("--rare-detect-tokens", type=int, default=400, help="tokens per session of the rare:P modes")
    p.add_argument("--probation", default="on,off", help="detect with probation on, off or both (on,off)")
    p.add_argument("--overhead-p", type=float, default=0.05)
    p.add_argument("--overhead-pairs", type=int, default=6)
    p.add_argument("--overhead-tokens", type=int, default=32)
    p.add_argument("--honest-sessions", type=int, default=1000)
    p.add_argument("--honest-budget-s", type=float, default=540.0, help="per honest section (honest, honest-mixed)")
    p.add_argument("--honest-tokens", type=int, default=2, help="new tokens per honest session")
    p.add_argument("--honest-concurrency", type=int, default=2, help="honest sessions at a time")
    p.add_argument("--calibrate-dtypes", default="float32,bfloat16")
    p.add_argument("--detect-mixed-modes", default="noise,skip-last")
    p.add_argument("--detect-mixed-p", type=float, default=0.1)
    p.add_argument("--detect-mixed-tokens", type=int, default=20)
    args = p.parse_args(argv)
    sections = args.sections.split(",")
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_avg_start": os.getloadavg()}
    if "calibrate" in sections:
        result["calibrate"] = calibrate(
            args.calibrate_sessions, args.calibrate_tokens, args.calibrate_tokens, args.calibrate_dtypes.split(",")
        )
    if "detect" in sections:
        result["detect"] = detect(
            [float(x) for x in args.probabilities.split(",")],
            args.trials,
            args.detect_tokens,
            args.modes.split(","),
            [{"on": True, "off": False}[x] for x in args.probation.split(",")],
            args.rare_detect_tokens,
        )
    if "detect-mixed" in sections:
        result["detect_mixed"] = detect_mixed(
            args.detect_mixed_modes.split(","), args.detect_mixed_p, args.trials, args.detect_mixed_tokens
        )
    if "overhead" in sections or "honest" in sections:
        with smollm2_swarm() as swarm:
            if "overhead" in sections:
                result["overhead"] = overhead(swarm, args.overhead_p, args.overhead_pairs, args.overhead_tokens)
            if "honest" in sections:
                peers = [sp.peer_id for sp in swarm.servers]
                result["honest"] = honest(
                    swarm,
                    args.honest_sessions,
                    args.honest_budget_s,
                    args.honest_tokens,
                    args.honest_concurrency,
                    [("float32", "float32", peers, None)],
                )
    if "honest-mixed" in sections:
        with mixed_swarm() as swarm:
            f32, bf16 = (sp.peer_id for sp in swarm.servers)
            result["honest_mixed"] = honest(
                swarm,
                args.honest_sessions,
                args.honest_budget_s,
                args.honest_tokens,
                args.honest_concurrency,
                [
                    ("float32 session, bfloat16 checker", "float32", [f32], {f32, bf16}),
                    ("bfloat16 session, float32 checker", "bfloat16", [bf16], {f32, bf16}),
                ],
            )
    result["load_avg_end"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    summary = {k: v for k, v in result.items() if k not in ("detect", "detect_mixed")}
    for key in ("detect", "detect_mixed"):
        if key in result:
            summary[key] = result[key]["summary"]
    print(
        json.dumps(
            {
                k: (
                    v
                    if k not in ("overhead", "honest", "honest_mixed")
                    else {kk: vv for kk, vv in v.items() if kk not in ("rows", "paths")}
                )
                for k, v in summary.items()
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
