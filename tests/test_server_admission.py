"""A live server: admission queue (wait, policy-chosen grant, deadline, refusal), idle-session
timeout freeing KV, and launch-server's policy flags."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import pytest
import torch

from petals_chain.client.model import DistributedModelForCausalLM
from petals_chain.errors import (
    AdmissionTimeoutError,
    OutOfCacheError,
    SessionIdleTimeoutError,
)
from petals_chain.swarm.local import REPO_ROOT, LocalSwarm
from petals_chain.wire import codec as wire
from tests.swarm_helpers import RawStream

pytestmark = [pytest.mark.integration, pytest.mark.model]

# 30 blocks x 14.2 MB of weights = 425 MB; a whole-range session at 4096 tokens reserves 189 MB:
# a 700 MiB budget holds exactly one such session.
SERVER_ARGS = [
    "--num-threads",
    "1",
    "--memory-budget",
    "700MiB",
    "--max-length",
    "4096",
    "--policy",
    "vtc",
    "--policy-arg",
    "w_out=2",
    "--max-batch-tokens",
    "64",
    "--session-idle-timeout",
    "8",
    "--admission-timeout",
    "6",
    "--admission-queue",
    "2",
]


@pytest.fixture(scope="module")
def swarm(smollm2_path):
    with LocalSwarm("smollm2-135m", [(0, 30)], server_args=SERVER_ARGS) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def client(swarm):
    model = DistributedModelForCausalLM.from_pretrained(
        "smollm2-135m", initial_peers=swarm.initial_peers, use_orchestrator=False
    )
    yield model
    model.backend.shutdown()


def _open(stream: RawStream, sid: str, **extra) -> dict:
    reply, _ = stream.send_raw(
        wire.request({"type": "open", "session_id": sid, "max_length": 4096, **extra}), timeout_s=30
    )
    return reply


def _wait_free_slots(client, peer, want, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if client.backend.server_info(peer).free_kv_slots == want:
            return
        time.sleep(0.2)
    raise AssertionError(f"free_kv_slots did not reach {want} within {timeout_s} s")


def test_admission_waits_then_grants_refuses_and_times_out(swarm, client):
    peer = swarm.servers[0].peer_id
    _wait_free_slots(client, peer, 1)
    holder, waiter, impatient, late = (RawStream(client.backend, peer) for _ in range(4))
    try:
        assert _open(holder, "holder")["type"] == "opened"
        # no wait asked: refused at once
        err = impatient.expect_error({"type": "open", "session_id": "x", "max_length": 4096, "admission_wait_s": 0})
        assert type(err) is OutOfCacheError
        box = {}
        t = threading.Thread(target=lambda: box.setdefault("reply", _open(waiter, "waiter")))
        t.start()
        deadline = time.monotonic() + 5
        while client.backend.server_info(peer).extra.get("admission_queue_length") != 1:
            assert time.monotonic() < deadline, "the second session never entered the admission queue"
            time.sleep(0.05)
        holder.close()  # the stream ends: its KV is freed
        t.join(30)
        assert box["reply"]["type"] == "opened"  # it got the freed slot, before its deadline
        reply, (out,) = waiter.send({"type": "step", "session_id": "waiter"}, (torch.randn(5, 576),))
        assert reply["type"] == "step" and out.shape == (5, 576)
        # the slot is held by `waiter` (active, far from its 8 s idle timeout): `late` asks to wait at most
        # 2 s (the server caps waits at its --admission-timeout 6) and gets the typed error at its deadline
        err = late.expect_error({"type": "open", "session_id": "late", "max_length": 4096, "admission_wait_s": 2})
        assert isinstance(err, AdmissionTimeoutError) and "admission queue" in str(err)
    finally:
        for s in (holder, waiter, impatient, late):
            s.close()
    _wait_free_slots(client, peer, 1)


def test_idle_session_is_closed_and_its_kv_freed(swarm, client):
    peer = swarm.servers[0].peer_id
    _wait_free_slots(client, peer, 1)
    silent = RawStream(client.backend, peer)
    try:
        assert _open(silent, "silent")["type"] == "opened"
        assert client.backend.server_info(peer).free_kv_slots == 0
        _wait_free_slots(client, peer, 1, timeout_s=40)  # --session-idle-timeout 8 frees it

        async def next_reply():  # the server told the silent client why
            return wire.unpack((await asyncio.wait_for(anext(silent.responses), 5)).metadata)

        reply = client.backend.loop.run(next_reply(), timeout_s=7)
        assert reply["type"] == "error" and reply["code"] == SessionIdleTimeoutError.code
    finally:
        silent.close()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--policy", "vtc", "--policy-arg", "w_x=1"], "no parameter 'w_x'"),
        (["--policy", "vtc", "--policy-arg", "w_in=-1"], "must be >= 0"),
        (["--policy", "fcfs", "--policy-arg", "w_in=1"], "no parameter"),
        (["--policy", "lottery"], "invalid choice"),
        (["--max-batch-tokens", "0"], "must be >= 1"),
    ],
)
def test_launch_server_rejects_bad_policy_flags(args, message):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "server.cli",
            "--initial-peers",
            "/ip4/127.0.0.1/tcp/1/p2p/QmW91aaAN3fKnU9CDMMrWLyRmaiaBFqwKKgqDTm6LaWpUc",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
    )
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_launch_server_help_lists_policies_and_parameters():
    proc = subprocess.run(
        [sys.executable, "-m", "server.cli", "--help"], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT
    )
    assert proc.returncode == 0
    assert "vtc: w_in=1.0" in proc.stdout and "w_out=2.0" in proc.stdout and "fcfs:" in proc.stdout
