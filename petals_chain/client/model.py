"""`DistributedModelForCausalLM`: a causal LM whose transformer blocks run elsewhere.

The client holds embeddings, final norm and LM head; every forward relays hidden states through a
chain session (remote servers or local block ranges). `generate` is transformers' own
GenerationMixin: greedy, sampling, repetition penalty, eos, streamers all work unchanged, because
the model feeds the chain only the tokens it has not processed yet and never uses HF's KV cache.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from petals_chain.client.chain import ChainBackend, ChainSession, LocalChain, PromptPrefix
from petals_chain.errors import InvalidRequestError
from petals_chain.models.checkpoint import resolve_model_path
from petals_chain.runtime.block_range import BlockRange
from petals_chain.runtime.client_head import ClientHead

DEFAULT_MAX_LENGTH = 2048


class InferenceSession:
    """A multi-turn session: tokens stay cached on the chain between `generate` calls."""

    def __init__(self, chain_session: ChainSession, max_length: int):
        self.chain = chain_session
        self.max_length = max_length
        self.token_ids: list[int] = []  # every token of the conversation, processed or not yet
        self.closed = False

    @property
    def position(self) -> int:
        return self.chain.position

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.chain.close()

    def __enter__(self) -> "InferenceSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class DistributedModelForCausalLM(PreTrainedModel, GenerationMixin):
    main_input_name = "input_ids"
    _supports_cache_class = False

    def __init__(self, config, head: ClientHead, backend: ChainBackend):
        config.use_cache = False  # the chain keeps the KV cache, not transformers
        super().__init__(config)
        self.head = head
        self.backend = backend
        # The active session is per thread: concurrent `generate` calls on one model object (the
        # README promises threads work; the API gateway runs one request per thread) each run
        # their own session instead of stepping on one another's.
        self._local = threading.local()

    @property
    def _session(self) -> InferenceSession | None:
        return getattr(self._local, "session", None)

    @_session.setter
    def _session(self, session: InferenceSession | None) -> None:
        self._local.session = session

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_local_ranges(cls, model: str | Path, ranges: list[tuple[int, int]], *, dtype: str = "float32",
                          quant: str = "none", device: str = "cpu",
                          cuda_graphs: bool = True) -> "DistributedModelForCausalLM":
        """All block ranges in this process: pipelined generation without a network. `device`: where
        the block ranges and the client head run (e.g. "cuda")."""
        path = resolve_model_path(model)
        head = ClientHead(path, dtype=dtype, model_path=path, device=device)
        block_ranges = [BlockRange(path, s, e, dtype=dtype, quant=quant, config=head.config, model_path=path,
                                   device=device, cuda_graphs=cuda_graphs)
                        for s, e in ranges]
        return cls(head.config, head, LocalChain(block_ranges))

    @classmethod
    def from_pretrained(cls, model: str | Path, *, initial_peers: list[str], dtype: str = "float32",
                        max_batch_rows: int = 4096, device: str = "cpu", **remote_kwargs) -> "DistributedModelForCausalLM":
        """Client of a swarm: `initial_peers` are multiaddrs of DHT peers (e.g. printed by `petals-chain dht`).
        `max_batch_rows` bounds the client head's cross-session batches (1 turns batching off).
        `device`: where the client head (embeddings, final norm, LM head) runs; hidden states leave it
        only at the wire, and logits come back on the device of the `input_ids` given."""
        from petals_chain.client.remote import RemoteChain

        path = resolve_model_path(model)
        head = ClientHead(path, dtype=dtype, model_path=path, max_batch_rows=max_batch_rows, device=device)
        backend = RemoteChain(model=str(model), config=head.config, initial_peers=initial_peers, dtype=head.dtype,
                              **remote_kwargs)
        return cls(head.config, head, backend)

    def get_input_embeddings(self):
        return self.head.embed

    def get_output_embeddings(self):
        return self.head.lm_head

    # -- sessions ----------------------------------------------------------------------------
    @contextmanager
    def inference_session(self, max_length: int = DEFAULT_MAX_LENGTH, *, prompt_ids: torch.Tensor | None = None,
                          session_id: str | None = None):
        """`with model.inference_session(max_length=...) as s:` keeps the conversation cached on the chain;
        every `generate` inside continues it (pass only the new tokens). `prompt_ids` [n]: the first
        prompt, offered to the servers' prefix caches (the session then starts past the reused part).
        `session_id`: what the orchestrator and servers call the session (default: a random id)."""
        if self._session is not None:
            raise InvalidRequestError("an inference session is already active on this model; close it first")
        prefix = None
        if prompt_ids is not None:
            prefix = PromptPrefix(prompt_ids.tolist(), self.head.embed_batched(prompt_ids))
        session = InferenceSession(self.backend.open_session(max_length, prefix, session_id=session_id), max_length)
        self._session = session
        try:
            yield session
        finally:
            self._session = None
            session.close()

    def generate(self, input_ids: torch.Tensor | None = None, *, max_length: int | None = None, **kwargs):
        """transformers' generate, run through the chain. Batch size 1 (one session per sequence)."""
        if input_ids is None or input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise InvalidRequestError("generate takes input_ids of shape [1, n]: one sequence per session "
                                      "(run several sessions, e.g. in threads, for several sequences)")
        if kwargs.get("attention_mask") is not None and not bool(kwargs["attention_mask"].all()):
            raise InvalidRequestError("padding is not supported: pass one unpadded sequence")
        kwargs.pop("attention_mask", None)
        if self._session is not None:
            full = torch.tensor([self._session.token_ids + input_ids[0].tolist()], dtype=torch.long)
            return self._generate_in(self._session, full, **kwargs)
        budget = max_length or (input_ids.shape[1] + int(kwargs.get("max_new_tokens") or 0)) or DEFAULT_MAX_LENGTH
        # the prompt goes with the open: hops that hold its prefix skip it (generate keeps only the
        # last position's logits, so the skipped positions' logits are never needed)
        with self.inference_session(max_length=budget, prompt_ids=input_ids[0]) as session:
            return self._generate_in(session, input_ids, **kwargs)

    def _generate_in(self, session: InferenceSession, full_ids: torch.Tensor, **kwargs):
        self._session = session
        kwargs.setdefault("pad_token_id", self.config.pad_token_id if self.config.pad_token_id is not None
                          else self.config.eos_token_id)
        out = super().generate(full_ids, attention_mask=torch.ones_like(full_ids), **kwargs)
        session.token_ids = out[0].tolist()
        return out

    def prepare_inputs_for_generation(self, input_ids, logits_to_keep: int = 0, **kwargs):
        return {"input_ids": input_ids, "logits_to_keep": logits_to_keep}

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, logits_to_keep: int = 0,
                **kwargs) -> CausalLMOutputWithPast:
        """Feed the chain the tokens it has not seen yet and return logits [1, n, vocab] for the last
        `logits_to_keep` of them (0: all new positions). transformers' generate passes 1, so a
        700-token prefill runs the LM head on one position, not 700."""
        session = self._session
        if session is None:
            with self.inference_session(max_length=input_ids.shape[1]) as s:
                return self._forward_in(s, input_ids, logits_to_keep)
        return self._forward_in(session, input_ids, logits_to_keep)

    def _forward_in(self, session: InferenceSession, input_ids: torch.Tensor,
                    logits_to_keep: int = 0) -> CausalLMOutputWithPast:
        done = session.position
        new = input_ids[0, done:]
        if new.numel() == 0:
            raise InvalidRequestError("no new tokens to process: the session already holds this whole sequence")
        if done + new.numel() > session.max_length:
            raise InvalidRequestError(f"the session was opened with max_length={session.max_length} but would hold "
                                      f"{done + new.numel()} tokens; open it with a larger max_length")
        hidden = session.chain.step(self.head.embed_batched(new))
        if logits_to_keep > 0:
            hidden = hidden[-logits_to_keep:]
        # on the ids' device: transformers' logits processors index the logits with the ids
        logits = self.head.logits_batched(hidden).float().to(input_ids.device)
        return CausalLMOutputWithPast(logits=logits.unsqueeze(0))


# PETALS' name for the same class, so `from petals_chain import AutoDistributedModelForCausalLM` reads as in PETALS.
AutoDistributedModelForCausalLM = DistributedModelForCausalLM
