"""The real distributed system: a DHT peer and block servers as processes on 127.0.0.1."""

from __future__ import annotations

import threading

import pytest
import torch

from petals_chain.client.model import DistributedModelForCausalLM
from petals_chain.errors import (
    InvalidRequestError,
    MaxLengthExceededError,
    OutOfCacheError,
    UnknownSessionError,
)
from petals_chain.swarm.local import LocalSwarm
from petals_chain.wire import codec as wire
from tests.swarm_helpers import RawStream

pytestmark = [pytest.mark.integration, pytest.mark.model]

# Each server: 10 blocks x 14.2 MB of weights; at --max-length 4096 a whole-range session reserves
# 10 x 6.3 MB. A 300 MiB budget holds the weights plus two such sessions, not three.
SERVER_ARGS = ["--num-threads", "1", "--memory-budget", "300MiB", "--max-length", "4096"]
PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "The sun is a",
    "In 1492, Columbus",
    "Water boils at",
    "My favourite colour is",
    "A haiku about rain:",
]


@pytest.fixture(scope="module")
def swarm(smollm2_path):
    with LocalSwarm("smollm2-135m", [(0, 10), (10, 20), (20, 30)], server_args=SERVER_ARGS) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def client(swarm):
    model = DistributedModelForCausalLM.from_pretrained("smollm2-135m", initial_peers=swarm.initial_peers)
    yield model
    model.backend.shutdown()


def _reference(hf, tokenizer, prompt, n):
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    return ids, hf.generate(ids, max_new_tokens=n, do_sample=False)


def test_distributed_greedy_equals_local_hf(client, smollm2_hf, smollm2_tokenizer):
    ids, ref = _reference(smollm2_hf, smollm2_tokenizer, "The three primary colors are", 24)
    with client.inference_session(max_length=64) as session:
        out = client.generate(ids, max_new_tokens=24, do_sample=False)
        assert [h.start for h in session.chain.hops] == [0, 10, 20]
    assert out.tolist() == ref.tolist()


def test_multi_turn_session_continues_cache(client, smollm2_hf, smollm2_tokenizer):
    first = smollm2_tokenizer("The capital of France is", return_tensors="pt").input_ids
    follow = smollm2_tokenizer(" Paris. The capital of Italy is", return_tensors="pt").input_ids
    with client.inference_session(max_length=128) as session:
        a = client.generate(first, max_new_tokens=4, do_sample=False)
        b = client.generate(follow, max_new_tokens=6, do_sample=False)
        assert session.position == b.shape[1] - 1  # the last sampled token is not fed yet
    full = torch.cat([a, follow], dim=1)
    ref = smollm2_hf.generate(full, max_new_tokens=6, do_sample=False)
    assert b.tolist() == ref.tolist()


@pytest.mark.parametrize("n_sessions", [2, 8])
def test_concurrent_sessions_all_correct(client, smollm2_hf, smollm2_tokenizer, n_sessions):
    refs = [_reference(smollm2_hf, smollm2_tokenizer, p, 8) for p in PROMPTS[:n_sessions]]
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def run(i):
        try:
            # one model object shared by every thread: each generate gets its own session
            results[i] = client.generate(refs[i][0], max_new_tokens=8, do_sample=False).tolist()
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n_sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert not errors, errors
    assert [results[i] for i in range(n_sessions)] == [ref.tolist() for _, ref in refs]


def test_session_over_budget_refused_while_others_run(swarm, client, smollm2_hf, smollm2_tokenizer):
    peer = swarm.servers[0].peer_id
    held = [RawStream(client.backend, peer) for _ in range(3)]
    try:
        for i, s in enumerate(held[:2]):
            reply, _ = s.send({"type": "open", "session_id": f"big{i}", "max_length": 4096})
            assert reply["type"] == "opened"
        err = held[2].expect_error({"type": "open", "session_id": "big2", "max_length": 4096, "admission_wait_s": 0})
        assert isinstance(err, OutOfCacheError) and "free" in str(err)
        assert client.backend.server_info(peer).free_kv_slots == 0
        # other sessions (small max_length) still run, with correct output
        ids, ref = _reference(smollm2_hf, smollm2_tokenizer, "Water boils at", 6)
        assert client.generate(ids, max_new_tokens=6, do_sample=False).tolist() == ref.tolist()
    finally:
        for s in held:
            s.close()


