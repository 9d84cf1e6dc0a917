"""A server behind an emulated home NAT joins through a libp2p relay (the bootstrap DHT peer) and serves.

Emulated hosts: the DHT peer (also the relay), the orchestrator, a public server, a server behind a NAT
router (netem `behind_nat`), a client. The NATed server's dial-back check finds it unreachable, it
joins through the relay and announces `relayed` with circuit addresses and its RTT to the relay; the
orchestrator counts the relayed path (its RTT to the relay plus the server's: the NATed server's own
DHT traffic opens direct connections to the orchestrator, which a probe of the server would ride),
marks it on the status page and plans it; a
client's session runs through it (the relayed path is the fast one here) and its output equals HF.
Killing the relay mid-session cuts the NATed server off: the session fails over to the public server
and the text is still HF's. Needs root, /dev/net/tun and nft or iptables (`make nat-tools`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from petals_chain.swarm.local import REPO_ROOT, LocalSwarm
from petals_chain.swarm.reachability import relay_peer_id
from tests.swarm_helpers import emulated_network, get_in_netns, wait_for

pytestmark = pytest.mark.integration

HOSTS = ["dht", "orch", "pub", "home", "client"]
RELAY_LEG_MS = 15.0  # orchestrator/client <-> relay and relay <-> home
DIRECT_HOME_MS = 4.0  # what the orchestrator would see over a connection the NATed server opened itself
PUBLIC_SERVER_MS = 150.0  # the public server is far (and slowed, below): the relayed chain is the fast one
PUBLIC_SLOWDOWN = "4"  # --emulate-slowdown: t_I/t_O measured on this loaded machine are noisy; make the gap clear


def topology() -> list[list[float]]:
    n = len(HOSTS)
    rtt = [[0.0 if i == j else 5.0 for j in range(n)] for i in range(n)]

    def put(a, b, ms):
        i, j = HOSTS.index(a), HOSTS.index(b)
        rtt[i][j] = rtt[j][i] = ms

    for a in ("orch", "client", "home"):
        put(a, "dht", RELAY_LEG_MS)
    for a in ("orch", "client"):
        put(a, "pub", PUBLIC_SERVER_MS)
        put(a, "home", DIRECT_HOME_MS)
    return rtt


CLIENT = """
import json, sys
import torch
from transformers.generation.streamers import BaseStreamer
from petals_chain.client.model import DistributedModelForCausalLM

class PauseAfter(BaseStreamer):
    # after n tokens: report the chain, wait until the test killed the relay
    def __init__(self, session, n):
        self.session, self.n, self.seen = session, n, -1
    def put(self, value):
        self.seen += 1  # the first put is the prompt
        if self.seen == self.n:
            hops = [h.peer_id for h in self.session.chain.hops]
            # the client's connections to each hop (p2pd's remote addresses): how the session reaches it
            peers = model.backend.loop.run(model.backend.p2p.list_peers(), timeout_s=10)
            conns = {str(p.peer_id): [str(a) for a in p.addrs] for p in peers if str(p.peer_id) in hops}
            print(json.dumps({"chain": hops, "conns": conns}), flush=True)
            sys.stdin.readline()
    def end(self):
        pass

peer, path, ids = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
n_pause, n_total = int(sys.argv[4]), int(sys.argv[5])
model = DistributedModelForCausalLM.from_pretrained(path, initial_peers=[peer])
try:
    with model.inference_session(max_length=64) as s:
        out = model.generate(torch.tensor([ids]), max_new_tokens=n_total, do_sample=False, streamer=PauseAfter(s,
        n_pause))
        peers = model.backend.loop.run(model.backend.p2p.list_peers(), timeout_s=10)
        print(json.dumps({"tokens": out[0].tolist(), "chain": [h.peer_id for h in s.chain.hops],
                          "failovers": s.chain.failovers,
                          "conns": {str(p.peer_id): [str(a) for a in p.addrs] for p in peers}}), flush=True)
finally:
    model.backend.shutdown()
