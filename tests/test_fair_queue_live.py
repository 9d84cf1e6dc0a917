"""`petals-chain orchestrator --queue fair` on a live swarm: a freed chain slot goes to a light
client's session, not to the flooding client's sessions that queued before it."""

from __future__ import annotations

import threading

import pytest

from petals_chain.client.remote import RemoteChain
from petals_chain.models.checkpoint import load_config
from petals_chain.swarm.local import LocalSwarm
from tests.swarm_helpers import get_json, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.model]


def test_fair_central_queue_serves_light_client_before_queued_flooder(smollm2_path):
    args = ["--expected-servers", "1", "--lease-ttl", "10", "--queue", "fair"]
    with LocalSwarm(
        "smollm2-135m",
        [None],
        server_args=["--num-threads", "1", "--max-length", "512", "--memory-budget", "560MiB"],
        orchestrator_args=args,
    ) as swarm:
        status = wait_for(
            lambda: (s := get_json(swarm.orchestrator_url + "status"))["plan_installed"] and s,
            90,
            "the plan to be online",
        )
        assert status["queue_order"] == "fair"
        capacity = sum(c["capacity"] for c in status["chains"] if c["dispatchable"])
        assert 1 <= capacity <= 8
        config = load_config(smollm2_path)
        flooder = RemoteChain("smollm2-135m", config, swarm.initial_peers, acquire_timeout_s=120)
        light = RemoteChain("smollm2-135m", config, swarm.initial_peers, acquire_timeout_s=120)
        held, queued, opened = [], [], {}
        try:
            held = [flooder.open_session(max_length=64) for _ in range(capacity)]  # every slot taken

            def open_in_thread(chain, name):
                session = chain.open_session(max_length=64)
                opened[name] = session

            for i in range(3):  # the flooder keeps asking: these queue at the orchestrator
                t = threading.Thread(target=open_in_thread, args=(flooder, f"flood{i}"), daemon=True)
                t.start()
                queued.append(t)
                wait_for(
                    lambda: get_json(swarm.orchestrator_url + "status")["queue_length"] == i + 1,
                    30,
                    f"flooder session {i} to queue",
                )
            t_light = threading.Thread(target=open_in_thread, args=(light, "light"), daemon=True)
            t_light.start()
            wait_for(
                lambda: get_json(swarm.orchestrator_url + "status")["queue_length"] == 4,
                30,
                "the light session to queue",
            )
            held.pop(0).close()  # one slot frees
            wait_for(lambda: "light" in opened, 60, "the light client's session to be granted")
            assert not any(k.startswith("flood") for k in opened)  # FIFO would have granted flood0 first
            assert get_json(swarm.orchestrator_url + "status")["queue_length"] == 3
        finally:
            for s in held + list(opened.values()):
                s.close()
            for t in queued + [locals().get("t_light")]:
                if t is not None:
                    t.join(60)  # the queued flooder sessions get slots as others close
            for s in opened.values():
                s.close()
            flooder.shutdown()
            light.shutdown()
