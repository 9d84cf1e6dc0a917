"""Prefix keys: chained hashes of a prompt's token ids, chunk by chunk (client and server agree on them).

The prompt is cut into chunks of `PREFIX_CHUNK_TOKENS` ids; hash i = blake2b(hash i-1 || ids of
chunk i), seeded with the model name and the session's dtype, so one hash names the whole prefix up to
its chunk and two prompts share hash i exactly when they share their first (i+1) chunks. Only full
chunks are hashed. A server stores the KV of its blocks under these hashes (`server/prefix_cache.py`);
it never sees the ids themselves.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from petals_chain.errors import InvalidRequestError

PREFIX_CHUNK_TOKENS = 16  # tokens per chunk; a hit is a multiple of it
MAX_PREFIX_HASHES = 4096  # bounds an open message: 4096 chunks of 16 tokens = 64k tokens
HASH_CHARS = 32  # a hash is 32 hex characters (128 bits of blake2b)


def prefix_hashes(
    token_ids: Sequence[int], model: str, chunk_tokens: int = PREFIX_CHUNK_TOKENS, *, dtype: str = "float32"
) -> list[str]:
    """Chained hashes (32 hex characters each) of the full chunks of `token_ids`. `dtype`, the session's,
    is in the seed: a server of another dtype casts such a session's hidden states, so their KV differs
    from its own dtype's sessions' by the rounding, and the two never share a cached prefix."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    seed = f"petals-chain prefix v2|{model}|{dtype}|{chunk_tokens}"
    previous = hashlib.blake2b(seed.encode(), digest_size=16).digest()
    out = []
    for start in range(0, len(token_ids) - chunk_tokens + 1, chunk_tokens):
        h = hashlib.blake2b(previous, digest_size=16)
        h.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in token_ids[start : start + chunk_tokens]))
        previous = h.digest()
        out.append(h.hexdigest())
    return out


def usable_prefix_tokens(
    match_tokens: Sequence[int], prompt_tokens: int, chunk_tokens: int = PREFIX_CHUNK_TOKENS
) -> int:
    """Tokens a chain can take from its hops' caches: the smallest match over the hops (a chain
    reuses a prefix only as far as every hop holds it), in whole chunks, leaving at least one
    prompt token to compute (the last position's logits come from running it)."""
    if not match_tokens:
        return 0
    usable = min(min(match_tokens), prompt_tokens - 1)
    return max(0, usable - usable % chunk_tokens)


def check_prefix_hashes(hashes: object) -> list[str]:
    """An open message's `prefix_hashes`, validated: at most MAX_PREFIX_HASHES lowercase hex strings."""
    if not isinstance(hashes, (list, tuple)) or len(hashes) > MAX_PREFIX_HASHES:
        raise InvalidRequestError(f"prefix_hashes must be a list of at most {MAX_PREFIX_HASHES} hashes")
    for h in hashes:
        if not isinstance(h, str) or len(h) != HASH_CHARS or any(c not in "0123456789abcdef" for c in h):
            raise InvalidRequestError(
                f"each prefix hash must be {HASH_CHARS} lowercase hex characters "
                "(petals_chain.wire.prefix_keys.prefix_hashes computes them)"
            )
    return list(hashes)
