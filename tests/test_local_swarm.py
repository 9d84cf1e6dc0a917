"""LocalSwarm's start-up: the DHT peer's address is a multiaddr line, not any line naming "/p2p/"."""

from __future__ import annotations

import sys

import pytest

from petals_chain.swarm.local import LocalSwarm, SwarmStartError, _is_peer_maddr

# What a DHT peer that failed in hivemind printed on a GPU host (missing multiaddr dependencies): the
# traceback's path holds "/p2p/", and was once passed to the servers as the swarm's address.
TRACEBACK = [
    "Traceback (most recent call last):",
    '  File "/tmp/site/hivemind/p2p/p2p_daemon.py", line 349, in get_visible_maddrs',
    "ModuleNotFoundError: No module named 'morphys'",
]


def test_only_a_multiaddr_line_is_the_peer_address():
    assert _is_peer_maddr("/ip4/127.0.0.1/tcp/31337/p2p/QmTg9Lc8Xc5ZXyW2n1DNZ5yqh1r6G1bS3pF2yMVdSL4Rnh\n")
    assert not any(map(_is_peer_maddr, TRACEBACK))
    assert not _is_peer_maddr("DHT peer running; pass the address above as --initial-peers /p2p/ x")


def test_a_dht_peer_that_fails_is_reported_with_its_traceback(tmp_path):
    # the DHT "process" prints a traceback and exits; the real command's arguments land in its sys.argv
    code = "import sys; print(*sys.argv[1:4], sep='\\n', flush=True); sys.exit(1)"
    placement = lambda role: ([sys.executable, "-c", code, *TRACEBACK], "127.0.0.1")  # noqa: E731
    with pytest.raises(SwarmStartError, match="the DHT peer did not start") as e:
        LocalSwarm(str(tmp_path), [(0, 1)], placement=placement).start()
    assert "No module named 'morphys'" in str(e.value)
