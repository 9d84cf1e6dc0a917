"""Benchmark the emulated WAN (netem), with baselines measured in the same run.

1. The delay hub's throughput: TCP goodput (MB/s) and UDP packets/s between two emulated hosts at
   RTT 0, next to the same traffic over loopback inside one namespace (no hub); the hub's own CPU
   time per packet (from /proc), i.e. the packet rate one core could carry.
2. Delay error: RTT probes at targets 5/20/50/100 ms (median and p90 of measured - target), idle
   and while another pair of hosts pushes bulk TCP through the hub; plus the hub's own lateness.
3. One session's tokens/s through a 3-server chain (DHT, servers, client each on its own emulated
   host, every pair at the same RTT) at RTT 0/20/50/100 ms, next to the service time the
   orchestrator's model predicts for that chain: T = sum_j (tau_c_j + m_j tau_p_j) with tau_c =
   l_out x RTT and tau_p = t_o + t_I l_in + t_O (l_out - 1) from the servers' own t_I, t_O.

4. `--chain --servers N --rtt-ms R --relay client,server --json`: only the chain, once per relay
   (the client relays every hop, or each server pushes to the next: server/relay.py), on one swarm;
   prints one JSON object {"relay": {"client": {"step_ms", "tok_s", "model_step_ms"}, "server": {...}},
   "exact": bool (greedy tokens of every relay equal HF's), "server_peer_rtt_ms_median" (the RTTs the
   servers measured to each other and announce, next to the emulated RTT), ...}. The model's step per relay:
   client relay N x RTT, server relay (N + 1) x RTT / 2 (footnote 4's tau_c,ij legs), plus each
   block's t_O + 1 ms. Also per relay `beyond_legs_ms` (the measured step minus its legs: compute and
   framework), and `ratio_bound_at_this_work`: server relay's best ratio on this machine, its legs plus
   the client relay's `beyond_legs_ms` over the client relay's step ((N + 1) / 2N only as that work -> 0).

Needs root (namespaces). Prints a table and writes results/bench_netem.json.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np

import netem
from netem.probe import measure_rtt_ms, measure_throughput_bit_s
from netem.state import state_path
from netem.system import socket_in_netns
from petals_chain.cli.args import DTYPE_CHOICES

REPO = Path(__file__).resolve().parents[1]
HIDDEN_BYTES_2000_TOKEN_PREFILL = 2000 * 576 * 4  # SmolLM2-135M hidden size 576, float32


def udp_packets_per_s(src_ns, src_addr, dst_ns, dst_addr, *, size_bytes=64, duration_s=2.0) -> float:
    """Datagrams/s received at dst while one thread sends as fast as it can (the sender is Python too, so
    compare against the loopback baseline: equal rates mean the sender, not the hub, is the limit)."""
    rx = socket_in_netns(dst_ns, socket.AF_INET, socket.SOCK_DGRAM)
    rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    rx.bind((dst_addr, 0))
    rx.setblocking(False)
    tx = socket_in_netns(src_ns, socket.AF_INET, socket.SOCK_DGRAM)
    tx.bind((src_addr, 0))
    stop = threading.Event()
    payload = b"x" * size_bytes

    def send():
        target = rx.getsockname()
        while not stop.is_set():
            for _ in range(256):
                try:
                    tx.sendto(payload, target)
                except OSError:
                    pass

    t = threading.Thread(target=send, daemon=True)
    t.start()
    got, start = 0, time.monotonic()
    while time.monotonic() - start < duration_s:
        if select.select([rx], [], [], 0.1)[0]:
            while True:
                try:
                    rx.recv(2048)
                    got += 1
                except BlockingIOError:
                    break
    elapsed = time.monotonic() - start
    stop.set()
    t.join(timeout=5)
    tx.close()
    rx.close()
    return got / elapsed


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def hub_stats(net: netem.Network) -> dict:
    path = state_path(net.name).with_suffix(".hub.json")
    path.unlink(missing_ok=True)
    os.kill(net.state.hub_pid, signal.SIGUSR1)
    deadline = time.monotonic() + 5
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return json.loads(path.read_text())


def bench_hub(name: str, duration_s: float) -> dict:
    r: dict = {}
    with netem.Network(["a", "b"], [[0, 0], [0, 0]], name=name, backend="userspace") as net:
        a, b = (net.netns(h) for h in "ab")
        A, B = net.address("a"), net.address("b")
        cpu0, s0 = cpu_s(net.state.hub_pid), hub_stats(net)["packets"]
        r["hub_tcp_MB_per_s"] = measure_throughput_bit_s(a, A, b, B, duration_s=duration_s) / 8e6
        st = hub_stats(net)
        r["hub_tcp_packets"] = st["packets"] - s0
        r["hub_tcp_mean_packet_bytes"] = st["bytes"] / max(1, st["packets"])
        cpu1 = cpu_s(net.state.hub_pid)
        r["hub_udp64_packets_per_s"] = udp_packets_per_s(a, A, b, B, duration_s=duration_s)
        st2 = hub_stats(net)
        cpu2 = cpu_s(net.state.hub_pid)
        r["hub_cpu_us_per_tcp_packet"] = (cpu1 - cpu0) * 1e6 / max(1, r["hub_tcp_packets"])
        r["hub_cpu_us_per_udp_packet"] = (cpu2 - cpu1) * 1e6 / max(1, st2["packets"] - st["packets"])
        r["hub_scheduling"] = st2["scheduling"]
        # baselines: the same code over loopback inside one namespace (no hub on the path)
        r["loopback_tcp_MB_per_s"] = (
            measure_throughput_bit_s(a, "127.0.0.1", a, "127.0.0.1", duration_s=duration_s) / 8e6
        )
        r["loopback_udp64_packets_per_s"] = udp_packets_per_s(a, "127.0.0.1", a, "127.0.0.1", duration_s=duration_s)
    r["ratio_tcp_hub_vs_loopback"] = r["hub_tcp_MB_per_s"] / r["loopback_tcp_MB_per_s"]
    r["ratio_udp_hub_vs_loopback"] = r["hub_udp64_packets_per_s"] / r["loopback_udp64_packets_per_s"]
    r["prefill_2000_tokens_hidden_MB"] = HIDDEN_BYTES_2000_TOKEN_PREFILL / 1e6
    r["prefill_2000_tokens_transfer_ms_at_hub_rate"] = (
        HIDDEN_BYTES_2000_TOKEN_PREFILL / (r["hub_tcp_MB_per_s"] * 1e6) * 1e3
    )
    return r


def rtt_samples(net: netem.Network, i: int, j: int, n: int) -> list[float]:
    out = []
    for _ in range(n):
        m = measure_rtt_ms([net.netns(i), net.netns(j)], [net.address(i), net.address(j)], probes=1)
        out += [m[0][1], m[1][0]]
    return out


def bench_delay(name: str, targets_ms: list[float], probes: int) -> dict:
    r: dict = {}
    hosts = ["a", "b", "c", "d"]
    with netem.Network(hosts, [[0.0] * 4 for _ in range(4)], name=name, backend="userspace") as net:
        for loaded in (False, True):
            stop = threading.Event()
            bulk = None
            if loaded:  # a -> b bulk TCP through the same hub while c <-> d probe

                def push():
                    while not stop.is_set():
                        measure_throughput_bit_s(
                            net.netns("a"),
                            net.address("a"),
                            net.netns("b"),
                            net.address("b"),
                            duration_s=1.0,
                            warmup_s=0.0,
                        )

                bulk = threading.Thread(target=push, daemon=True)
                bulk.start()
            for t in targets_ms:
                m = [[0.0] * 4 for _ in range(4)]
                m[2][3] = m[3][2] = t
                net.set_rtt_ms(m)
                err = np.array(rtt_samples(net, 2, 3, probes)) - t
                key = f"{'loaded' if loaded else 'idle'}_{t:g}ms"
                r[f"delay_error_ms_median_{key}"] = float(np.median(err))
                r[f"delay_error_ms_p90_{key}"] = float(np.percentile(err, 90))
            st = hub_stats(net)
            r[f"hub_late_ms_p50_{'loaded' if loaded else 'idle'}"] = st["late_ms_p50"]
            r[f"hub_late_ms_p99_{'loaded' if loaded else 'idle'}"] = st["late_ms_p99"]
            stop.set()
            if bulk is not None:
                bulk.join(timeout=10)
    return r


CLIENT = r"""
import json, sys, time
import torch
from petals_chain.client.model import DistributedModelForCausalLM
from petals_chain.swarm.records import fetch_servers
ids = torch.tensor([json.loads(sys.argv[2])])
n = int(sys.argv[3])
repeats = int(sys.argv[4])
relays = (sys.argv[5] if len(sys.argv) > 5 else "server").split(",")
direct = {"direct_streams": sys.argv[6] == "direct"} if len(sys.argv) > 6 else {}
dtype = sys.argv[7] if len(sys.argv) > 7 else "float32"
model_name = sys.argv[8] if len(sys.argv) > 8 else "smollm2-135m"
device = sys.argv[9] if len(sys.argv) > 9 else "cpu"
# one model per relay on the same swarm, their runs interleaved (the order alternating per repeat), so
# that a drift of the machine's speed over the run reaches both relays alike (a paired comparison)
models = {relay: DistributedModelForCausalLM.from_pretrained(model_name, initial_peers=[sys.argv[1]], relay=relay,
                                                             dtype=dtype, device=device, **direct) for relay in relays}
