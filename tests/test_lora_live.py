"""LoRA adapters through real servers: the DHT records list each server's adapters, client-side
routing uses only servers serving the session's adapter, sessions with different adapters (and
none) run at once on a shared server with text identical to HF + peft, and an unknown adapter gets
a typed error naming the served ones (from the client's routing and from a server)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from petals_chain.client.model import DistributedModelForCausalLM
from petals_chain.errors import UnknownAdapterError
from petals_chain.swarm.local import LocalSwarm
from petals_chain.wire.records import ServerInfo, ServerState
from tests.family_checkpoints import VOCAB, load_hf, load_hf_with_lora, save_random_lora
from tests.swarm_helpers import RawStream

pytestmark = pytest.mark.integration

GREEDY = dict(max_new_tokens=6, do_sample=False, eos_token_id=None)


def test_adapters_route_batch_and_match_hf_peft(tiny_llama_path, tmp_path):
    alpha = save_random_lora(tiny_llama_path, tmp_path / "alpha", ["q_proj", "v_proj", "up_proj"], seed=1)
    beta = save_random_lora(tiny_llama_path, tmp_path / "beta", ["k_proj", "o_proj"], r=2, alpha=4, seed=2)
    # head [0, 3) serves both; the tail [3, 6) exists once per adapter, so each adapter has one chain
    per_server = [["--adapters", str(alpha), str(beta)], ["--adapters", str(beta)], ["--adapters", str(alpha)]]
    with LocalSwarm(
        str(tiny_llama_path),
        [(0, 3), (3, 6), (3, 6)],
        per_server_args=per_server,
        server_args=["--num-threads", "1", "--memory-budget", "64MiB", "--max-length", "64"],
    ) as swarm:
        head, tail_beta, tail_alpha = swarm.servers
        model = DistributedModelForCausalLM.from_pretrained(
            str(tiny_llama_path),
            initial_peers=swarm.initial_peers,
            use_orchestrator=False,
            identity_path=str(tmp_path / "client.key"),
        )
        try:
            assert model.backend.server_info(head.peer_id).adapters == ["alpha", "beta"]
            assert model.backend.server_info(tail_beta.peer_id).adapters == ["beta"]
            prompts = {
                name: torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(i))
                for i, name in enumerate(("alpha", "beta", None))
            }
            refs = {
                "alpha": load_hf_with_lora(tiny_llama_path, alpha),
                "beta": load_hf_with_lora(tiny_llama_path, beta),
                None: load_hf(tiny_llama_path),
            }
            expected = {name: refs[name].generate(ids, **GREEDY).tolist() for name, ids in prompts.items()}
            got, hops = {}, {}

            def run(name):
                # each session picks its adapter (None: the base model, which every server serves)
                with model.inference_session(max_length=32, adapter=name) as session:
                    got[name] = model.generate(prompts[name], **GREEDY).tolist()
                    hops[name] = [h.peer_id for h in session.chain.hops]

            threads = [threading.Thread(target=run, args=(name,)) for name in prompts]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)
            assert got == expected
            assert hops["alpha"] == [head.peer_id, tail_alpha.peer_id]
            assert hops["beta"] == [head.peer_id, tail_beta.peer_id]

            with pytest.raises(UnknownAdapterError, match=r"'gamma'.*\['alpha', 'beta'\]"):
                with model.inference_session(max_length=16, adapter="gamma"):
                    pass
            stream = RawStream(model.backend, tail_beta.peer_id)  # a server refuses an adapter it lacks
            try:
                err = stream.expect_error({"type": "open", "session_id": "x", "max_length": 16, "adapter": "alpha"})
                assert isinstance(err, UnknownAdapterError) and "['beta']" in str(err)
            finally:
                stream.close()
        finally:
            model.backend.shutdown()


def test_orchestrator_excludes_servers_without_the_adapter():
    from orchestrator.service.core import Orchestrator

    def record(peer, adapters):
        info = ServerInfo(peer, "m", 0, 1, ServerState.ONLINE, 1, 1, 1, 8, 1, 0.1, 0.1, adapters=adapters)
        return SimpleNamespace(info=info)

    orch = SimpleNamespace(
        records={"a": record("a", ["x", "y"]), "b": record("b", ["y"]), "c": record("c", [])}, lock=threading.RLock()
    )
    assert Orchestrator.peers_without_adapter(orch, "x") == {"b", "c"}
    assert Orchestrator.peers_without_adapter(orch, "y") == {"c"}
    with pytest.raises(UnknownAdapterError, match=r"'z'.*\['x', 'y'\]"):
        Orchestrator.peers_without_adapter(orch, "z")
