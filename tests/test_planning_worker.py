"""Plans off the request path in a worker process (orchestrator/service/planning.py): the worker's outcome
equals the control thread's for the same inputs, its errors come back as themselves, a worker killed
mid-step is replaced and the step runs in the calling thread, and small swarms never start one."""

from __future__ import annotations

import multiprocessing
import os
import threading
from pathlib import Path

import pytest

from orchestrator.service.planning import PlannerWorker, WorkerDied, decide_plan


def _calibrated_inputs():
    from tests.test_calibration import _auto_orchestrator, _slower_live_service

    now = [0.0]
    orch = _auto_orchestrator(now)
    orch.sessions.acquire("s1", "c1", 64, 0.0, timeout_s=600)  # a busy server: the decision keeps it in mind
    _slower_live_service(orch)
    orch.refit()
    return orch


def _inputs(orch):
    from orchestrator.service.planning import PlanInputs, PlannerSettings

    snap = orch._snapshot()
    return PlanInputs(
        PlannerSettings.of(orch.config),
        orch.overheads,
        snap.records,
        snap.sessions_per_peer,
        snap.shape,
        current_c=orch.current.plan.c,
        has_current=True,
        can_drain=snap.can_drain,
    )


def pid_of_runner(_inputs) -> int:
    return os.getpid()


def refuse(_inputs):
    raise ValueError("the step's own error")


def hang_in_a_worker(started: Path) -> str:
    """Stands for a step the worker never finishes (it is killed): it says it started (the file), then
    blocks until the test kills the process; in the calling thread it returns at once."""
    if multiprocessing.parent_process() is not None:
        started.write_text(str(os.getpid()))
        threading.Event().wait()  # nothing sets it: only the kill ends the worker
    return "ran in the calling thread"


def _until_started(started: Path) -> None:
    # imported here, not at the top: the spawned worker imports this module for hang_in_a_worker
    from tests.swarm_helpers import wait_for

    wait_for(started.exists, 60, "the worker to start the step", period_s=0.01)


def test_the_workers_outcome_equals_the_control_threads():
    orch = _calibrated_inputs()
    inputs = _inputs(orch)
    here = decide_plan(inputs)
    worker = PlannerWorker(min_servers=1)
    try:
        there = worker.run(decide_plan, inputs, len(inputs.records))
        assert worker.last_where == "process"
        assert worker.run(pid_of_runner, None, 3) != os.getpid()  # it really ran elsewhere
    finally:
        worker.close()
    assert here.error is None and here.decision is not None
    assert there.cluster == here.cluster and there.peers == here.peers and there.pinned == here.pinned
    assert there.decision == here.decision and there.fresh == here.fresh
    # the same outcome installs the same plan
    orch._apply(there, orch._snapshot(), 100.0, drain=True)
    assert orch.last_decision == here.decision.reason


def test_small_swarms_plan_in_the_calling_thread_and_errors_come_back_as_themselves():
    worker = PlannerWorker(min_servers=10)
    try:
        assert worker.run(pid_of_runner, None, 9) == os.getpid() and worker.last_where == "thread"
        assert worker._proc is None  # no process was started for it
        with pytest.raises(ValueError, match="the step's own error"):
            worker.run(refuse, None, 10)
        assert worker.last_where == "process"
    finally:
        worker.close()
    never = PlannerWorker(min_servers=0)
    assert not never.uses_process(10**6)
    with pytest.raises(ValueError):
        PlannerWorker(min_servers=-1)


def test_a_worker_killed_mid_step_is_replaced_and_the_step_runs_in_the_calling_thread(tmp_path):
    worker = PlannerWorker(min_servers=1)
    started = tmp_path / "started"
    try:
        first = worker.run(pid_of_runner, None, 1)
        done: list[str] = []
        t = threading.Thread(target=lambda: done.append(worker.run(hang_in_a_worker, started, 1)))
        t.start()
        _until_started(started)
        os.kill(first, 9)  # the worker dies holding the step
        t.join(60)
        assert done == ["ran in the calling thread"] and worker.last_where == "thread"
        second = worker.run(pid_of_runner, None, 1)
        assert second not in (first, os.getpid())  # a new worker
    finally:
        worker.close()
    assert worker.run(pid_of_runner, None, 1) == os.getpid()  # closed: in the calling thread from then on


def test_close_abandons_the_step_a_worker_runs(tmp_path):
    worker = PlannerWorker(min_servers=1)
    started = tmp_path / "started"
    errors: list[BaseException] = []

    def run():
        try:
            worker.run(hang_in_a_worker, started, 1)
        except WorkerDied as e:
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    _until_started(started)
    worker.close()
    t.join(30)
    assert not t.is_alive() and len(errors) == 1


def test_long_inputs_and_outcomes_cross_the_pipe_in_chunks_and_whole():
    """The records of the inputs and the servers of an outcome's cluster go in chunks of CHUNK_ITEMS (one
    pickle call each, so the GIL is free between them); what arrives equals what was sent."""
    from orchestrator.model import Cluster, Server, Service
    from orchestrator.service import planning
    from orchestrator.service.planning import Outcome, _receive, _send

    orch = _calibrated_inputs()
    inputs = _inputs(orch)
    from dataclasses import replace

    from orchestrator.service.registry import ServerRecord

    many = [
        ServerRecord(replace(inputs.records[k % 3].info, peer_id=f"p{k:04d}"), rtt_s=0.001 * (1 + k % 7))
        for k in range(3 * planning.CHUNK_ITEMS + 5)
    ]
    big_inputs = replace(inputs, records=many)
    cluster = Cluster(Service(4, 100.0, 10.0), tuple(Server(f"s{k}", 1000.0, 0.01, 1e-3) for k in range(700)), 0.5, 0.7)
    outcome = Outcome(cluster=cluster, peers=[f"s{k}" for k in range(700)], pinned=["s3"])
    a, b = multiprocessing.Pipe()

    class Counting:
        messages = 0

        def send_bytes(self, data):
            Counting.messages += 1
            a.send_bytes(data)

    got, sent = [], []
    for obj in (big_inputs, outcome, "a plain value"):
        before = Counting.messages
        t = threading.Thread(target=lambda o=obj: _send(Counting(), "head", o))  # the pipe holds less than one
        t.start()
        got.append(_receive(b))
        t.join(10)
        sent.append(Counting.messages - before)
    assert got == [("head", big_inputs), ("head", outcome), ("head", "a plain value")]
    assert sent == [1 + 4, 1 + 3, 1]  # the shell, then the chunks
    a.close()
    b.close()
