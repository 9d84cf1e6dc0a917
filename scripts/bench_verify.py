"""Benchmark the client's verification of servers (petals_chain/client/verification.py); JSON output.

Sections (`--sections`, default all), each measured in this run:

- `calibrate`: the honest-pair distribution behind the comparison bound. For each dtype, random
  sessions of SmolLM2-135M's blocks (all 30, in this process: no swarm) run as a server runs them
  (a prompt step, then 1-token decode steps, batched with another session's rows) and as a spot
  check recomputes them (one stateless forward of the whole history); the relative row errors'
  maximum and quantiles, against `hidden_compare.TOLERANCE_BY_DTYPE`.
- `detect`: detection latency on a live swarm of the tiny random Llama (6 blocks): two honest
  servers and one per corruption mode (`launch-server --test-corrupt`), each holding all blocks. Per
  mode and check probability p, `--trials` sessions whose chain starts on the corrupting server (a
  fresh ban list per trial), generating up to `--detect-tokens` greedy tokens; per trial the chain
  step whose audit caught the server (steps counted from the prompt step = 1) and the steps from the
  first wrong row's step to that catch, and whether the output equals HF greedy.
- `overhead`: tokens/s of greedy generation with spot checks at p = `--overhead-p` against none, on a
  3-server swarm of SmolLM2-135M (each server holds all 30 blocks, so every hop has a second and a
  third opinion), the two alternating session by session in the same run (paired ratio, median).
- `honest`: false positives: honest sessions on that swarm with p = 1 (every step audits every row
  since the last audit), for `--honest-sessions` sessions or `--honest-budget-s` seconds, whichever
  ends first; counts sessions, audits, rows compared and mismatches.

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


def calibrate(sessions: int, prompt_tokens: int, decode_steps: int) -> dict:
    from petals_chain.algorithms.hidden_compare import TOLERANCE_BY_DTYPE, row_errors
    from petals_chain.models.checkpoint import resolve_model_path
    from petals_chain.runtime.block_range import BlockRange, StepInput
    from petals_chain.runtime.client_head import ClientHead

    path = resolve_model_path("smollm2-135m", show_progress=False)
    head = ClientHead(path, dtype="float32", model_path=path)
    gen = torch.Generator().manual_seed(0)
    out = {}
    for dtype in ("float32", "bfloat16"):
        br = BlockRange(path, 0, head.config.num_hidden_layers, dtype=dtype)
        errors = []
        for _ in range(sessions):
            ids = torch.randint(0, head.config.vocab_size, (prompt_tokens + decode_steps,), generator=gen)
            x = head.embed_batched(ids).to(br.dtype)
            other = head.embed_batched(
                torch.randint(0, head.config.vocab_size, (prompt_tokens + decode_steps,), generator=gen)
            ).to(br.dtype)
            kv, kv_other = br.allocate_kv(len(ids)), br.allocate_kv(len(ids))
            served = [br.forward([StepInput(kv, x[:prompt_tokens]), StepInput(kv_other, other[:prompt_tokens])])[0]]
            for i in range(prompt_tokens, len(ids)):  # decode steps batched with another session's
                served.append(br.forward([StepInput(kv, x[i : i + 1]), StepInput(kv_other, other[i : i + 1])])[0])
            check = br.forward_stateless(x.unsqueeze(0))[0]
            errors.extend(row_errors(torch.cat(served), check).tolist())
        errors.sort()
        bound = TOLERANCE_BY_DTYPE[br.dtype]
        out[dtype] = {
            "rows": len(errors),
            "max": errors[-1],
            "p99": errors[int(0.99 * (len(errors) - 1))],
            "median": statistics.median(errors),
            "bound": bound,
            "margin": bound / errors[-1],
            "over_bound": sum(e > bound for e in errors),
        }
        print(f"calibrate {dtype}: {out[dtype]}", flush=True)
    return {
        "sessions": sessions,
        "prompt_tokens": prompt_tokens,
        "decode_steps": decode_steps,
        "blocks": 30,
        "dtypes": out,
    }


def _client(model_path, swarm, first_peer, **config):
    from petals_chain.client.model import DistributedModelForCausalLM
    from petals_chain.client.verification import VerificationConfig
    from tests.swarm_helpers import ListedChains

    order = [first_peer] + [sp.peer_id for sp in swarm.servers if sp.peer_id != first_peer]
    num_blocks = json.loads((Path(model_path) / "config.json").read_text())["num_hidden_layers"]
    return DistributedModelForCausalLM.from_pretrained(
        str(model_path),
        initial_peers=swarm.initial_peers,
        provider=ListedChains(order, num_blocks),
        prefix_reuse=False,
        verification=VerificationConfig(**config),
    )


def detect(probabilities: list[float], trials: int, tokens: int, modes: list[str]) -> dict:
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
    reference = hf.generate(prompt, max_new_tokens=tokens, do_sample=False, eos_token_id=None).tolist()
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
        for mode, sp in zip(modes, swarm.servers[2:]):
            for p in probabilities:
                model = _client(tmp, swarm, sp.peer_id, check_probability=p, seed=17)
                try:
                    for trial in range(trials):
                        verification = model.backend.verification
                        with verification._lock:  # a fresh ban list per trial: each one catches anew
                            verification.convicted.clear()
                            verification.stats.catches.clear()
                        t0 = time.perf_counter()
                        with model.inference_session(max_length=prompt.shape[1] + tokens) as session:
                            out = model.generate(prompt, max_new_tokens=tokens, do_sample=False, eos_token_id=None)
                            steps = session.chain.verifier.steps
                        catches = [c for c in verification.stats.catches if c.peer_id == sp.peer_id]
                        first = catches[0] if catches else None
                        wrong_step = None if first is None else max(1, first.position - prompt.shape[1] + 2)
                        row = {
                            "mode": mode,
                            "p": p,
                            "trial": trial,
                            "caught": first is not None,
                            "caught_at_step": None if first is None else first.detected_at_step,
                            "first_wrong_step": wrong_step,
                            "steps_after_first_wrong": None
                            if first is None
                            else first.detected_at_step - wrong_step + 1,
                            "chain_steps": steps,
                            "restarts": session.verification_restarts,
                            "equals_hf": out.tolist() == reference,
                            "seconds": time.perf_counter() - t0,
                            "reported": None if first is None else first.reported,
                        }
                        results.append(row)
                        print(f"detect {row}", flush=True)
                finally:
                    model.backend.shutdown()
    summary = {}
    for mode in modes:
        for p in probabilities:
            rows = [r for r in results if r["mode"] == mode and r["p"] == p]
            caught = [r for r in rows if r["caught"]]
            summary[f"{mode}@{p}"] = {
                "trials": len(rows),
                "caught": len(caught),
                "all_equal_hf": all(r["equals_hf"] for r in rows),
                "median_caught_at_step": statistics.median([r["caught_at_step"] for r in caught]) if caught else None,
                "max_caught_at_step": max([r["caught_at_step"] for r in caught], default=None),
                "median_steps_after_first_wrong": statistics.median([r["steps_after_first_wrong"] for r in caught])
                if caught
                else None,
                "expected_steps_after_first_wrong": 1 / p,
            }
    return {"tokens": tokens, "trials": trials, "results": results, "summary": summary}


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


def honest(swarm, sessions: int, budget_s: float, tokens: int) -> dict:
    from petals_chain.models.checkpoint import resolve_model_path

    path = resolve_model_path("smollm2-135m", show_progress=False)
    model = _client(path, swarm, swarm.servers[0].peer_id, check_probability=1.0, seed=11)
    gen = torch.Generator().manual_seed(1)
    done, t0 = 0, time.perf_counter()
    try:
        while done < sessions and time.perf_counter() - t0 < budget_s:
            first = swarm.servers[done % len(swarm.servers)].peer_id  # rotate which server serves
            model.backend.provider.peers = [first] + [sp.peer_id for sp in swarm.servers if sp.peer_id != first]
            ids = torch.randint(100, 20000, (1, 6 + done % 10), generator=gen)
            model.generate(ids, max_new_tokens=tokens, do_sample=False)
            done += 1
            if done % 10 == 0:
                print(f"honest: {done} sessions, {model.backend.verification.stats.to_json()}", flush=True)
        stats = model.backend.verification.stats.to_json()
    finally:
        model.backend.shutdown()
    return {
        "sessions": done,
        "seconds": time.perf_counter() - t0,
        "tokens": tokens,
        "check_probability": 1.0,
        "false_positives": stats["mismatches"],
        "verification": stats,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default="calibrate,detect,overhead,honest")
    p.add_argument("--out", default=str(REPO / "results" / "bench_verify.json"))
    p.add_argument("--calibrate-sessions", type=int, default=8)
    p.add_argument("--calibrate-tokens", type=int, default=24, help="prompt tokens, and as many decode steps")
    p.add_argument("--probabilities", default="0.05,0.1,0.2")
    p.add_argument("--modes", default="noise,rare:0.01,skip-last,after:2")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--detect-tokens", type=int, default=60)
    p.add_argument("--overhead-p", type=float, default=0.05)
    p.add_argument("--overhead-pairs", type=int, default=6)
    p.add_argument("--overhead-tokens", type=int, default=32)
    p.add_argument("--honest-sessions", type=int, default=1000)
    p.add_argument("--honest-budget-s", type=float, default=600.0)
    p.add_argument("--honest-tokens", type=int, default=6)
    args = p.parse_args(argv)
    sections = args.sections.split(",")
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_avg_start": os.getloadavg()}
    if "calibrate" in sections:
        result["calibrate"] = calibrate(args.calibrate_sessions, args.calibrate_tokens, args.calibrate_tokens)
    if "detect" in sections:
        result["detect"] = detect(
            [float(x) for x in args.probabilities.split(",")], args.trials, args.detect_tokens, args.modes.split(",")
        )
    if "overhead" in sections or "honest" in sections:
        with smollm2_swarm() as swarm:
            if "overhead" in sections:
                result["overhead"] = overhead(swarm, args.overhead_p, args.overhead_pairs, args.overhead_tokens)
            if "honest" in sections:
                result["honest"] = honest(swarm, args.honest_sessions, args.honest_budget_s, args.honest_tokens)
    result["load_avg_end"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    summary = {k: v for k, v in result.items() if k != "detect"}
    if "detect" in result:
        summary["detect"] = result["detect"]["summary"]
    print(
        json.dumps(
            {
                k: (v if k not in ("overhead", "honest") else {kk: vv for kk, vv in v.items() if kk != "rows"})
                for k, v in summary.items()
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
