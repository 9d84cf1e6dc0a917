"""`StepRequest`: one step of one session (or one row of a stateless forward) on its way from the
handler to the scheduler and back, validated once.

It is the block range's own `StepInput` (KV and new hidden states) with what the scheduler needs
besides: whose step it is (`key`, the session's reservation key; `client_id`, the caller's peer
id) and how much of its session's prompt came from the prefix cache (DLPM's locality). The handler
makes it with `checked`, the one place a step's tensor is checked against the range (shape, a float
dtype, cast to the range's when it is another, KV of this range, within the session's max_length from
where it will start), before anything of the session changes; the scheduler queues it as it is, hands it to the block
range as it is when a batch takes all its rows (marked validated, so `forward` does not check it
again), and delivers its output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from petals_chain.errors import InvalidRequestError
from petals_chain.runtime.block_range import StepInput
from petals_chain.runtime.kv_cache import SessionKV

# the dtypes a step's hidden states may arrive in from a client or the previous hop of a mixed-dtype chain
WIRE_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})


@dataclass(eq=False, kw_only=True)
class StepRequest(StepInput):
    key: str  # the session's key on this server (unique per stream): the scheduler's session id
    client_id: str  # the caller's libp2p peer id, authenticated by the transport
    prefix_tokens: int = 0  # tokens of its session's prompt taken from the prefix cache
    # the float dtype the sender used when it is not the range's (a mixed-dtype chain: a float32 session
    # through a bfloat16 server): the step ran cast to the range's dtype and its output goes back in this
    # one, so the next hop and the client see the dtype they sent (None: the range's own)
    wire_dtype: torch.dtype | None = None

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
            if hidden.dtype not in WIRE_DTYPES:
                raise InvalidRequestError(
                    f"hidden states must be one of {sorted(str(d) for d in WIRE_DTYPES)} (this server computes "
                    f"in {block_range.dtype}), got {hidden.dtype}"
                )
            request.hidden, request.wire_dtype = hidden.to(block_range.dtype), hidden.dtype
            # bfloat16 has float32's range, float16 does not: a value over 65504 would become Inf here
            if block_range.dtype == torch.float16 and not math.isfinite(request.hidden.sum(dtype=torch.float64).item()):
                raise InvalidRequestError(
                    f"hidden states in {hidden.dtype} overflow this server's float16; route this session "
                    "through servers of its own dtype"
                )
        request.validated = True  # once: the batch does not check it again
        return request
