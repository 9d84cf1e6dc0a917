"""A long prompt's hidden states across an emulated WAN link: what a prefill hop costs beyond the server's
own time, through the p2p daemons and through a direct stream, next to plain TCP in the same run.

One SmolLM2 server (all 30 blocks, `--direct-port 0`) and a client on two emulated hosts at `--rtt-ms`
(userspace netem). Per transport (p2p, direct; alternating, `--repeats` sessions each): one session whose
first step is a `--tokens`-token prompt (float32: tokens x 576 x 4 bytes each way); the hop's time is the
client's from sending the step to having the reply (`hop_timings`), the server's own time (queue +
compute) is taken out, so what is left is the transfer both ways plus the framework. The baseline: the
same bytes there and back over a fresh plain TCP connection between the same hosts (blocking sockets, no
framework). Needs root (namespaces). Prints one JSON object and writes results/bench_transfer.json:
{"rtt_ms", "tokens", "bytes_each_way", "mtu_bytes", "tcp_s": [...], "tcp_s_median",
 "p2p": {"beyond_server_s": [...], "median", "mb_s", "ratio_vs_tcp"}, "direct": {...}}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import netem  # noqa: E402
from netem.hub import TUN_MTU_BYTES  # noqa: E402

CLIENT = r"""
import json, sys, torch
torch.set_num_threads(1)
from petals_chain.client.model import DistributedModelForCausalLM
peers, n, repeats = [sys.argv[1]], int(sys.argv[2]), int(sys.argv[3])
models = {mode: DistributedModelForCausalLM.from_pretrained("smollm2-135m", initial_peers=peers, relay="client",
                                                            direct_streams=(mode == "direct"))
          for mode in ("p2p", "direct")}
out = {mode: [] for mode in models}
try:
    for mode, m in models.items():
        m.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False)  # routing, connections
        if mode == "direct":
            m.backend.loop.run(m.backend.hops.dialer.asked(), timeout_s=10)
    ids = torch.randint(2, 40000, (1, n), generator=torch.Generator().manual_seed(0))
    for r in range(repeats):
        for mode in (("p2p", "direct") if r % 2 == 0 else ("direct", "p2p")):
            m = models[mode]
            with m.inference_session(max_length=n + 4) as s:
                m(ids)  # the prompt's step (the client's LM head over all positions is outside the hop's time)
                hop = [h for h in s.chain.hop_timings if h.tokens == n][-1]
            out[mode].append(hop.client_s - hop.server_s)
    out["direct_opened"] = models["direct"].backend.hops.dialer.direct_opened
finally:
    for m in models.values():
        m.backend.shutdown()
print(json.dumps(out))
"""

TCP = r"""
import socket, sys, time
role, host, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
def recv_exactly(c, k):
    got = 0
    while got < k:
        b = c.recv(1 << 20)
        if not b:
            raise ConnectionError("closed")
        got += len(b)
if role == "server":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((host, 0)); s.listen(4)
    print(s.getsockname()[1], flush=True)
    while True:
        c, _ = s.accept(); recv_exactly(c, n); c.sendall(b"y" * n); c.close()
else:
    port, out = int(sys.argv[4]), []
    for _ in range(int(sys.argv[5])):
        time.sleep(0.3)
        t = time.perf_counter()
        c = socket.create_connection((host, port)); c.sendall(b"x" * n); recv_exactly(c, n); c.close()
        out.append(time.perf_counter() - t)
    print(" ".join(f"{x:.4f}" for x in out), flush=True)
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rtt-ms", type=float, default=50.0)
    p.add_argument("--tokens", type=int, default=2000, help="prompt tokens (at most the servers' --max-length 4096)")
    p.add_argument("--repeats", type=int, default=3, help="sessions per transport")
    p.add_argument("--out", default="results/bench_transfer.json")
    args = p.parse_args()
    if not 1 <= args.tokens <= 4090 or args.repeats < 1:
        p.error("need 1 <= --tokens <= 4090 and --repeats >= 1")
    from petals_chain.swarm.local import LocalSwarm

    n_bytes = args.tokens * 576 * 4
    name = "bt" + uuid.uuid4().hex[:5]
    rtt = [[0 if i == j else args.rtt_ms for j in range(3)] for i in range(3)]
    result: dict = {
        "rtt_ms": args.rtt_ms,
        "tokens": args.tokens,
        "bytes_each_way": n_bytes,
        "mtu_bytes": TUN_MTU_BYTES,
        "loadavg_start": os.getloadavg()[0],
    }
    try:
        with netem.Network(["dht", "s0", "client"], rtt, name=name, backend="userspace") as net:
            server = net.popen(
                "s0",
                [sys.executable, "-c", TCP, "server", net.address("s0"), str(n_bytes)],
                stdout=subprocess.PIPE,
                text=True,
            )
            try:
                port = server.stdout.readline().strip()
                tcp = subprocess.run(
                    net.command(
                        "client",
                        [sys.executable, "-c", TCP, "client", net.address("s0"), str(n_bytes), port, str(args.repeats)],
                    ),
                    capture_output=True,
                    text=True,
                    timeout=300,
                    check=True,
                )
            finally:
                server.kill()
                server.wait()
            result["tcp_s"] = [float(x) for x in tcp.stdout.split()]
            result["tcp_s_median"] = float(np.median(result["tcp_s"]))

            def placement(role):
                h = "dht" if role == "dht" else role.replace("server", "s")
                return net.prefix(h), net.address(h)

            with LocalSwarm(
                "smollm2-135m",
                [(0, 30)],
                placement=placement,
                server_args=["--num-threads", "1", "--no-orchestrator", "--direct-port", "0", "--max-length", "4096"],
            ) as swarm:
                run = subprocess.run(
                    net.command(
                        "client",
                        [sys.executable, "-c", CLIENT, swarm.initial_peers[0], str(args.tokens), str(args.repeats)],
                    ),
                    capture_output=True,
                    text=True,
                    timeout=1800,
                    env=swarm.env,
                )
                if run.returncode != 0:
                    raise RuntimeError(run.stderr[-3000:])
                res = json.loads(run.stdout.strip().splitlines()[-1])
    finally:
        netem.cleanup(name)
    result["direct_streams_opened"] = res["direct_opened"]
    for mode in ("p2p", "direct"):
        xs = res[mode]
        med = float(np.median(xs))
        result[mode] = {
            "beyond_server_s": xs,
            "median": med,
            "mb_s": 2 * n_bytes / 1e6 / med,
            "ratio_vs_tcp": med / result["tcp_s_median"],
        }
    result["loadavg_end"] = os.getloadavg()[0]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