"""


@pytest.fixture(scope="module")
def home_net():
    with emulated_network(HOSTS, topology(), "r", behind_nat=["home"]) as net:
        yield net


@pytest.fixture(scope="module")
def swarm(home_net, tiny_llama_path):
    host_of = {"dht": "dht", "orchestrator": "orch", "server0": "pub", "server1": "home"}

    def placement(role: str):
        return home_net.prefix(host_of[role]), home_net.address(host_of[role])

    # fixed ranges, both whole: the plan cannot leave the public server without blocks, so the session has
    # somewhere to fail over to when the relay dies
    with LocalSwarm(
        str(tiny_llama_path),
        [(0, 6), (0, 6)],
        names=["pub", "home"],
        placement=placement,
        per_server_args=[["--emulate-slowdown", PUBLIC_SLOWDOWN], []],
        server_args=["--num-threads", "1", "--max-length", "64", "--memory-budget", "64MiB"],
        orchestrator_args=["--expected-servers", "2", "--replan-period", "3"],
    ) as swarm:
        yield swarm


def _status(net, swarm) -> dict:
    return json.loads(get_in_netns(net.netns("client"), swarm.orchestrator_url + "status"))


def test_nat_server_is_found_planned_and_serves_exactly_and_fails_over_when_the_relay_dies(
    home_net, swarm, tiny_llama_path
):
    from transformers import LlamaForCausalLM

    pub, home = swarm.servers
    assert any(line.startswith("reachability: relayed") for line in home.lines), home.lines[-20:]
    assert any(line.startswith("reachability: direct") for line in pub.lines), pub.lines[-20:]

    # planned, marked, and measured along the relayed path: its RTT includes the relay's extra hop
    seen: list[dict] = []

    def relayed_and_planned():
        seen.append(_status(home_net, swarm))
        st = seen[-1]
        by_name = {s["name"]: s for s in st["servers"]}
        h = by_name.get("home")
        ok = (
            st.get("plan_installed")
            and h is not None
            and h["reachability"] == "relayed"
            and h["rtt"]
            # relayed: 2 x 15 ms; a direct probe (4 ms + RPC overhead) stays well below one leg
            and h["rtt"] * 1e3 >= RELAY_LEG_MS
            and by_name.get("pub", {}).get("reachability") == "direct"
            and any(home.peer_id in c["servers"] for c in st["chains"])
        )
        return st if ok else None

    try:
        status = wait_for(
            relayed_and_planned, 90, "the NATed server relayed, measured along the relayed path and planned"
        )
    except AssertionError as e:
        raise AssertionError(f"{e}; last status servers: {seen[-1]['servers'] if seen else None}") from None
    page = get_in_netns(home_net.netns("client"), swarm.orchestrator_url).decode()
    assert 'class="relayed"' in page

    torch_ids = [5, 17, 42, 9, 77, 3]
    hf = LlamaForCausalLM.from_pretrained(tiny_llama_path).eval()
    import torch

    ref = hf.generate(torch.tensor([torch_ids]), max_new_tokens=12, do_sample=False)[0].tolist()

    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"}
    client = subprocess.Popen(
        home_net.command(
            "client",
            [
                sys.executable,
                "-c",
                CLIENT,
                swarm.initial_peers[0],
                str(tiny_llama_path),
                json.dumps(torch_ids),
                "5",
                "12",
            ],
        ),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        first = json.loads(client.stdout.readline() or "{}")
        assert home.peer_id in first.get("chain", []), (
            first,
            status["chains"],
            status["servers"],
            client.stderr.read()[-3000:] if client.poll() else "",
        )
        # The session reaches the NATed server through the relay (a p2p-circuit via the DHT peer), which dies
        # mid-session. A connection the NATed server opened to the client itself (libp2p then prefers it),
        # or a circuit through another relay, would outlive the relay (seen once in CI: no failover): the
        # test then also unplugs the NATed server's link behind its router, so the session still has to
        # fail over, and says so.
        relay_id = relay_peer_id(swarm.initial_peers[0])
        other_paths = [
            a
            for a in first.get("conns", {}).get(home.peer_id, [])
            if not (a.rstrip("/").endswith("p2p-circuit") and relay_peer_id(a) == relay_id)
        ]
        swarm.kill_dht()  # the relay dies mid-session, its p2pd at once (seen in CI: one that lingered relayed on)
        if other_paths:
            print(f"the client also reached the NATed server by {other_paths}: unplugging it as well")  # noqa: T201 - in the test log
            i = home_net.state.index("home")
            subprocess.run(
                ["ip", "-n", home_net.netns("home"), "link", "set", f"{home_net.name}-y{i}", "down"], check=True
            )
        client.stdin.write("go\n")
        client.stdin.flush()
        try:
            out, err = client.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            client.kill()
            out, err = client.communicate()
            raise AssertionError("the client did not finish after the relay died: " + err[-4000:]) from None
    finally:
        if client.poll() is None:
            client.kill()
    assert client.returncode == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["tokens"] == ref  # through the NATed server, then the public one: HF's text
    assert result["failovers"] >= 1 and home.peer_id not in result["chain"] and pub.peer_id in result["chain"], (
        "the session did not fail over from the NATed server",
        first,
        result["chain"],
        result["failovers"],
        result["conns"],
        err[-2000:],
    )
