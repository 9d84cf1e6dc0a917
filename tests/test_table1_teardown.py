"""An interrupted Table 1 run (SIGTERM, a time limit) stops its load generator before its swarm."""

from __future__ import annotations

import os
import select
import subprocess

from experiments.table1 import stop_loadgen


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # a zombie has stopped running
    except FileNotFoundError:
        return True


def test_stop_loadgen_kills_its_process_group():
    """The load generator runs in a session of its own (a SIGTERM to the experiment does not reach it);
    stop_loadgen ends it and what it started, so requests in flight are not recorded as failed by
    servers being torn down (seen on a GPU run cut by its time limit)."""
    gen = subprocess.Popen(
        ["sh", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    child = int(gen.stdout.readline())
    try:
        stop_loadgen(gen)
        assert gen.returncode is not None
        # the child holds the pipe's write end too: the pipe reaches its end once every process of
        # the group has gone (waited for with a deadline, not polled)
        readable, _, _ = select.select([gen.stdout], [], [], 10)
        assert readable and gen.stdout.read() == "", "the load generator's child outlived it"
        assert _gone(child)
        stop_loadgen(gen)  # one that has ended, and None: nothing to do
        stop_loadgen(None)
    finally:
        if not _gone(child):
            os.kill(child, 9)
        gen.stdout.close()
