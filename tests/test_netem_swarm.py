"""A real swarm across emulated WAN hosts: DHT, orchestrator and three servers each in its own network
namespace listening on that host's address, a client in a sixth; generation equals local HF, the
orchestrator's measured RTTs match the emulated ones, and its tau_c grows with them as the model says."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import netem
from petals_chain.swarm.local import REPO_ROOT, LocalSwarm
from tests.swarm_helpers import emulated_network, get_in_netns, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.model]

HOSTS = ["dht", "orch", "s0", "s1", "s2", "client"]
ORCH_TO_SERVER_MS = {"s0": 10.0, "s1": 40.0, "s2": 80.0}
CLIENT_TO_SERVER_MS = {"s0": 10.0, "s1": 15.0, "s2": 20.0}
# hivemind's rpc_info round trip adds its own processing (p2p daemon hops, msgpack, asyncio) on top of
# the wire's RTT; on this shared 2-core machine that was 1-6 ms. The emulated part must be honoured
# within the 10 % + 2 ms, so the bound is that plus this allowance for the RPC itself.
RPC_OVERHEAD_ALLOWANCE_MS = 15.0


def topology() -> list[list[float]]:
    n = len(HOSTS)
    rtt = [[0.0 if i == j else 5.0 for j in range(n)] for i in range(n)]
    for table, a in ((ORCH_TO_SERVER_MS, "orch"), (CLIENT_TO_SERVER_MS, "client")):
        for s, ms in table.items():
            i, j = HOSTS.index(a), HOSTS.index(s)
            rtt[i][j] = rtt[j][i] = ms
    return rtt


def get_json_in(net: netem.Network, host: str, url: str) -> dict:
    """GET a JSON page from inside `host` (the orchestrator listens on an emulated address)."""
    return json.loads(get_in_netns(net.netns(host), url))


CLIENT = """
import json, sys
from petals_chain.client.model import DistributedModelForCausalLM
import torch
ids = torch.tensor([json.loads(sys.argv[2])])
model = DistributedModelForCausalLM.from_pretrained("smollm2-135m", initial_peers=[sys.argv[1]])
try:
    with model.inference_session(max_length=64) as s:
        out = model.generate(ids, max_new_tokens=int(sys.argv[3]), do_sample=False)
        chain = s.chain.describe()
    print(json.dumps({"tokens": out[0].tolist(), "chain": chain}), flush=True)
finally:
    model.backend.shutdown()
"""


@pytest.fixture(scope="module")
def wan():
    with emulated_network(HOSTS, topology(), "s") as net:
        yield net


@pytest.fixture(scope="module")
def swarm(wan, smollm2_path):
    def placement(role: str):
        host = {"dht": "dht", "orchestrator": "orch"}.get(role, role.replace("server", "s"))
        return wan.prefix(host), wan.address(host)

    with LocalSwarm(
        "smollm2-135m",
        [None, None, None],
        server_args=["--num-threads", "1", "--max-length", "512"],
        orchestrator_args=["--expected-servers", "3", "--replan-period", "5", "--relay", "client"],
        placement=placement,
    ) as swarm:
        wait_for(
            lambda: get_json_in(wan, "client", swarm.orchestrator_url + "status").get("plan_installed"),
            120,
            "the orchestrator's plan",
        )
        yield swarm


def test_every_process_listens_on_its_emulated_host(wan, swarm):
    assert swarm.initial_peers[0].startswith(f"/ip4/{wan.address('dht')}/tcp/")
    assert swarm.orchestrator_url.startswith(f"http://{wan.address('orch')}:")


def _rtts_match(status: dict) -> bool:
    by_name = {s["name"]: s for s in status["servers"]}
    if len(by_name) != 3 or not all(s.get("rtt") for s in by_name.values()):
        return False
    return all(
        target_ms - 2.0
        <= by_name[name.replace("s", "server")]["rtt"] * 1e3
        <= target_ms * 1.1 + 2.0 + RPC_OVERHEAD_ALLOWANCE_MS
        for name, target_ms in ORCH_TO_SERVER_MS.items()
    )


def test_orchestrator_rtts_match_the_emulated_ones_and_tau_c_grows_with_them(wan, swarm):
    # The orchestrator takes each RTT as the shortest of its probes and takes it again every RTT_REFRESH_S
    # (and before every re-plan): a sample taken while this shared machine was overloaded is replaced
    # within a minute, so poll for a matching status page.
    seen: list[dict] = []

    def matching():
        seen.append(get_json_in(wan, "client", swarm.orchestrator_url + "status"))
        return seen[-1] if _rtts_match(seen[-1]) else None

    try:
        status = wait_for(matching, 90, "orchestrator RTTs within 10 % + 2 ms (+ RPC allowance) of the emulated ones")
    except AssertionError as e:
        raise AssertionError(f"{e}; last status servers: {seen[-1]['servers'] if seen else None}") from None
    by_name = {s["name"]: s for s in status["servers"]}
    ordered = [by_name[f"server{i}"] for i in range(3)]  # emulated RTT 10 < 40 < 80 ms
    assert ordered[0]["tau_c"] < ordered[1]["tau_c"] < ordered[2]["tau_c"]
    steps = [s["tau_c"] / s["rtt"] for s in ordered]  # tau_c = steps x RTT (no per-step overhead configured)
    assert max(steps) == pytest.approx(min(steps), rel=1e-9)


def test_generation_through_the_emulated_wan_equals_local_hf(wan, swarm, smollm2_hf, smollm2_tokenizer):
    ids = smollm2_tokenizer("The three primary colors are", return_tensors="pt").input_ids
    ref = smollm2_hf.generate(ids, max_new_tokens=8, do_sample=False)[0].tolist()
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        wan.command("client", [sys.executable, "-c", CLIENT, swarm.initial_peers[0], json.dumps(ids[0].tolist()), "8"]),
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["tokens"] == ref, result
