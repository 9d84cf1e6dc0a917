"""The framework's cost per hop on loopback: what a decode step costs through a server beyond its
blocks' compute, with the baselines measured in the same run.

A swarm of SmolLM2 servers on 127.0.0.1 (`--servers`, 30 blocks split evenly, one thread each);
one client session with the client relaying (`relay="client"`, so every hop is one request/reply
the client times: `RemoteChainSession.hop_timings`). Per hop and decode step:
- `client_ms`: the client's time from sending the hidden states to having the reply;
- `server_ms`: the server's own time for the step (queue + batch compute, `StepReply.server_s`);
- `compute_ms`: the server's batch forward time for the step (`StepReply.compute_s`); a tree that
  does not report it falls back to the same blocks' forward timed here in-process (one thread);
framework cost per hop = client_ms - compute_ms (median and p90), split into wire (client - server)
and server-side overhead (server - compute). Also one session's tok/s through the chain (each relay)
against local HF generate with one thread; and our framing's CPU cost per hop (`codec_*_us`: the
four encode/decode operations of a hop, best of many runs; `--codec-only` measures just that).
Prints one JSON object; writes results/bench_hop_overhead.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(os.environ.get("PETALS_CHAIN_TREE", Path(__file__).resolve().parents[1]))  # the tree measured
sys.path.insert(0, str(REPO))


def pct(xs, q) -> float:
    return float(np.percentile(np.asarray(xs), q))


def compute_ms_per_range(path, bounds, steps: int) -> list[list[float]]:
    """Decode-step forward times (ms) of each block range, one row at a time, in this process."""
    from petals_chain.runtime.block_range import BlockRange, StepInput

    out = []
    for start, end in zip(bounds, bounds[1:]):
        br = BlockRange(path, start, end, model_path=path)
        kv = br.allocate_kv(steps + 40)
        br.forward([StepInput(kv, torch.randn(20, br.hidden_size))])  # a prompt in the cache, as in the session
        times = []
        for _ in range(steps):
            x = torch.randn(1, br.hidden_size)
            t = time.perf_counter()
            br.forward([StepInput(kv, x)])
            times.append((time.perf_counter() - t) * 1e3)
        out.append(times)
        del br
    return out


def codec_us_per_hop(reps: int = 300, n: int = 20) -> dict:
    """Our framing's CPU cost per hop and decode step (us, best of `reps` runs of `n`, so a loaded
    machine's preemptions drop out): the client encodes the step and decodes the reply, the server
    decodes the step and encodes the reply (wire_parts + the typed records; hivemind's protobuf and
    p2pd are not in it)."""
    from petals_chain import wire_parts
    from petals_chain.messages import Close, Open, Step, StepReply, decode_tagged

    x = torch.randn(1, 576)  # one SmolLM2 hidden state
    step, reply = Step("s" * 32, 5, push_route=["a" * 46, "b" * 46]), StepReply("s" * 32, 5, 12, 0.01, 0.005)
    step_msg = wire_parts.to_messages(step.to_wire(), (x,))[0]
    reply_msg = wire_parts.to_messages(reply.to_wire(), (x,), reply=True)[0]

    def best_us(fn) -> float:
        for _ in range(100):
            fn()
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            for _ in range(n):
                fn()
            best = min(best, (time.perf_counter() - t) / n)
        return best * 1e6

    r = {"encode_step": best_us(lambda: wire_parts.to_messages(step.to_wire(), (x,))),
         "decode_step": best_us(lambda: decode_tagged(wire_parts.Assembler().feed(step_msg)[0].meta, Open, Step, Close)),
         "encode_reply": best_us(lambda: wire_parts.to_messages(reply.to_wire(), (x,), reply=True)),
         "decode_reply": best_us(lambda: StepReply.from_wire(wire_parts.Assembler().feed(reply_msg)[0].meta))}
    return {**{f"codec_{k}_us": v for k, v in r.items()}, "codec_us_per_hop": sum(r.values())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--out", default="results/bench_hop_overhead.json")
    p.add_argument("--codec-only", action="store_true", help="only the framing's CPU cost per hop (no swarm)")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.codec_only:
        print(json.dumps({"loadavg": os.getloadavg()[0], **codec_us_per_hop()}, indent=2))
        return 0
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from petals_chain.client.model import DistributedModelForCausalLM
    from petals_chain.local_swarm import LocalSwarm
    from petals_chain.models.checkpoint import resolve_model_path

    path = resolve_model_path("smollm2-135m")
    ids = AutoTokenizer.from_pretrained(path)("Tell me a short story about a lighthouse keeper.",
                                              return_tensors="pt").input_ids
    n = args.new_tokens
    bounds = [round(i * 30 / args.servers) for i in range(args.servers + 1)]
    r: dict = {"servers": args.servers, "new_tokens": n, "loadavg_start": os.getloadavg()[0]}
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    hf.generate(ids, max_new_tokens=2, do_sample=False)
    t = time.perf_counter()
    ref = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    r["hf_local_tok_s"] = n / (time.perf_counter() - t)
    del hf
    compute = compute_ms_per_range(path, bounds, n)
    with LocalSwarm("smollm2-135m", list(zip(bounds, bounds[1:])),
                    server_args=["--num-threads", "1", "--no-orchestrator"]) as swarm:
        for relay in ("client", "server"):
            try:
                model = DistributedModelForCausalLM.from_pretrained("smollm2-135m", initial_peers=swarm.initial_peers,
                                                                    relay=relay)
            except TypeError:  # a tree from before the relay option (the "before" measurement): client relay only
                if relay != "client":
                    continue
                model = DistributedModelForCausalLM.from_pretrained("smollm2-135m", initial_peers=swarm.initial_peers)
            try:
                model.generate(ids, max_new_tokens=2, do_sample=False)  # warm-up: routing, connections
                with model.inference_session(max_length=ids.shape[1] + n + 2) as session:
                    t = time.perf_counter()
                    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
                    r[f"chain_tok_s_{relay}_relay"] = n / (time.perf_counter() - t)
                    r[f"exact_{relay}_relay"] = out.tolist() == ref.tolist()
                    timings = session.chain.hop_timings
            finally:
                model.backend.shutdown()
            if relay != "client":
                continue
            decode = [h for h in timings if h.tokens == 1]
            for j in range(args.servers):
                hop = [h for h in decode if h.hop_index == j]
                client_ms = np.array([h.client_s * 1e3 for h in hop])
                server_ms = np.array([h.server_s * 1e3 for h in hop])
                # the server's own batch forward time of each step (same step, same load) when it
                # reports it; else this process's timing of the same blocks (a noisier baseline)
                reported = all(getattr(h, "compute_s", None) is not None for h in hop)
                compute_ms = (np.array([h.compute_s * 1e3 for h in hop]) if reported
                              else np.full(len(hop), float(np.median(compute[j]))))
                framework = client_ms - compute_ms
                r[f"hop{j}_compute_source"] = "server" if reported else "in_process"
                r[f"hop{j}_compute_ms_median"] = float(np.median(compute_ms))
                r[f"hop{j}_client_ms_median"] = float(np.median(client_ms))
                r[f"hop{j}_framework_ms_median"] = float(np.median(framework))
                r[f"hop{j}_framework_ms_p90"] = pct(framework, 90)
                r[f"hop{j}_wire_ms_median"] = float(np.median(client_ms - server_ms))
                r[f"hop{j}_server_overhead_ms_median"] = float(np.median(server_ms - compute_ms))
    r["framework_ms_per_hop_median"] = float(np.mean([r[f"hop{j}_framework_ms_median"] for j in range(args.servers)]))
    r["framework_ms_per_hop_p90"] = float(np.mean([r[f"hop{j}_framework_ms_p90"] for j in range(args.servers)]))
    for relay in ("client", "server"):
        if f"chain_tok_s_{relay}_relay" in r:
            r[f"ratio_chain_{relay}_relay_vs_hf_local"] = r[f"chain_tok_s_{relay}_relay"] / r["hf_local_tok_s"]
    r.update(codec_us_per_hop())
    r["loadavg_end"] = os.getloadavg()[0]
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(r, indent=2))
    print(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
