"""petals-chain: pipeline-parallel LLM serving over a hivemind swarm.

`from petals_chain import DistributedModelForCausalLM` is the client (PETALS users know it as
`from petals import AutoDistributedModelForCausalLM`). The names are resolved on first use
(PEP 562), so `import petals_chain` and the `petals-chain` CLI do not pull in torch and
transformers until they are needed.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "DistributedModelForCausalLM": "petals_chain.client.model",
    "AutoDistributedModelForCausalLM": "petals_chain.client.model",
    "InferenceSession": "petals_chain.client.model",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'petals_chain' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
