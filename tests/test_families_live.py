"""Each new family served by 2 real servers (one swarm holds them all, started once): logits within
1e-5 of HF's, greedy multi-turn text identical to HF's, concurrent sessions, and prefix reuse
from the servers' prefix caches."""

from __future__ import annotations

import threading

import pytest
import torch

from petals_chain.client.model import DistributedModelForCausalLM
from petals_chain.swarm.local import LocalSwarm
from tests.family_checkpoints import VOCAB, load_hf

pytestmark = pytest.mark.integration

FAMILIES = ("qwen2", "mistral", "mixtral", "bloom", "falcon-new")
GREEDY = dict(max_new_tokens=6, do_sample=False, eos_token_id=None)


@pytest.fixture(scope="module")
def family_swarm(tiny_family_path):
    """Servers [0, 2) and [2, 4) of every family in FAMILIES, all in one DHT."""
    paths = {f: tiny_family_path(f) for f in FAMILIES}
    per_server = [["--model", str(paths[f])] for f in FAMILIES for _ in range(2)]
    with LocalSwarm(
        str(paths[FAMILIES[0]]),
        [(0, 2), (2, 4)] * len(FAMILIES),
        per_server_args=per_server,
        server_args=["--num-threads", "1", "--memory-budget", "64MiB", "--max-length", "128"],
    ) as swarm:
        yield swarm, paths


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
def test_family_through_two_servers_matches_hf(family_swarm, family, tmp_path):
    swarm, paths = family_swarm
    i = FAMILIES.index(family)
    servers = swarm.servers[2 * i : 2 * i + 2]
    hf = load_hf(paths[family])
    model = DistributedModelForCausalLM.from_pretrained(
        str(paths[family]),
        initial_peers=swarm.initial_peers,
        use_orchestrator=False,
        identity_path=str(tmp_path / "client.key"),
        allowed_servers=[sp.peer_id for sp in servers],
    )
    try:
        prompt, follow_up = _ids(20, seed=i), _ids(5, seed=100 + i)
        with torch.inference_mode():
            assert float((model(prompt).logits - hf(prompt).logits).abs().max()) <= 1e-5
        ref1 = hf.generate(prompt, **GREEDY)
        ref2 = hf.generate(torch.cat([ref1, follow_up], dim=1), **GREEDY)
        # a one-shot generate opens with its prompt: both servers cache its first 16-token chunk
        assert model.generate(prompt, **GREEDY).tolist() == ref1.tolist()
        with model.inference_session(max_length=64):  # multi-turn: the second turn continues the cache
            assert model.generate(prompt, **GREEDY).tolist() == ref1.tolist()
            assert model.generate(follow_up, **GREEDY).tolist() == ref2.tolist()

        # concurrent sessions (the servers may batch their steps), the second one reusing that chunk
        other = _ids(9, seed=200 + i)
        refs = {"other": hf.generate(other, **GREEDY), "again": ref1}
        got, reused = {}, {}

        def run(name, ids):
            with model.inference_session(max_length=32, prompt_ids=ids[0]) as session:
                reused[name] = session.chain.prefix_tokens
                got[name] = model.generate(ids, **GREEDY)

        threads = [
            threading.Thread(target=run, args=("other", other)),
            threading.Thread(target=run, args=("again", prompt)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert {k: v.tolist() for k, v in got.items()} == {k: v.tolist() for k, v in refs.items()}
        assert reused == {"other": 0, "again": 16}
    finally:
        model.backend.shutdown()
