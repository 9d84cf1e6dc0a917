"""Kill a server mid-session (SIGKILL): the client replaces it, replays, and the text is identical."""

from __future__ import annotations

import signal
import time

import pytest
from transformers.generation.streamers import BaseStreamer

from petals_chain.client.model import DistributedModelForCausalLM
from petals_chain.swarm.local import LocalSwarm
from petals_chain.swarm.records import fetch_servers

pytestmark = [pytest.mark.integration, pytest.mark.model]


class KillAfter(BaseStreamer):
    """Kills the server holding the session's middle hop after `n` generated tokens."""

    def __init__(self, swarm, session, n):
        self.swarm, self.session, self.n, self.seen, self.killed = swarm, session, n, -1, None
        self.kill_time_s = None

    def put(self, value):
        self.seen += 1  # the first put is the prompt
        if self.seen == self.n and self.killed is None:
            peer = self.session.chain.hops[1].peer_id
            victim = next(sp for sp in self.swarm.servers if sp.peer_id == peer)
            self.swarm.kill_server(victim)
            self.killed, self.kill_time_s = victim, time.monotonic()

    def end(self):
        pass


def test_failover_after_sigkill_gives_identical_text(smollm2_path, smollm2_hf, smollm2_tokenizer):
    ranges = [(0, 10), (10, 20), (20, 30), (10, 20)]  # a spare for the middle blocks
    with LocalSwarm("smollm2-135m", ranges, server_args=["--num-threads", "1"]) as swarm:
        model = DistributedModelForCausalLM.from_pretrained("smollm2-135m", initial_peers=swarm.initial_peers)
        try:
            ids = smollm2_tokenizer("The history of the printing press", return_tensors="pt").input_ids
            ref = smollm2_hf.generate(ids, max_new_tokens=20, do_sample=False)
            with model.inference_session(max_length=64) as session:
                before = session.chain.hops[1].peer_id
                tail = session.chain.hops[2].peer_id
                streamer = KillAfter(swarm, session, n=8)
                start_s = time.monotonic()
                out = model.generate(ids, max_new_tokens=20, do_sample=False, streamer=streamer)
                after = session.chain.hops[1].peer_id
                assert streamer.killed is not None and not streamer.killed.alive
                assert session.chain.failovers == 1
                assert after != before  # the dead peer is not retried
                assert session.chain.hops[2].peer_id == tail  # only the failed span was replaced
                assert time.monotonic() - start_s < 60
            assert out.tolist() == ref.tolist()
            # the killed server's record expires from the DHT within seconds (TTL 3 x announce period)
            dead = streamer.killed.peer_id
            deadline = time.monotonic() + 15
            while dead in {s.peer_id for s in _records(model)} and time.monotonic() < deadline:
                time.sleep(0.5)
            assert dead not in {s.peer_id for s in _records(model)}
            # a clean SIGTERM announces "offline" at once
            leaving = swarm.servers[0]
            swarm.kill_server(leaving, signal.SIGTERM)
            assert leaving.process.returncode == 0
            deadline = time.monotonic() + 10  # the DHT lookup may see the store a moment late under load
            while leaving.peer_id not in {s.peer_id for s in _records(model, states=("offline",))}:
                assert time.monotonic() < deadline, "the SIGTERMed server's 'offline' record never appeared"
                time.sleep(0.5)
        finally:
            model.backend.shutdown()


def _records(model, states=("online",)):
    return fetch_servers(model.backend.dht, model.backend.model, states=states)