try:
    for model in models.values():
        model.generate(ids, max_new_tokens=2, do_sample=False)  # warm-up: routing, connections
        if getattr(model.backend.hops, "dialer", None) is not None:  # direct-stream offers, asked beside the warm-up
            model.backend.loop.run(model.backend.hops.dialer.asked(), timeout_s=10)
    out = {relay: {"seconds": [], "decode_step_s": [], "tokens": None} for relay in relays}
    for r in range(repeats):
        for relay in (relays if r % 2 == 0 else relays[::-1]):
            model, res = models[relay], out[relay]
            t = time.perf_counter()  # a whole session, as the service time T of the model counts it
            res["tokens"] = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)[0].tolist()
            res["seconds"].append(time.perf_counter() - t)
            with model.inference_session(max_length=ids.shape[1] + n + 2):  # steady-state decode steps only
                first = model.generate(ids, max_new_tokens=1, do_sample=False)
                t = time.perf_counter()
                model.generate(first[:, -1:], max_new_tokens=n, min_new_tokens=n, do_sample=False)
                res["decode_step_s"].append((time.perf_counter() - t) / n)
    for relay, res in out.items():
        res["direct_opened"] = models[relay].backend.hops.dialer.direct_opened
    infos = [i.to_wire() for i in fetch_servers(models[relays[0]].backend.dht, models[relays[0]].backend.model)]
    first = out[relays[0]]  # the first relay's figures at the top level too (bench_chain reads those)
    print(json.dumps({"seconds": min(first["seconds"]), "decode_step_s": min(first["decode_step_s"]),
                      "new_tokens": n, "servers": infos, "tokens": first["tokens"],
                      "direct_opened": first["direct_opened"], "relays": out}), flush=True)
