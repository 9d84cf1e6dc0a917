"""Speculative decoding and KV rollback on live servers (tiny random Llama, 2 hops + spares):
exact greedy output with prompt lookup, every hop rolled back with the client, a regenerated chat
turn that reuses the earlier KV, and rollbacks after a failover whose replay used the cut history
(with either relay)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer

from petals_chain.client.model import DistributedModelForCausalLM
from petals_chain.swarm.local import LocalSwarm

pytestmark = pytest.mark.integration

REPETITIVE = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8]


class KillMiddleAfter(BaseStreamer):
    """SIGKILLs the server of the session's second hop after `n` rounds of accepted tokens."""

    def __init__(self, swarm, session, n):
        self.swarm, self.session, self.n, self.puts, self.killed = swarm, session, n, 0, None

    def put(self, value):
        self.puts += 1  # the first put is the prompt
        if self.puts == self.n + 1 and self.killed is None:
            peer = self.session.chain.hops[1].peer_id
            self.killed = next(sp for sp in self.swarm.servers if sp.peer_id == peer)
            self.swarm.kill_server(self.killed)

    def end(self):
        pass


def test_rollback_across_hops_regenerated_turn_and_failover(tiny_llama_path):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    ids = torch.tensor([REPETITIVE])
    ref = hf.generate(ids, max_new_tokens=30, do_sample=False)
    with LocalSwarm(
        str(tiny_llama_path),
        [(0, 3), (3, 6), (3, 6), (3, 6)],  # spares: one failover per relay
        server_args=["--num-threads", "1", "--max-length", "128"],
    ) as swarm:
        model = DistributedModelForCausalLM.from_pretrained(
            str(tiny_llama_path), initial_peers=swarm.initial_peers, use_orchestrator=False
        )
        try:
            # 1. prompt lookup across 2 hops: rejected drafts are rolled back on both servers (each
            #    rollback step's reply must report the position the client expects)
            with model.inference_session(max_length=80) as session:
                out = model.generate(ids, max_new_tokens=30, do_sample=False, prompt_lookup_num_tokens=4)
                assert out.tolist() == ref.tolist()
                stats, chain = session.last_generate, session.chain
                assert len(chain.hops) == 2 and chain.rollbacks > 0
                assert stats.accepted_draft_tokens > 0 and stats.chain_steps < stats.tokens
                # 2. regenerate the last turn: the chain keeps the prompt's KV and recomputes one token
                session.token_ids = ids[0].tolist()
                first_new_step = len(chain.hop_timings)
                again = model.generate(
                    torch.tensor([[]], dtype=torch.long), max_new_tokens=30, do_sample=False, prompt_lookup_num_tokens=4
                )
                assert again.tolist() == ref.tolist()
                assert chain.hop_timings[first_new_step].tokens < 1 + 4 + 1  # its first step: no prompt replay
            # 3. a failover mid-generation: the replacement replays the history as cut by the rollbacks,
            #    with server relay (the pushes carry each rollback's start) and with client relay
            _failover_with_rollbacks(swarm, model, ids, ref)
            relayed_by_client = DistributedModelForCausalLM.from_pretrained(
                str(tiny_llama_path), initial_peers=swarm.initial_peers, use_orchestrator=False, relay="client"
            )
            try:
                _failover_with_rollbacks(swarm, relayed_by_client, ids, ref)
            finally:
                relayed_by_client.backend.shutdown()
        finally:
            model.backend.shutdown()


def _failover_with_rollbacks(swarm, model, ids, ref):
    with model.inference_session(max_length=80) as session:
        streamer = KillMiddleAfter(swarm, session, n=3)
        out = model.generate(ids, max_new_tokens=30, do_sample=False, prompt_lookup_num_tokens=4, streamer=streamer)
        assert streamer.killed is not None and session.chain.failovers == 1
        assert session.chain.rollbacks > 0
    assert out.tolist() == ref.tolist()