def test_bad_input_gets_typed_errors_and_server_keeps_serving(swarm, client, smollm2_hf, smollm2_tokenizer):
    peer = swarm.servers[1].peer_id
    s = RawStream(client.backend, peer)
    try:
        assert isinstance(
            s.expect_error({"type": "step", "session_id": "x"}, (torch.zeros(1, 576),)), UnknownSessionError
        )  # step before open
        assert isinstance(
            s.expect_error({"type": "open", "session_id": "a", "max_length": 10**6}), MaxLengthExceededError
        )
        assert isinstance(
            s.expect_error({"type": "open", "session_id": "a", "max_length": "long"}), InvalidRequestError
        )
        assert isinstance(
            s.expect_error({"type": "open", "session_id": "a", "max_length": 16, "entry_block": 3}), InvalidRequestError
        )  # entry block outside [10, 20)
        assert isinstance(s.expect_error({"type": "dance"}), InvalidRequestError)
        garbage = wire.runtime_pb2.ExpertRequest(metadata=b"\xc1\xff\x00garbage")
        assert isinstance(s.expect_error({}, request=garbage), InvalidRequestError)
        reply, _ = s.send({"type": "open", "session_id": "a", "max_length": 16})
        assert reply["type"] == "opened"
        assert isinstance(
            s.expect_error({"type": "step", "session_id": "b"}, (torch.zeros(1, 576),)), UnknownSessionError
        )
        assert isinstance(
            s.expect_error({"type": "step", "session_id": "a"}, (torch.zeros(1, 575),)), InvalidRequestError
        )  # wrong shape
        assert isinstance(
            s.expect_error({"type": "step", "session_id": "a"}, (torch.zeros(1, 576, dtype=torch.float64),)),
            InvalidRequestError,
        )  # wrong dtype
        assert isinstance(
            s.expect_error({"type": "step", "session_id": "a"}, (torch.zeros(17, 576),)), MaxLengthExceededError
        )
        assert isinstance(s.expect_error({"type": "step", "session_id": "a"}), InvalidRequestError)  # no tensor
        bad_tensor = wire.runtime_pb2.ExpertRequest(
            metadata=wire.pack({"type": "step", "session_id": "a"}),
            tensors=[wire.runtime_pb2.Tensor(buffer=b"123", size=[7, 576], dtype="float32")],
        )
        assert isinstance(s.expect_error({}, request=bad_tensor), InvalidRequestError)
        # the same stream still works after all that, and lost nothing
        reply, (out,) = s.send({"type": "step", "session_id": "a"}, (torch.randn(3, 576),))
        assert reply["type"] == "step" and reply["position"] == 3 and out.shape == (3, 576)
    finally:
        s.close()
    ids, ref = _reference(smollm2_hf, smollm2_tokenizer, "Once upon a time", 6)
    assert client.generate(ids, max_new_tokens=6, do_sample=False).tolist() == ref.tolist()


def test_stateless_forward_matches_session(client, smollm2_tokenizer):
    ids = smollm2_tokenizer("Hello there, how are", return_tensors="pt").input_ids
    hidden = client.head.embed_tokens(ids[0])
    stateless = client.backend.forward(hidden.unsqueeze(0))[0]
    with client.inference_session(max_length=32) as session:
        stepped = session.chain.step(hidden)
    torch.testing.assert_close(stateless, stepped, atol=1e-5, rtol=0)
