"""The framework's cost per hop on loopback: what a decode step costs through a server beyond its
blocks' compute, with the baselines measured in the same run.

A swarm of servers on 127.0.0.1 (`--model`, default the embedded SmolLM2; `--servers`, its blocks split evenly, one
thread each);
one client session with the client relaying (`relay="client"`, so every hop is one request/reply
the client times: `RemoteChainSession.hop_timings`). Per hop and decode step:
- `client_ms`: the client's time from sending the hidden states to having the reply;
- `server_ms`: the server's own time for the step (queue + batch compute, `StepReply.server_s`);
- `compute_ms`: the server's batch forward time for the step (`StepReply.compute_s`); a tree that
  does not report it falls back to the same blocks' forward timed here in-process (one thread);
framework cost per hop = client_ms - compute_ms (median and p90), split into wire (client - server)
and server-side overhead (server - compute). Per whole decode step, for both relays
(`step_framework_ms_per_hop_<relay>_relay_*`): the step's client time (`RemoteChainSession.step_timings`:
the caller's `step` call, its hand-off to the client's event loop included) minus its hops' batch forward
times, over the number of hops; under server relay the hops' replies to the client overlap the next
hop's work, so this is the only per-hop cost that relay has. `--transports p2p,direct` (default): the same on one
swarm whose servers also take direct TCP streams (launch-server --direct-port), once with the client
through the p2p daemons and once direct (keys of the direct run prefixed `direct_`). Also one session's tok/s through
the chain (each relay)
against local HF generate with one thread; and our framing's CPU cost per hop (`codec_*_us`: the
four encode/decode operations of a hop, protobuf parts and raw frames, best of many runs and cold
(each right after a forward-like matmul); `--codec-only` measures just that).

Wall times on a loaded machine are mostly waiting for a core, so the run also counts what depends
less on the load: the CPU time and the times scheduled onto a CPU (wake-ups, each a scheduling delay
under load) of every process of the run (this one, the servers and their DHT children, every p2p
daemon: /proc/*/task/*/schedstat) over the timed generate, minus the same processes idle for as long
(DHT announces, the Go runtime's timers), per token and hop (`<kind>_cpu_us_per_hop_<relay>`,
`<kind>_wakeups_per_hop_<relay>`; kinds `p2pd`, `servers` and `client`, which includes the client's
embedding and LM head); the servers' own batch CPU (their service records) is taken out of
`servers_framework_cpu_us_per_hop_<relay>`.
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

from petals_chain.cli.args import DTYPE_CHOICES  # noqa: E402  (the tree measured, as below)


def pct(xs, q) -> float:
    return float(np.percentile(np.asarray(xs), q))


def compute_ms_per_range(path, bounds, steps: int, dtype: str = "float32") -> list[list[float]]:
    """Decode-step forward times (ms) of each block range, one row at a time, in this process."""
    from petals_chain.runtime.block_range import BlockRange, StepInput

    out = []
    for start, end in zip(bounds, bounds[1:]):
        br = BlockRange(path, start, end, model_path=path, dtype=dtype)
        kv = br.allocate_kv(steps + 40)
        br.forward(
            [StepInput(kv, torch.randn(20, br.hidden_size, dtype=br.dtype))]
        )  # a prompt in the cache, as in the session
        times = []
        for _ in range(steps):
            x = torch.randn(1, br.hidden_size, dtype=br.dtype)
            t = time.perf_counter()
            br.forward([StepInput(kv, x)])
            times.append((time.perf_counter() - t) * 1e3)
        out.append(times)
        del br
    return out


def _tree_pids(root: int) -> dict[int, str]:
    """`root` and all its descendants, each with its command's short name (python, p2pd, ...)."""
    parent, name = {}, {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            parent[int(d.name)] = int(stat[stat.rindex(")") + 2 :].split()[1])
            name[int(d.name)] = stat[stat.index("(") + 1 : stat.rindex(")")]
    tree, frontier = {root}, [root]
    while frontier:
        kids = [p for p, pp in parent.items() if pp in frontier and p not in tree]
        tree.update(kids)
        frontier = kids
    return {p: name.get(p, "?") for p in tree}


def tree_usage(root: int) -> dict[int, tuple[str, int, int]]:
    """Per process of `root`'s tree: (name, CPU ns, times scheduled onto a CPU), summed over its threads."""
    out = {}
    for pid, name in _tree_pids(root).items():
        cpu_ns = runs = 0
        try:
            for task in Path(f"/proc/{pid}/task").iterdir():
                fields = (task / "schedstat").read_text().split()
                cpu_ns, runs = cpu_ns + int(fields[0]), runs + int(fields[2])
        except OSError:
            continue
        out[pid] = (name, cpu_ns, runs)
    return out


def usage_delta(before: dict, after: dict, root: int) -> dict[str, tuple[float, int]]:
    """(CPU us, runs) per kind of process between two `tree_usage`s: `client` (this process),
    `servers` (the servers' Pythons and DHT children), `p2pd` (every daemon)."""
    kinds: dict[str, list] = {"client": [0.0, 0], "servers": [0.0, 0], "p2pd": [0.0, 0]}
    for pid, (name, cpu_ns, runs) in after.items():
        _, cpu0, runs0 = before.get(pid, (name, 0, 0))
        k = kinds["client" if pid == root else ("p2pd" if "p2pd" in name else "servers")]
        k[0] += (cpu_ns - cpu0) / 1e3
        k[1] += runs - runs0
    return {k: (v[0], v[1]) for k, v in kinds.items()}


def batch_cpu_us(model, peers: list[str], since: dict[str, int]) -> tuple[float, dict[str, int]]:
    """The servers' batch CPU (us) after the cursors `since` (their service records), and the new cursors."""
    from petals_chain.transport.protocol import fetch_service_records

    total, cursors = 0.0, {}
    for peer in peers:
        records = fetch_service_records(model.backend.loop, model.backend.p2p, peer, since.get(peer, -1)) or []
        total += sum(rec.cpu_s for rec in records) * 1e6
        cursors[peer] = max([rec.seq for rec in records], default=since.get(peer, -1))
    return total, cursors


def codec_us_per_hop(reps: int = 300, n: int = 20, cold_reps: int = 100) -> dict:
    """Our framing's CPU cost per hop and decode step (us, best of `reps` runs of `n`, so a loaded
    machine's preemptions drop out): the client encodes the step and decodes the reply, the server
    decodes the step and encodes the reply (wire_parts + the typed records; hivemind's protobuf and
    p2pd are not in it), in protobuf parts (`codec_*`) and in raw frames (`codec_raw_*`, what decode
    steps use). Also each cold (`*_cold_*`, median of `cold_reps` single runs right after a forward-like
    matmul): what a hop pays, several times the hot figure on this machine."""
    from petals_chain.wire import parts as wire_parts
    from petals_chain.wire.messages import Close, Open, Step, StepReply, decode_tagged

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

    weight, row = torch.randn(576, 6144), torch.randn(1, 576)

    def cold_us(fn) -> float:
        """Median of single runs each right after ~12 ms of a one-row matmul over 14 MB of weights,
        as a hop's codec runs after a forward: its code and data evicted from the caches."""
        times = []
        for _ in range(cold_reps):
            end = time.perf_counter() + 0.012
            while time.perf_counter() < end:
                row @ weight
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return float(np.median(times)) * 1e6

    raw_step, raw_reply = wire_parts.encode_raw(step.to_wire(), x), wire_parts.encode_raw(reply.to_wire(), x)
    ops = {
        "encode_step": lambda: wire_parts.to_messages(step.to_wire(), (x,)),
        "decode_step": lambda: decode_tagged(wire_parts.Assembler().feed(step_msg)[0].meta, Open, Step, Close),
        "encode_reply": lambda: wire_parts.to_messages(reply.to_wire(), (x,), reply=True),
        "decode_reply": lambda: StepReply.from_wire(wire_parts.Assembler().feed(reply_msg)[0].meta),
    }
    raw_ops = {
        "encode_step": lambda: wire_parts.encode_raw(step.to_wire(), x),
        "decode_step": lambda: decode_tagged(wire_parts.decode_raw(raw_step).meta, Open, Step, Close),
        "encode_reply": lambda: wire_parts.encode_raw(reply.to_wire(), x),
        "decode_reply": lambda: StepReply.from_wire(wire_parts.decode_raw(raw_reply).meta),
    }
    out = {}
    for prefix, table in (("codec", ops), ("codec_raw", raw_ops)):
        hot = {k: best_us(fn) for k, fn in table.items()}
        cold = {k: cold_us(fn) for k, fn in table.items()} if cold_reps else {}
        out.update({f"{prefix}_{k}_us": v for k, v in hot.items()})
        out[f"{prefix}_us_per_hop"] = sum(hot.values())
        if cold:
            out.update({f"{prefix}_cold_{k}_us": v for k, v in cold.items()})
            out[f"{prefix}_cold_us_per_hop"] = sum(cold.values())
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--out", default="results/bench_hop_overhead.json")
    p.add_argument("--codec-only", action="store_true", help="only the framing's CPU cost per hop (no swarm)")
    p.add_argument(
        "--transports",
        default="p2p,direct",
        help="comma-separated: p2p (through the p2p daemons), direct (servers' --direct-port streams); "
        "each measured on the same swarm, keys of direct prefixed `direct_` (default both)",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=DTYPE_CHOICES,
        help="the servers' and the client's dtype; local HF runs in it too (default float32)",
    )
    p.add_argument(
        "--model",
        default="smollm2-135m",
        help="a model name or checkpoint folder, e.g. a random-weight one of SmolLM2's shape from "
        "scripts/make_random_checkpoint.py on a host without the embedded model (default smollm2-135m)",
    )
    args = p.parse_args()
    transports = [t for t in args.transports.split(",") if t]
    if not transports or any(t not in ("p2p", "direct") for t in transports):
        p.error(f"--transports takes p2p and/or direct, got {args.transports!r}")
    torch.set_num_threads(1)
    if args.codec_only:
        print(json.dumps({"loadavg": os.getloadavg()[0], **codec_us_per_hop()}, indent=2))
        return 0
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from petals_chain.client.model import DistributedModelForCausalLM
    from petals_chain.models.checkpoint import resolve_model_path
    from petals_chain.swarm.local import LocalSwarm

    path = resolve_model_path(args.model)
    try:
        ids = AutoTokenizer.from_pretrained(path)(
            "Tell me a short story about a lighthouse keeper.", return_tensors="pt"
        ).input_ids
    except (OSError, ValueError):  # a checkpoint without a tokenizer (random weights): fixed ids
        ids = torch.arange(1, 13).unsqueeze(0) * 37
    n = args.new_tokens
    r: dict = {
        "servers": args.servers,
        "new_tokens": n,
        "transports": transports,
        "dtype": args.dtype,
        "model": args.model,
        "cpu_count": os.cpu_count(),
        "loadavg_start": os.getloadavg()[0],
    }
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    layers = hf.config.num_hidden_layers
    bounds = [round(i * layers / args.servers) for i in range(args.servers + 1)]
    hf.generate(ids, max_new_tokens=2, do_sample=False)
    me = os.getpid()
    usage0, t = tree_usage(me), time.perf_counter()
    ref = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    r["hf_local_tok_s"] = n / (time.perf_counter() - t)
    r["hf_cpu_us_per_token"] = usage_delta(usage0, tree_usage(me), me)["client"][0] / n
    del hf
    compute = compute_ms_per_range(path, bounds, n, args.dtype)
    direct_args = ["--direct-port", "0"] if "direct" in transports else []
    with LocalSwarm(
        args.model,
        list(zip(bounds, bounds[1:])),
        server_args=["--num-threads", "1", "--no-orchestrator", "--dtype", args.dtype, *direct_args],
    ) as swarm:
        for transport, relay in [(t, rl) for t in transports for rl in ("client", "server")]:
            pre = "direct_" if transport == "direct" else ""
            kwargs = {"direct_streams": transport == "direct"} if direct_args else {}
            try:
                model = DistributedModelForCausalLM.from_pretrained(
                    args.model, initial_peers=swarm.initial_peers, relay=relay, dtype=args.dtype, **kwargs
                )
            except TypeError:  # a tree from before the relay option (the "before" measurement): client relay only
                if relay != "client":
                    continue
                model = DistributedModelForCausalLM.from_pretrained(args.model, initial_peers=swarm.initial_peers)
            try:
                model.generate(ids, max_new_tokens=2, do_sample=False)  # warm-up: routing, connections
                dialer = getattr(model.backend.hops, "dialer", None)
                if dialer is not None:  # the servers' direct-stream offers, asked for beside the warm-up
                    model.backend.loop.run(dialer.asked(), timeout_s=10)
                peers = [sp.peer_id for sp in swarm.servers]
                _, cursors = batch_cpu_us(model, peers, {})
                with model.inference_session(max_length=ids.shape[1] + n + 2) as session:
                    usage0, t = tree_usage(me), time.perf_counter()
                    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
                    elapsed_s = time.perf_counter() - t
                    used = usage_delta(usage0, tree_usage(me), me)
                    r[f"{pre}chain_tok_s_{relay}_relay"] = n / elapsed_s
                    r[f"{pre}exact_{relay}_relay"] = out.tolist() == ref.tolist()
                    if transport == "direct":  # what carried the steps (a fallback to p2p would void the row)
                        r[f"{pre}streams_opened_direct_{relay}_relay"] = model.backend.hops.dialer.direct_opened
                    timings = session.chain.hop_timings
                    step_timings = getattr(session.chain, "step_timings", [])  # a tree from before: none
                batches_us, _ = batch_cpu_us(model, peers, cursors)
                usage0 = tree_usage(me)  # the same processes idle for as long: what they do anyway
                time.sleep(elapsed_s)
                idle = usage_delta(usage0, tree_usage(me), me)
            finally:
                model.backend.shutdown()
            per_hop = n * args.servers
            for kind in ("p2pd", "servers", "client"):
                r[f"{pre}{kind}_cpu_us_per_hop_{relay}"] = (used[kind][0] - idle[kind][0]) / per_hop
                r[f"{pre}{kind}_wakeups_per_hop_{relay}"] = (used[kind][1] - idle[kind][1]) / per_hop
            r[f"{pre}servers_framework_cpu_us_per_hop_{relay}"] = (
                used["servers"][0] - idle["servers"][0] - batches_us
            ) / per_hop
            # per decode step, either relay: (the step's client time - its hops' batch forward times) / hops
            per_step = [
                (st.client_s - sum(h.compute_s for h in timings[st.first_hop : st.end_hop])) * 1e3 / args.servers
                for st in step_timings
                if st.tokens == 1
                and st.end_hop - st.first_hop == args.servers
                and all(h.compute_s is not None for h in timings[st.first_hop : st.end_hop])
            ]
            if per_step:
                r[f"{pre}step_framework_ms_per_hop_{relay}_relay_median"] = float(np.median(per_step))
                r[f"{pre}step_framework_ms_per_hop_{relay}_relay_p90"] = pct(per_step, 90)
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
                compute_ms = (
                    np.array([h.compute_s * 1e3 for h in hop])
                    if reported
                    else np.full(len(hop), float(np.median(compute[j])))
                )
                framework = client_ms - compute_ms
                r[f"{pre}hop{j}_compute_source"] = "server" if reported else "in_process"
                r[f"{pre}hop{j}_compute_ms_median"] = float(np.median(compute_ms))
                r[f"{pre}hop{j}_client_ms_median"] = float(np.median(client_ms))
                r[f"{pre}hop{j}_framework_ms_median"] = float(np.median(framework))
                r[f"{pre}hop{j}_framework_ms_p90"] = pct(framework, 90)
                r[f"{pre}hop{j}_wire_ms_median"] = float(np.median(client_ms - server_ms))
                r[f"{pre}hop{j}_server_overhead_ms_median"] = float(np.median(server_ms - compute_ms))
    for pre in ["direct_" if t == "direct" else "" for t in transports]:
        if f"{pre}hop0_framework_ms_median" not in r:
            continue
        r[f"{pre}framework_ms_per_hop_median"] = float(
            np.mean([r[f"{pre}hop{j}_framework_ms_median"] for j in range(args.servers)])
        )
        r[f"{pre}framework_ms_per_hop_p90"] = float(
            np.mean([r[f"{pre}hop{j}_framework_ms_p90"] for j in range(args.servers)])
        )
        for relay in ("client", "server"):
            if f"{pre}chain_tok_s_{relay}_relay" in r:
                r[f"{pre}ratio_chain_{relay}_relay_vs_hf_local"] = (
                    r[f"{pre}chain_tok_s_{relay}_relay"] / r["hf_local_tok_s"]
                )
    r.update(codec_us_per_hop())
    r["loadavg_end"] = os.getloadavg()[0]
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(r, indent=2))
    print(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
