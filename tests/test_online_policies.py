"""Run-time policy choice and churn with real processes: the orchestrator runs the PETALS baseline
(its placement + per-request min-latency routing), and a server that joins later gets blocks at
the next re-plan."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from petals_chain.client.remote import RemoteChain
from petals_chain.client.routing import DhtChainProvider
from petals_chain.models.checkpoint import load_config
from petals_chain.swarm.local import REPO_ROOT, LocalSwarm
from tests.swarm_helpers import get_json, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.model]


def test_petals_policy_places_routes_and_replans_for_a_late_server(smollm2_path, tmp_path):
    server_args = ["--num-threads", "1", "--max-length", "512", "--memory-budget", "250MiB"]
    orch = ["--policy", "petals", "--expected-servers", "2", "--replan-period", "4", "--lease-ttl", "5"]
    with LocalSwarm("smollm2-135m", [None, None], server_args=server_args, orchestrator_args=orch) as swarm:
        url = swarm.orchestrator_url
        status = wait_for(lambda: (s := get_json(url + "status"))["plan_installed"] and s, 60, "plan v1 online")
        assert status["policy"] == "petals" and status["plan_version"] == 1
        pi = get_json(url + "plan-input")
        f = tmp_path / "cluster.json"
        f.write_text(json.dumps(pi["cluster"]))
        out = subprocess.run(
            [sys.executable, "-m", "petals_chain.cli", "plan", "--cluster", str(f), "--policy", "petals"],
            capture_output=True,
            text=True,
            cwd=REPO_ROOT,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        offline = {p: (r["start"], r["end"]) for p, r in json.loads(out.stdout)["placement"].items()}
        assert offline == {sp.peer_id: (sp.start, sp.end) for sp in swarm.servers}
        c = pi["cluster"]
        m_petals = int(c["servers"][0]["memory"] // (c["block_size"] + 2 * c["cache_size"]))
        assert m_petals == 16
        assert all(e - s == m_petals for s, e in offline.values())  # PETALS' m_j = floor(M / (s_m + 2 s_c))

        chain = RemoteChain("smollm2-135m", load_config(smollm2_path), swarm.initial_peers)
        try:
            hidden = load_config(smollm2_path).hidden_size
            sessions = [chain.open_session(max_length=64) for _ in range(2)]
            for s in sessions:
                s.step(torch.randn(3, hidden))
            st = get_json(url + "status")
            routes = [k for k in st["chains"] if k["in_use"]]
            assert sum(k["in_use"] for k in routes) == 2 and st["sessions"] == 2
            # a per-request route: the router's own min-latency path over the PETALS placement
            for s in sessions:
                assert [h.start for h in s.hops][0] == 0 and s.hops[-1].end == 30
                s.close()
            assert wait_for(lambda: get_json(url + "status")["sessions"] == 0, 10, "releases")

            late = swarm.add_server(None, None, name="late", wait=False)
            st = wait_for(
                lambda: (s := get_json(url + "status"))["plan_version"] >= 2 and s["plan_installed"] and s,
                90,
                "a re-plan that gives the late server blocks",
            )
            swarm.wait_ready([late])
            rec = next(s for s in st["servers"] if s["name"] == "late")
            assert rec["end"] - rec["start"] == m_petals and rec["state"] == "online"
            s = chain.open_session(max_length=64)  # sessions still run after the re-plan
            s.step(torch.randn(2, hidden))
            s.close()
        finally:
            chain.shutdown()
        # a client can opt out of the orchestrator and route itself from the DHT records
        direct = RemoteChain("smollm2-135m", load_config(smollm2_path), swarm.initial_peers, use_orchestrator=False)
        try:
            assert isinstance(direct.provider, DhtChainProvider)
            s = direct.open_session(max_length=64)
            s.step(torch.randn(2, hidden))
            s.close()
        finally:
            direct.shutdown()
