"""`petals-chain demo`'s start-up progress (cli/demo.py:StartupProgress) on scripted process output:
what it prints for each phase, and the line that names who is still busy when nothing happens."""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass, field

from petals_chain.cli.demo import LOADING, STARTING, StartupProgress, _get_or_none


@dataclass
class FakeServer:
    name: str
    lines: list[str] = field(default_factory=list)


@dataclass
class FakeSwarm:
    servers: list[FakeServer]
    orchestrator_lines: list[str] = field(default_factory=list)


class Clock:
    def __init__(self):
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def make(n: int = 2):
    swarm = FakeSwarm([FakeServer(f"server{i}") for i in range(n)])
    clock, printed = Clock(), []
    progress = StartupProgress(swarm, 90.0, clock=clock, quiet_s=15.0, out=lambda text, flush: printed.append(text))
    return swarm, clock, printed, progress


def test_each_phase_is_reported_once_as_it_happens():
    swarm, clock, printed, progress = make()
    progress.poll()
    assert printed == []  # nothing happened, and not yet quiet for 15 s
    swarm.orchestrator_lines += ["some hivemind warning", "server server0 registered: budget 300 MiB, rtt 1.00 ms"]
    swarm.servers[1].lines.append("start-up profile from the cache /c/throughput.json (measured at an earlier ...")
    clock.now_s += 2
    progress.poll()
    assert printed == [
        "  [   12 s] orchestrator: server0 registered: budget 300 MiB, rtt 1.00 ms",
        "  [   12 s] server1: start-up profile read from the cache (measured at an earlier start)",
    ]
    assert progress.phase == {"server0": "registered, waiting for the plan", "server1": STARTING}
    swarm.orchestrator_lines.append("plan v1 (proposed, c=3): server0=[0,21), server1=unused")
    progress.poll()
    assert progress.phase == {"server0": LOADING, "server1": "left out by the plan"}
    swarm.servers[0].lines.append("serving smollm2-135m blocks [0, 21) as QmABC (plan v1)")
    swarm.servers[1].lines.append("standing by: smollm2-135m as QmDEF: plan v1 leaves this server without blocks; ...")
    assert not progress.servers_ready()
    progress.poll()
    assert printed[-2:] == [
        "  [   12 s] server0: serving smollm2-135m blocks [0, 21)",
        "  [   12 s] server1: standing by (the plan gives it no blocks)",
    ]
    assert progress.servers_ready()
    progress.poll()
    assert len(printed) == 5  # no line is reported twice


def test_a_quiet_spell_names_who_is_still_busy_with_what():
    swarm, clock, printed, progress = make(4)
    swarm.orchestrator_lines.append("server server2 registered: budget 380 MiB, rtt 2.00 ms")
    progress.poll()
    clock.now_s += 14.9
    progress.poll()
    assert len(printed) == 1
    clock.now_s += 0.1
    progress.poll()
    assert printed[-1] == (
        f"  [   25 s] still server0, server1, server3: {STARTING}; server2: registered, waiting for the plan"
    )
    progress.poll()
    assert len(printed) == 2  # the next such line only after another quiet spell
    swarm.orchestrator_lines.append(
        "plan v1 (proposed, c=3): server0=[11,30), server1=[0,21), server2=[0,24), server3=unused"
    )
    swarm.servers[0].lines.append("serving smollm2-135m blocks [11, 30) as QmABC (plan v1)")
    progress.poll()
    clock.now_s += 15
    progress.poll()
    assert printed[-1] == f"  [   40 s] still server1 [0,21), server2 [0,24): {LOADING}; server3: left out by the plan"


def test_a_status_page_that_does_not_answer_in_time_is_asked_again_not_a_traceback():
    """On a busy machine the orchestrator's HTTP thread may not answer within the timeout: the start
    loop gets None (and asks again at its next poll) instead of a TimeoutError escaping to the user."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        accepted = []
        t = threading.Thread(target=lambda: accepted.append(listener.accept()[0]), daemon=True)
        t.start()  # accepts the connection and never answers
        assert _get_or_none(f"http://127.0.0.1:{port}/status", timeout_s=0.3) is None
        t.join(5)
        for conn in accepted:
            conn.close()
    with socket.socket() as closed:  # nothing listens there any more: refused
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    assert _get_or_none(f"http://127.0.0.1:{port}/status", timeout_s=0.3) is None
