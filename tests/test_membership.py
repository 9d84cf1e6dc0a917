"""Private swarms: --allowed-peers on servers and the orchestrator, allowed_servers on clients."""

from __future__ import annotations

import pytest
import torch

from petals_chain.client.model import DistributedModelForCausalLM
from petals_chain.client.remote import RemoteChain
from petals_chain.errors import InvalidRequestError, NoChainError, NotAllowedError
from petals_chain.models.checkpoint import load_config
from petals_chain.swarm.identity import SwarmIdentity
from petals_chain.swarm.local import LocalSwarm
from petals_chain.transport.membership import parse_allowed_peers
from petals_chain.wire.messages import Hop
from petals_chain.wire.parts import MAX_PART_BYTES
from tests.swarm_helpers import ListedChains, RawStream

PEER = "QmSwuCzywcxNfG4R76jt2sdSJRFBtUPRFPcxj7C2bchx6y"


def test_allowlist_file_format():
    assert parse_allowed_peers(f"# members\n{PEER}  # the lab's client\n\n") == frozenset({PEER})
    with pytest.raises(InvalidRequestError, match=r"peers.txt:2: 'not-a-peer'"):
        parse_allowed_peers(f"{PEER}\nnot-a-peer\n", source="peers.txt")
    with pytest.raises(InvalidRequestError, match="refuse everyone"):
        parse_allowed_peers("# nobody yet\n")


@pytest.mark.integration
def test_server_serves_only_members(tiny_llama_path, tmp_path):
    member = SwarmIdentity.load_or_create(str(tmp_path / "member.id"))
    allowed = tmp_path / "allowed.txt"
    allowed.write_text(f"# the only member\n{member.peer_id}\n")
    config = load_config(tiny_llama_path)
    # server 0 serves members only, server 1 everyone (an open swarm with one members-only server)
    with LocalSwarm(
        str(tiny_llama_path),
        [(0, 6), (0, 6)],
        server_args=["--num-threads", "1"],
        per_server_args=[["--allowed-peers", str(allowed)], []],
    ) as swarm:
        server_id, open_id = swarm.servers[0].peer_id, swarm.servers[1].peer_id
        # an outsider gets NotAllowedError for the stream and for rpc_info, and nothing else
        outsider = RemoteChain(str(tiny_llama_path), config, swarm.initial_peers, use_orchestrator=False)
        try:
            stream = RawStream(outsider, server_id)
            err = stream.expect_error({"type": "open", "session_id": "x", "max_length": 16, "start": 0, "end": 6})
            assert isinstance(err, NotAllowedError) and "allowed-peers" in str(err)
            stream.close()
            assert outsider.ping_s(server_id) is not None  # answered (with the refusal), not dropped
            for tokens in (3, MAX_PART_BYTES // (4 * config.hidden_size) + 1):  # rpc_forward, rpc_forward_stream
                with pytest.raises(NotAllowedError):
                    outsider.loop.run(
                        outsider.hops.forward_async(Hop(server_id, 0, 6), torch.zeros(1, tokens, config.hidden_size)),
                        timeout_s=30,
                    )
        finally:
            outsider.shutdown()
        # the member generates as usual
        model = DistributedModelForCausalLM.from_pretrained(
            str(tiny_llama_path), initial_peers=swarm.initial_peers, identity_path=member.path, use_orchestrator=False
        )
        try:
            out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False)
            assert out.shape == (1, 7)
        finally:
            model.backend.shutdown()
        # a client that allows other servers only ignores this one's record
        picky = DistributedModelForCausalLM.from_pretrained(
            str(tiny_llama_path),
            initial_peers=swarm.initial_peers,
            identity_path=member.path,
            use_orchestrator=False,
            allowed_servers=[PEER],
            wait_for_chain_s=2.0,
        )
        try:
            with pytest.raises(NoChainError):
                picky.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False)
        finally:
            picky.backend.shutdown()
        # an outsider offered the members-only server first is refused there and uses the open one
        outsider_model = DistributedModelForCausalLM.from_pretrained(
            str(tiny_llama_path), initial_peers=swarm.initial_peers, use_orchestrator=False
        )
        try:
            outsider_model.backend.provider = ListedChains([server_id, open_id], config.num_hidden_layers)
            with outsider_model.inference_session(max_length=16) as session:
                out_outsider = outsider_model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False)
                assert [h.peer_id for h in session.chain.hops] == [open_id]
                assert session.chain.failed_peers == {server_id}
            assert out_outsider.tolist() == out.tolist()
        finally:
            outsider_model.backend.shutdown()
