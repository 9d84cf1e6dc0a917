"""`petals-chain orchestrator --dispatch e2` on a live swarm: the client's acquire carries its prompt's prefix
hashes, a session sharing a cached prefix is sent to the chain that holds it (and reuses it on every hop,
identical text to HF), an unrelated prompt explores the other chain, and the orchestrator's prefix index
converges to what the servers' caches report."""

from __future__ import annotations

import pytest

from petals_chain.client.model import DistributedModelForCausalLM
from petals_chain.swarm.local import LocalSwarm
from tests.swarm_helpers import get_json, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.model]

SYSTEM = (
    "You are a patient assistant for a small public library. You answer questions about opening hours, "
    "borrowing rules and events in one or two short sentences, politely, without lists. The library is in "
    "the old town hall, has three floors, a children's corner, a quiet room and a cafe on the ground floor.\n"
)
QUESTIONS = [
    "Question: When does the library open on Saturday?\nAnswer: The library",
    "Question: How many books may I borrow at once?\nAnswer: You",
]
# as long as the shared prompts: E2's rebalancing compares the servers' loads over its window, which these
# two prefills make (their calibrated t_I grows on a loaded machine); a much shorter unrelated prompt would
# leave the first chain's server over Th_bal x the other's, and the third session would be sent to explore
OTHER = (
    "Write a haiku about the sea in winter, then explain in one sentence why you chose its images. Use plain "
    "words a child would know, keep every line short, mention the cold wind, the grey light over the water, a "
    "single gull and the harbour wall, and end the explanation with what the poem should make a reader feel.\n"
)


def _ask(model, ids, n=6):
    """(output ids, the chain's servers, prompt tokens it reused)."""
    with model.inference_session(max_length=ids.shape[1] + n + 1, prompt_ids=ids[0]) as session:
        out = model.generate(ids, max_new_tokens=n, do_sample=False)
        return out, [h.peer_id for h in session.chain.hops], session.chain.prefix_tokens


def test_e2_sends_a_shared_prefix_to_the_chain_that_holds_it(smollm2_path, smollm2_hf, smollm2_tokenizer, tmp_path):
    prompts = [smollm2_tokenizer(SYSTEM + q, return_tensors="pt").input_ids for q in QUESTIONS]
    other = smollm2_tokenizer(OTHER, return_tensors="pt").input_ids
    refs = [smollm2_hf.generate(ids, max_new_tokens=6, do_sample=False) for ids in prompts]
    server_args = ["--num-threads", "1", "--max-length", "512", "--prefix-sharing", "client"]
    orch = [
        "--policy",
        "jffc-only",
        "--expected-servers",
        "2",
        "--dispatch",
        "e2",
        "--prefix-sharing",
        "client",
        "--lease-ttl",
        "10",
    ]
    with LocalSwarm("smollm2-135m", [None, None], server_args=server_args, orchestrator_args=orch) as swarm:
        url = swarm.orchestrator_url
        status = wait_for(lambda: (s := get_json(url + "status"))["plan_installed"] and s, 120, "the plan online")
        assert status["dispatch"] == "e2" and len([c for c in status["chains"] if c["dispatchable"]]) == 2
        model = DistributedModelForCausalLM.from_pretrained(
            "smollm2-135m", initial_peers=swarm.initial_peers, identity_path=str(tmp_path / "alice.key")
        )
        try:
            out, first, reused = _ask(model, prompts[0])
            assert out.tolist() == refs[0].tolist() and reused == 0 and first
            _, explored, _ = _ask(model, other)  # nothing matched: explores the chain of least load (the other one)
            assert explored and explored != first
            out, second, reused = _ask(model, prompts[1])  # the system prompt is cached on `first`'s servers: exploit
            assert second == first
            assert reused >= 48 and out.tolist() == refs[1].tolist()
            st = get_json(url + "status")["prefix"]
            assert st["prefix_sharing"] == "client" and max(st["chain_hit_rate"].values()) > 0

            # the servers' reports: the index holds exactly the chunks their caches hold
            def converged():
                index = get_json(url + "status")["prefix"]["index_entries"]
                held = sum(
                    model.backend.server_info(sp.peer_id).extra["prefix_cache"]["chunks"] for sp in swarm.servers
                )
                return index == held and held > 0

            wait_for(converged, 60, "the prefix index to match the servers' caches")
        finally:
            model.backend.shutdown()
