"""Reference runs shared by the exactness tests: HF with its own cache vs chained block ranges."""

from __future__ import annotations

import torch

from petals_chain.runtime.block_range import BlockRange, StepInput
from petals_chain.runtime.client_head import ClientHead


def chain_ranges(path, ranges, **kw):
    head = ClientHead(path, model_path=path, dtype=kw.get("dtype", "float32"))
    return head, [BlockRange(path, s, e, model_path=path, config=head.config, **kw) for s, e in ranges]


def run_chain(head, ranges, kvs, ids):
    x = head.embed_tokens(ids)
    for r, kv in zip(ranges, kvs):
        x = r.forward([StepInput(kv, x)])[0]
    return x


def hf_logits_per_step(hf, ids, steps):
    """Reference: HF with its own cache, prefill then `steps` greedy decode steps."""
    out = hf(ids.unsqueeze(0), use_cache=True)
    logits, past = [out.logits[0]], out.past_key_values
    tokens = [int(out.logits[0, -1].argmax())]
    for _ in range(steps):
        out = hf(torch.tensor([[tokens[-1]]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits.append(out.logits[0])
        tokens.append(int(out.logits[0, -1].argmax()))
    return logits, tokens


def chain_logits_per_step(head, ranges, ids, steps, max_length):
    """Ours: prefill then `steps` greedy decode steps through the chained ranges."""
    kvs = [r.allocate_kv(max_length) for r in ranges]
    logits = [head.logits(run_chain(head, ranges, kvs, ids))]
    tokens = [int(logits[0][-1].argmax())]
    for _ in range(steps):
        logits.append(head.logits(run_chain(head, ranges, kvs, torch.tensor([tokens[-1]]))))
        tokens.append(int(logits[-1][-1].argmax()))
    return logits, tokens