finally:
    for model in models.values():
        model.backend.shutdown()
"""


def bench_chain(name: str, rtts_ms: list[float], new_tokens: int, repeats: int) -> dict:
    from transformers import AutoTokenizer

    from orchestrator.session_times import SessionShape, tau_c_s, tau_p_s
    from petals_chain.models.checkpoint import resolve_model_path
    from petals_chain.swarm.local import LocalSwarm

    path = resolve_model_path("smollm2-135m")
    ids = (
        AutoTokenizer.from_pretrained(path)("Tell me a short story about a lighthouse keeper.", return_tensors="pt")
        .input_ids[0]
        .tolist()
    )
    hosts = ["dht", "s0", "s1", "s2", "client"]
    r: dict = {"chain_prompt_tokens": len(ids), "chain_new_tokens": new_tokens}

    def uniform(ms):
        return [[0.0 if i == j else ms for j in range(5)] for i in range(5)]

    with netem.Network(hosts, uniform(rtts_ms[0]), name=name, backend="userspace") as net:

        def placement(role):
            h = "dht" if role == "dht" else role.replace("server", "s")
            return net.prefix(h), net.address(h)

        with LocalSwarm(
            "smollm2-135m",
            [(0, 10), (10, 20), (20, 30)],
            placement=placement,
            server_args=["--num-threads", "1", "--no-orchestrator"],
        ) as swarm:
            for ms in rtts_ms:
                net.set_rtt_ms(uniform(ms))
                proc = subprocess.run(
                    net.command(
                        "client",
                        [
                            sys.executable,
                            "-c",
                            CLIENT,
                            swarm.initial_peers[0],
                            json.dumps(ids),
                            str(new_tokens),
                            str(repeats),
                        ],
                    ),
                    capture_output=True,
                    text=True,
                    timeout=600,
                    env=swarm.env,
                )
                if proc.returncode != 0:
                    raise RuntimeError(proc.stderr[-3000:])
                res = json.loads(proc.stdout.strip().splitlines()[-1])
                shape = SessionShape(len(ids), new_tokens)
                predicted_s = sum(
                    tau_c_s(ms / 1e3, shape)
                    + (s["end"] - s["start"])
                    * tau_p_s(s["prefill_s_per_token"], s["decode_s_per_token"], shape, per_block_overhead_s=1e-3)
                    for s in res["servers"]
                )
                r[f"chain_tokens_per_s_rtt{ms:g}"] = new_tokens / res["seconds"]
                r[f"chain_service_s_rtt{ms:g}"] = res["seconds"]
                r[f"model_predicted_service_s_rtt{ms:g}"] = predicted_s
                r[f"ratio_measured_vs_predicted_rtt{ms:g}"] = res["seconds"] / predicted_s
                # one decode step: the client relays through 3 hops (3 RTTs) + each block's t_O (+ t_o)
                step_model_s = 3 * ms / 1e3 + sum(
                    (s["end"] - s["start"]) * (s["decode_s_per_token"] + 1e-3) for s in res["servers"]
                )
                r[f"decode_step_ms_rtt{ms:g}"] = res["decode_step_s"] * 1e3
                r[f"model_decode_step_ms_rtt{ms:g}"] = step_model_s * 1e3
                print(
                    f"RTT {ms:5g} ms: {new_tokens / res['seconds']:6.2f} tok/s, session {res['seconds']:.2f} s "
                    f"(model T {predicted_s:.2f} s); decode step {res['decode_step_s'] * 1e3:.1f} ms "
                    f"(model {step_model_s * 1e3:.1f} ms)",
                    flush=True,
                )
    if len(rtts_ms) > 1:  # the tau_c model: each decode step costs 3 RTTs (the client relays to 3 servers)
        r["decode_step_ms_per_ms_rtt_fit"] = float(
            np.polyfit(rtts_ms, [r[f"decode_step_ms_rtt{ms:g}"] for ms in rtts_ms], 1)[0]
        )
        r["decode_step_ms_per_ms_rtt_model"] = 3.0
    return r


def prompt_ids(path):
    """The benchmark's prompt: a fixed sentence through the checkpoint's tokenizer, or, for a checkpoint
    without one (random weights), fixed token ids of the same length."""
    import torch
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)(
            "Tell me a short story about a lighthouse keeper.", return_tensors="pt"
        ).input_ids
    except (OSError, ValueError):  # no tokenizer files in the folder
        return torch.arange(1, 13).unsqueeze(0) * 37


def legs_ms(relay: str, rtt_ms: float, n_servers: int) -> float:
    """The network part of one decode step: client relay N round trips, server relay N + 1 one-way legs."""
    return n_servers * rtt_ms if relay == "client" else (n_servers + 1) * rtt_ms / 2


def model_step_ms(relay: str, rtt_ms: float, servers: list[dict]) -> float:
    """One decode step as the model predicts it: the network legs of the relay plus each block's
    t_O (+ 1 ms per-block overhead, as above). Client relay: the client -> s_j -> client round trip
    per hop, N x RTT. Server relay: client -> s_1 -> ... -> s_N -> client, N + 1 one-way legs of
    RTT / 2 (footnote 4: tau_c,ij from the preceding hop i)."""
    return (
        legs_ms(relay, rtt_ms, len(servers))
        + sum((s["end"] - s["start"]) * (s["decode_s_per_token"] + 1e-3) for s in servers) * 1e3
    )


def bench_relays(
    name: str,
    n_servers: int,
    rtt_ms: float,
    relays: list[str],
    new_tokens: int,
    repeats: int,
    direct: bool = False,
    server_threads: int = 1,
    dtype: str = "float32",
    model: str = "smollm2-135m",
    device: str = "cpu",
) -> dict:
    """One swarm of `n_servers` hosts at a uniform `rtt_ms`; one client run per relay. `direct`: the servers
    take direct streams (--direct-port) and the client and servers use them. `server_threads`: each
    server's torch threads (one session's step runs on one server at a time, so with 2 threads the
    server computing has both cores, as a host of its own would). `dtype`: the servers' and the client
    head's (`--dtype`); the reference is transformers' model in the same dtype. `model`: a name or a
    checkpoint folder (e.g. scripts/make_random_checkpoint.py's, which has no tokenizer: then the
    prompt is fixed token ids); `device`: the servers' and the client head's (cuda on a GPU host,
    where the blocks' compute is a few ms and the relays' ratio nears (N + 1) / 2N)."""
    import torch
    from transformers import AutoModelForCausalLM

    from petals_chain.models.checkpoint import resolve_model_path
    from petals_chain.swarm.local import LocalSwarm

    path = resolve_model_path(model)
    ids = prompt_ids(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    ref = hf.generate(ids.to(device), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)[0].tolist()
    layers = hf.config.num_hidden_layers
    del hf
    if device != "cpu":
        torch.cuda.empty_cache()
    bounds = [round(i * layers / n_servers) for i in range(n_servers + 1)]
    hosts = ["dht", *(f"s{i}" for i in range(n_servers)), "client"]
    uniform = [[0.0 if i == j else rtt_ms for j in range(len(hosts))] for i in range(len(hosts))]
    out: dict = {
        "relay": {},
        "rtt_ms": rtt_ms,
        "servers": n_servers,
        "new_tokens": new_tokens,
        "prompt_tokens": ids.shape[1],
        "transport": "direct" if direct else "p2p",
        "server_threads": server_threads,
        "dtype": dtype,
        "model": str(model),
        "device": device,
        "layers": layers,
        "loadavg_start": os.getloadavg()[0],
    }
    exact = True
    with netem.Network(hosts, uniform, name=name, backend="userspace") as net:

        def placement(role):
            h = "dht" if role == "dht" else role.replace("server", "s")
            return net.prefix(h), net.address(h)

        with LocalSwarm(
            str(model),
            list(zip(bounds, bounds[1:])),
            placement=placement,
            server_args=[
                "--num-threads",
                str(server_threads),
                "--no-orchestrator",
                "--dtype",
                dtype,
                *(["--device", device] if device != "cpu" else []),
                *(["--direct-port", "0"] if direct else []),
            ],
        ) as swarm:
            proc = subprocess.run(
                net.command(
                    "client",
                    [
                        sys.executable,
                        "-c",
                        CLIENT,
                        swarm.initial_peers[0],
                        json.dumps(ids[0].tolist()),
                        str(new_tokens),
                        str(repeats),
                        ",".join(relays),
                        "direct" if direct else "p2p",
                        dtype,
                        str(model),
                        device,
                    ],
                ),
                capture_output=True,
                text=True,
                timeout=600 * len(relays),
                env=swarm.env,
            )
            if proc.returncode != 0:
                raise RuntimeError(proc.stderr[-3000:])
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            for relay in relays:
                runs = res["relays"][relay]
                step_s = min(runs["decode_step_s"])
                exact = exact and runs["tokens"] == ref
                out["relay"][relay] = {
                    "step_ms": step_s * 1e3,
                    "tok_s": new_tokens / min(runs["seconds"]),
                    "step_ms_runs": [x * 1e3 for x in runs["decode_step_s"]],
                    "model_step_ms": model_step_ms(relay, rtt_ms, res["servers"]),
                    # what a step costs besides the emulated RTTs: compute (blocks, the
                    # client's embedding and LM head) and framework
                    "beyond_legs_ms": step_s * 1e3 - legs_ms(relay, rtt_ms, n_servers),
                    "exact": runs["tokens"] == ref,
                    "direct_streams": runs["direct_opened"],
                }
            # the server-to-server RTTs the servers measured and announce (footnote 4's RTT_ij,
            # server/peer_rtts.py), against the emulated rtt_ms
            peer_ms = [v * 1e3 for s in res["servers"] for v in s.get("peer_rtt_s", {}).values()]
            out["server_peer_rtt_ms_median"] = float(np.median(peer_ms)) if peer_ms else None
            out["server_peer_rtt_reports"] = len(peer_ms)
    out["exact"] = exact
    if "client" in out["relay"] and "server" in out["relay"]:
        out["ratio_server_vs_client_step"] = out["relay"]["server"]["step_ms"] / out["relay"]["client"]["step_ms"]
        out["model_ratio_server_vs_client_step"] = (
            out["relay"]["server"]["model_step_ms"] / out["relay"]["client"]["model_step_ms"]
        )
        # the best server relay can do on this machine: the same work beyond the legs as the client relay's
        # step, on (N + 1) / 2N of its legs; (N + 1) / 2N itself only when that work is ~0 (a GPU's few ms)
        c_ms = out["relay"]["client"]["beyond_legs_ms"]
        out["ratio_bound_at_this_work"] = (legs_ms("server", rtt_ms, n_servers) + c_ms) / (
            legs_ms("client", rtt_ms, n_servers) + c_ms
        )
        # the two relays' runs interleaved in one client: each repeat's server-relay step over the
        # client-relay step next to it, their median (less moved by the machine's drift than the
        # ratio of the two bests)
        pairs = [
            s_ms / c_ms
            for s_ms, c_ms in zip(out["relay"]["server"]["step_ms_runs"], out["relay"]["client"]["step_ms_runs"])
        ]
        out["ratio_server_vs_client_step_paired"] = pairs
        out["ratio_server_vs_client_step_paired_median"] = float(np.median(pairs))
    out["loadavg_end"] = os.getloadavg()[0]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=2.0, help="seconds per throughput measurement")
    p.add_argument("--probes", type=int, default=15, help="RTT probes per target (each both directions)")
    p.add_argument("--targets-ms", default="5,20,50,100")
    p.add_argument("--chain-rtts-ms", default="0,20,50,100")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2, help="best of N generations per RTT")
    p.add_argument("--skip-chain", action="store_true")
    p.add_argument("--out", default="results/bench_netem.json")
    p.add_argument("--chain", action="store_true", help="only the chain, once per --relay (see 4. above)")
    p.add_argument("--servers", type=int, default=3, help="--chain: servers in the chain (30 blocks split evenly)")
    p.add_argument("--rtt-ms", type=float, default=50.0, help="--chain: RTT between every pair of hosts")
    p.add_argument("--relay", default="client,server", help="--chain: relays to compare (client, server)")
    p.add_argument("--json", action="store_true", help="--chain: print only the JSON object")
    p.add_argument(
        "--direct",
        action="store_true",
        help="--chain: servers with --direct-port, client and pushes on direct TCP streams",
    )
    p.add_argument(
        "--server-threads",
        type=int,
        default=1,
        metavar="N",
        help="--chain: each server's --num-threads (default 1; the servers compute one at a time)",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=DTYPE_CHOICES,
        help="--chain: the servers' and the client head's dtype (the HF reference runs in it too)",
    )
    p.add_argument(
        "--model",
        default="smollm2-135m",
        help="--chain: a model name or checkpoint folder (scripts/make_random_checkpoint.py writes one)",
    )
    p.add_argument("--device", default="cpu", help="--chain: the servers' and the client head's device (cpu, cuda)")
    args = p.parse_args()
    if args.server_threads < 1:
        p.error(f"--server-threads must be >= 1, got {args.server_threads}")
    name = "b" + uuid.uuid4().hex[:6]
    if args.chain:
        try:
            results = bench_relays(
                name,
                args.servers,
                args.rtt_ms,
                args.relay.split(","),
                args.new_tokens,
                args.repeats,
                direct=args.direct,
                server_threads=args.server_threads,
                dtype=args.dtype,
                model=args.model,
                device=args.device,
            )
        finally:
            netem.cleanup(name)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2))
        print(json.dumps(results) if args.json else json.dumps(results, indent=2))
        return 0
    results: dict = {"loadavg_start": os.getloadavg()[0]}
    try:
        results.update(bench_hub(name, args.duration))
        results.update(bench_delay(name, [float(x) for x in args.targets_ms.split(",")], args.probes))
        if not args.skip_chain:
            results.update(
                bench_chain(name, [float(x) for x in args.chain_rtts_ms.split(",")], args.new_tokens, args.repeats)
            )
    finally:
        netem.cleanup(name)
    results["loadavg_end"] = os.getloadavg()[0]
    for k, v in results.items():
        print(f"{k:50s} {v:10.3f}" if isinstance(v, float) else f"{k:50s} {v}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
