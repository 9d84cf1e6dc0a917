"""A live swarm with prefix caches: a second session sharing a prompt prefix reuses it on every hop
(identical text to HF), another client gets no hit (scope client), and a failover after reuse
rebuilds the replacement's prefix and still gives identical text (span and whole-chain failover with
server relay, and span failover with client relay)."""

from __future__ import annotations

import pytest
import torch

from petals_chain.client.model import DistributedModelForCausalLM
from petals_chain.errors import InvalidRequestError
from petals_chain.swarm.local import LocalSwarm
from petals_chain.wire.prefix_keys import prefix_hashes
from tests.swarm_helpers import RawStream
from tests.test_failover import KillAfter

pytestmark = [pytest.mark.integration, pytest.mark.model]

SYSTEM = (
    "You are a patient assistant for a small public library. You answer questions about opening hours, "
    "borrowing rules and events in one or two short sentences, politely, without lists.\n"
)
# continuations that run all 8 greedy tokens without reaching EOS (checked against HF below)
QUESTIONS = [
    "Question: When does the library open on Saturday?\nAnswer: The library",
    "Question: How many books may I borrow at once?\nAnswer: You",
    "Question: Is there a reading club for children?\nAnswer: Yes, the",
]


def _client(swarm, identity, servers, relay="server"):
    return DistributedModelForCausalLM.from_pretrained(
        "smollm2-135m",
        initial_peers=swarm.initial_peers,
        use_orchestrator=False,
        identity_path=str(identity),
        allowed_servers=[sp.peer_id for sp in servers],
        relay=relay,
    )


def _ask(model, ids, n=8, streamer=None):
    with model.inference_session(max_length=ids.shape[1] + n + 1, prompt_ids=ids[0]) as session:
        out = model.generate(ids, max_new_tokens=n, do_sample=False, streamer=streamer)
        return out, session.chain


def _cache(model, sp):
    return model.backend.server_info(sp.peer_id).extra["prefix_cache"]


def test_prefix_reuse_across_sessions_scope_and_failover(smollm2_path, smollm2_hf, smollm2_tokenizer, tmp_path):
    prompts = [smollm2_tokenizer(SYSTEM + q, return_tensors="pt").input_ids for q in QUESTIONS]
    refs = [smollm2_hf.generate(ids, max_new_tokens=8, do_sample=False) for ids in prompts]
    assert all(ref.shape[1] == ids.shape[1] + 8 for ref, ids in zip(refs, prompts))
    shared = min(len(ids[0]) for ids in prompts)
    assert shared >= 32
    server_args = ["--num-threads", "1", "--policy", "dlpm", "--prefix-sharing", "client"]
    ranges = [(0, 12), (12, 30), (12, 30), (12, 30), (12, 30)]
    with LocalSwarm("smollm2-135m", ranges, server_args=server_args) as swarm:
        head, mid, spare, spare2, spare3 = swarm.servers
        alice = _client(swarm, tmp_path / "alice.key", [head, mid])
        try:
            out, chain = _ask(alice, prompts[0])
            assert out.tolist() == refs[0].tolist() and chain.prefix_tokens == 0  # nothing cached yet
            out, chain = _ask(alice, prompts[1])
            assert chain.prefix_tokens >= 16 and chain.prefix_tokens % 16 == 0  # the system prompt, from both hops
            assert out.tolist() == refs[1].tolist()
            for sp in (head, mid):
                stats = _cache(alice, sp)
                assert stats["hit_tokens"] == chain.prefix_tokens and stats["sharing"] == "client"
        finally:
            alice.backend.shutdown()

        bob = _client(swarm, tmp_path / "bob.key", [head, mid])
        try:
            out, chain = _ask(bob, prompts[1])
            assert chain.prefix_tokens == 0  # alice's prompt is not bob's: no hit, no timing to learn
            assert out.tolist() == refs[1].tolist()
            _bad_prefix_fields_get_typed_errors(bob, head, prefix_hashes(prompts[1][0].tolist(), "smollm2-135m"))
        finally:
            bob.backend.shutdown()

        for other in (spare, spare2, spare3):  # the spares learn alice's prefix too
            alice = _client(swarm, tmp_path / "alice.key", [head, other])
            try:
                assert _ask(alice, prompts[0])[0].tolist() == refs[0].tolist()
            finally:
                alice.backend.shutdown()

        # span failover (client-side routing): the replacement of the killed hop did not take the
        # prefix from a cache; it is rebuilt from the prefix run statelessly through the head
        survivors = _failover_after_reuse(swarm, tmp_path, [head, mid, spare], prompts[2], refs[2], whole_chain=False)
        # whole-chain failover (what a session does with an orchestrator): replayed from block 0
        survivors = _failover_after_reuse(
            swarm, tmp_path, [head, survivors[0], spare2], prompts[2], refs[2], whole_chain=True
        )
        # the client relaying every hop itself (no pushes): the same rebuild of the prefix
        _failover_after_reuse(
            swarm, tmp_path, [head, survivors[0], spare3], prompts[2], refs[2], whole_chain=False, relay="client"
        )


def _failover_after_reuse(swarm, tmp_path, servers, ids, ref, whole_chain, relay="server"):
    alice = _client(swarm, tmp_path / "alice.key", servers, relay)
    try:
        alice.backend.provider.whole_chain_failover = whole_chain
        with alice.inference_session(max_length=ids.shape[1] + 9, prompt_ids=ids[0]) as session:
            assert session.chain.prefix_tokens >= 16
            killer = KillAfter(swarm, session, n=3)
            out = alice.generate(ids, max_new_tokens=8, do_sample=False, streamer=killer)
            assert killer.killed is not None and session.chain.failovers == 1
        assert out.tolist() == ref.tolist()  # identical text although the replacement held no prefix
        return [sp for sp in servers[1:] if sp is not killer.killed]
    finally:
        alice.backend.shutdown()


def _bad_prefix_fields_get_typed_errors(model, server, hashes):
    """Bad prefix fields at the RPC boundary: typed errors, and the stream keeps serving."""
    stream = RawStream(model.backend, server.peer_id)
    try:
        for bad in ("abc", ["zz"], [1, 2], ["0" * 31]):
            err = stream.expect_error({"type": "open", "session_id": "x", "max_length": 64, "prefix_hashes": bad})
            assert isinstance(err, InvalidRequestError) and "prefix" in str(err)
        reply, _ = stream.send({"type": "open", "session_id": "x", "max_length": 64, "prefix_hashes": hashes})
        assert reply["type"] == "opened" and reply["prefix_match_tokens"] >= 16  # bob's own earlier prompt
        hidden = torch.zeros(4, model.config.hidden_size)
        for too_much in (reply["prefix_match_tokens"] + 16, 5, -16):
            err = stream.expect_error({"type": "step", "session_id": "x", "prefix_tokens": too_much}, (hidden,))
            assert isinstance(err, InvalidRequestError)
        reply, (out,) = stream.send({"type": "step", "session_id": "x", "prefix_tokens": 16}, (hidden,))
        assert reply["position"] == 20 and out.shape == hidden.shape
        err = stream.expect_error({"type": "step", "session_id": "x", "prefix_tokens": 16}, (hidden,))
        assert "first step" in str(err)  # only the first step may take cached tokens
    finally:
        stream.close()
