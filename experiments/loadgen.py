"""The Table 1 load generator: replays scaled trace requests against a swarm, one record each.

Runs as its own process on the client host (inside its network namespace when the WAN is
emulated): `python -m experiments.loadgen --initial-peers MADDR --requests reqs.json --out recs.jsonl`.
Each request starts at its (scaled) arrival time in its own thread, acquires a chain (the
orchestrator's JFFC or router grant, or a queue wait), sends a prompt of exactly `input_tokens`
tokens and generates exactly `output_tokens` tokens greedily (no early stop at EOS). Every request
ends up as exactly one JSON line: finished, or failed with its error (also those still running at
the replay deadline), so none is lost.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy as np

from petals_chain.cli.args import DTYPE_CHOICES

RECORD_FIELDS = (
    "index",
    "policy",
    "arrival_s",
    "submitted_s",
    "start_s",
    "first_token_s",
    "end_s",
    "input_tokens",
    "output_tokens",
    "generated_tokens",
    "chain",
    "hops",
    "orchestrator_wait_s",
    "error",
)


def prompt_ids(rng: np.random.Generator, n_tokens: int, vocab_size: int) -> list[int]:
    """A prompt of exactly n tokens (random ordinary token ids, seeded: compute does not depend on content)."""
    low = min(256, vocab_size // 2)  # skip the special / byte tokens at the start of the vocabulary
    return rng.integers(low, vocab_size, size=n_tokens).tolist()


def hop_summary(timings, names: dict[str, str]) -> list[dict]:
    """Per hop of the chain: its prefill step and the sum over its decode steps (client and server time,
    and the server's batch forward time: `*_batch_s`; server - batch is time in the server outside
    the batch: queue, gathering, thread hand-offs)."""
    hops: dict[int, dict] = {}
    for t in timings:
        h = hops.setdefault(
            t.hop_index,
            {
                "peer_id": t.peer_id,
                "name": names.get(t.peer_id, ""),
                "blocks": t.blocks,
                "prefill_tokens": 0,
                "prefill_client_s": None,
                "prefill_server_s": None,
                "prefill_batch_s": None,
                "decode_steps": 0,
                "decode_client_s": 0.0,
                "decode_server_s": 0.0,
                "decode_batch_s": 0.0,
            },
        )
        if h["prefill_client_s"] is None:
            h.update(
                prefill_tokens=t.tokens,
                prefill_client_s=t.client_s,
                prefill_server_s=t.server_s,
                prefill_batch_s=t.compute_s,
            )
        else:
            h["decode_steps"] += 1
            h["decode_client_s"] += t.client_s
            h["decode_server_s"] = (
                None if t.server_s is None or h["decode_server_s"] is None else h["decode_server_s"] + t.server_s
            )
            h["decode_batch_s"] = (
                None if t.compute_s is None or h["decode_batch_s"] is None else h["decode_batch_s"] + t.compute_s
            )
    return [hops[i] for i in sorted(hops)]


def running_stacks(names_by_ident: dict[int, str]) -> str:
    """The current Python stack of each named live thread (by thread ident), as text; '' if none."""
    frames = sys._current_frames()
    parts = [
        f"--- {name}\n" + "".join(traceback.format_stack(frames[ident]))
        for ident, name in sorted(names_by_ident.items(), key=lambda kv: kv[1])
        if ident in frames
    ]
    return "\n".join(parts)


class Replayer:
    def __init__(self, model, requests: list[dict], policy: str, out_path: Path, seed: int, clock=time.monotonic):
        self.model = model
        self.requests = requests
        self.policy = policy
        self.out_path = out_path
        self.seed = seed
        self.clock = clock
        self.lock = threading.Lock()
        self.written: set[int] = set()
        self.failed = 0  # written records with an error
        self.first_error: str | None = None
        self.t0 = 0.0
        self.out = open(out_path, "w")

    def write(self, rec: dict) -> None:
        with self.lock:
            if rec["index"] in self.written:
                return
            self.written.add(rec["index"])
            if rec["error"]:
                self.failed += 1
                self.first_error = self.first_error or rec["error"]
            self.out.write(json.dumps(rec) + "\n")
            self.out.flush()

    def failed_note(self) -> str:
        """ ", N failed (first: ERROR)" once a request failed: a run whose every request fails says so
        while it runs, not only in its summary."""
        with self.lock:
            return f", {self.failed} failed (first: {self.first_error})" if self.failed else ""

    def run_one(self, req: dict) -> None:
        import torch

        rec = {k: None for k in RECORD_FIELDS}
        rec.update(
            index=req["index"],
            policy=self.policy,
            arrival_s=req["arrival_s"],
            input_tokens=req["input_tokens"],
            output_tokens=req["output_tokens"],
            generated_tokens=0,
            submitted_s=self.clock() - self.t0,
        )
        backend, head = self.model.backend, self.model.head
        rng = np.random.default_rng([self.seed, req["index"]])
        ids = torch.tensor(prompt_ids(rng, req["input_tokens"], self.model.config.vocab_size))
        session = None
        try:
            with torch.inference_mode():
                # "avoid" (the model probe's requests): servers outside the one chain this request measures
                session = backend.open_session(req["input_tokens"] + req["output_tokens"], avoid=req.get("avoid", ()))
                # the orchestrator's grant lives on the session's lease (None with client-side routing)
                lease = getattr(session, "lease", None)
                granted = lease.granted_at_s if lease is not None else None
                rec["start_s"] = (granted if granted is not None else self.clock()) - self.t0
                grant = lease.grant if lease is not None else None
                rec["orchestrator_wait_s"] = grant.wait_s if grant is not None else None
                names = {h.peer_id: h.name for h in grant.hops} if grant is not None else {}
                rec["chain"] = session.describe()
                hidden = session.step(head.embed_tokens(ids))
                token = int(head.logits(hidden[-1:]).argmax(-1))
                rec["first_token_s"] = self.clock() - self.t0
                rec["generated_tokens"] = 1
                for _ in range(req["output_tokens"] - 1):
                    hidden = session.step(head.embed_tokens(torch.tensor([token])))
                    token = int(head.logits(hidden[-1:]).argmax(-1))
                    rec["generated_tokens"] += 1
                rec["hops"] = hop_summary(session.hop_timings, names)
        except Exception as e:  # noqa: BLE001 - every failure is recorded with its error, none is lost
            rec["error"] = f"{type(e).__name__}: {e}"
        finally:
            if session is not None:
                try:
                    session.close()
                except Exception as e:  # noqa: BLE001 - a failed close is recorded, never raised
                    rec["error"] = rec["error"] or f"close failed: {type(e).__name__}: {e}"
            rec["end_s"] = self.clock() - self.t0
            self.write(rec)

    def run_sequentially(self) -> None:
        """One request after another, each alone (the model probe): arrival times are ignored."""
        self.t0 = self.clock()
        for i, req in enumerate(self.requests):
            self.run_one(req)
            print(f"loadgen: {i + 1}/{len(self.requests)} done (sequentially){self.failed_note()}", flush=True)
        self.out.close()

    def replay(self, deadline_s: float, lead_s: float = 1.0) -> int:
        """Start every request at t0 + arrival; wait until all finished or `deadline_s` after the last arrival."""
        self.t0 = self.clock() + lead_s
        threads = []
        for i, req in enumerate(self.requests):
            delay = self.t0 + req["arrival_s"] - self.clock()
            if delay > 0:
                time.sleep(delay)  # the trace's arrival process: waiting for the next arrival time IS the workload
            t = threading.Thread(target=self.run_one, args=(req,), name=f"req-{req['index']}", daemon=True)
            t.start()
            threads.append(t)
            if (i + 1) % 10 == 0:
                print(
                    f"loadgen: {i + 1}/{len(self.requests)} submitted, {len(self.written)} done{self.failed_note()}",
                    flush=True,
                )
        end_by = self.clock() + deadline_s
        for t in threads:
            t.join(max(0.0, end_by - self.clock()))
        late = 0
        stacks = running_stacks({t.ident: t.name for t in threads if t.is_alive()})
        for req in self.requests:  # still running at the deadline: recorded as failed, never dropped
            if req["index"] not in self.written:
                late += 1
                self.write(
                    {
                        **{k: None for k in RECORD_FIELDS},
                        "index": req["index"],
                        "policy": self.policy,
                        "arrival_s": req["arrival_s"],
                        "input_tokens": req["input_tokens"],
                        "output_tokens": req["output_tokens"],
                        "generated_tokens": 0,
                        "error": f"DeadlineError: not finished {deadline_s:.0f} s after the last arrival",
                    }
                )
        if stacks:  # where the late requests hang: the evidence a hung session leaves (nothing else does)
            Path(self.out_path).with_suffix(".late_stacks.txt").write_text(stacks)
        self.out.close()
        return late


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.loadgen", description=__doc__)
    p.add_argument("--initial-peers", nargs="+", required=True)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=DTYPE_CHOICES,
        help="the client head's dtype: the servers' (they refuse hidden states of another)",
    )
    p.add_argument("--device", default="cpu", help="where the client head runs (cuda with the GPU variant)")
    p.add_argument(
        "--requests", required=True, help="JSON list of scaled requests (experiments.workload.ScaledRequest)"
    )
    p.add_argument("--out", required=True, help="JSONL file: one record per request")
    p.add_argument("--policy", default="", help="label written into every record")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt token ids")
    p.add_argument(
        "--deadline", type=float, default=600.0, help="seconds after the last arrival to wait for stragglers"
    )
    p.add_argument("--acquire-timeout", type=float, default=900.0, help="seconds a request may wait for a chain")
    p.add_argument(
        "--sequential",
        action="store_true",
        help="run the requests one after another, each alone, ignoring their arrival times (the model probe)",
    )
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    from petals_chain.client.model import DistributedModelForCausalLM

    requests = json.loads(Path(args.requests).read_text())
    if not isinstance(requests, list) or not requests:
        print("loadgen: --requests must hold a non-empty JSON list", file=sys.stderr)
        return 2
    model = DistributedModelForCausalLM.from_pretrained(
        args.model,
        initial_peers=args.initial_peers,
        dtype=args.dtype,
        device=args.device,
        acquire_timeout_s=args.acquire_timeout,
        step_timeout_s=120.0,
    )
    try:
        print(f"loadgen: replaying {len(requests)} requests ({args.policy})", flush=True)
        replayer = Replayer(model, requests, args.policy, Path(args.out), args.seed)
        if args.sequential:
            replayer.run_sequentially()
            print("loadgen: done", flush=True)
        else:
            late = replayer.replay(args.deadline)
            print(f"loadgen: done ({late} not finished by the deadline)", flush=True)
    finally:
        model.backend.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
