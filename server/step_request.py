"""`StepRequest`: one step of one session (or one row of a stateless forward) on its way from the
handler to the scheduler and back, validated once.

It is the block range's own `StepInput` (KV and new hidden states) with what the scheduler needs
besides: whose step it is (`key`, the session's reservation key; `client_id`, the caller's peer
id) and how much of its session's prompt came from the prefix cache (DLPM's locality). The handler
makes it with `checked`, the one place a step's tensor is checked against the range (shape, float
dtype of the range, KV of this range, within the session's max_length from where it will start),
before anything of the session changes; the scheduler queues it as it is, hands it to the block
range as it is when a batch takes all its rows (marked validated, so `forward` does not check it
again), and delivers its output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from petals_chain.errors import InvalidRequestError
from petals_chain.runtime.block_range import StepInput
from petals_chain.runtime.kv_cache import SessionKV


@dataclass(eq=False, kw_only=True)
class StepRequest(StepInput):
    key: str  # the session's key on this server (unique per stream): the scheduler's session id
    client_id: str  # the caller's libp2p peer id, authenticated by the transport
    prefix_tokens: int = 0  # tokens of its session's prompt taken from the prefix cache

    @property
    def n_tokens(self) -> int:
        return self.hidden.shape[0]

    @classmethod
    def checked(
        cls,
        block_range,
        kv: SessionKV,
        hidden: torch.Tensor,
        *,
        key: str,
        client_id: str,
        start_tokens: int,
        prefix_tokens: int = 0,
    ) -> StepRequest:
        """The step, refused with a typed error unless `block_range` can run it on `kv` starting at
        `start_tokens`. Not for NaN/Inf: every tensor a server runs was decoded with `finite=True`
        (its streams, pushes and forwards), where the check costs a fraction of a torch reduction."""
        request = cls(kv, hidden, key=key, client_id=client_id, prefix_tokens=prefix_tokens)
        block_range.validate_step(request, check_finite=False, past_tokens=start_tokens)
        if hidden.dtype != block_range.dtype:
            raise InvalidRequestError(f"hidden states must be {block_range.dtype}, got {hidden.dtype}")
        request.validated = True  # once: the batch does not check it again
        return request
