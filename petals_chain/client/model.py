"""`DistributedModelForCausalLM`: a causal LM whose transformer blocks run elsewhere.

The client holds embeddings, final norm and LM head; every forward relays hidden states through a
chain session (remote servers or local block ranges). `generate` is transformers' own
GenerationMixin: greedy, sampling, repetition penalty, eos, streamers all work unchanged, because
the model feeds the chain only the tokens it has not processed yet and never uses HF's KV cache.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import GenerationMixin, PreTrainedModel
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator
from transformers.modeling_outputs import CausalLMOutputWithPast

from petals_chain.client.chain import (
    ChainBackend,
    ChainSession,
    LocalChain,
    PromptPrefix,
)
from petals_chain.client.speculation import (
    SCHEDULES,
    AdaptivePromptLookup,
    StepCostModel,
)
from petals_chain.errors import InvalidRequestError, VerificationRollback
from petals_chain.models.checkpoint import resolve_model_path
from petals_chain.runtime.block_range import BlockRange
from petals_chain.runtime.client_head import ClientHead

DEFAULT_MAX_LENGTH = 2048
# a generate that met more spot-check catches than this gives up (each costs a rollback and a failover)
MAX_VERIFICATION_RESTARTS = 8


@dataclass(frozen=True)
class GenerateStats:
    """One `generate` call: `tokens` generated in `chain_steps` chain steps. Every step yields its
    accepted drafts plus one token of the model's own, so `accepted_draft_tokens = tokens - chain_steps`
    (0 without speculation)."""

    tokens: int
    chain_steps: int
    drafted_tokens: int

    @property
    def accepted_draft_tokens(self) -> int:
        return self.tokens - self.chain_steps

    def to_json(self) -> dict[str, int]:
        return {
            "tokens": self.tokens,
            "chain_steps": self.chain_steps,
            "accepted_draft_tokens": self.accepted_draft_tokens,
            "drafted_tokens": self.drafted_tokens,
        }


class InferenceSession:
    """A multi-turn session: tokens stay cached on the chain between `generate` calls."""

    def __init__(self, chain_session: ChainSession, max_length: int, processed_ids: list[int] | None = None):
        self.chain = chain_session
        self.max_length = max_length
        # every token of the conversation, processed or not yet; the next `generate` continues it. Assign
        # a shorter or edited list to regenerate or edit the last turn: the chain keeps the shared prefix
        self.token_ids: list[int] = []
        # the tokens the chain holds, in order (len == chain.position): a forward whose ids share only
        # a prefix with them rolls the chain back to that prefix (rejected drafts, an edited turn)
        self.processed_ids: list[int] = list(processed_ids or [])
        self.chain_steps = 0  # forwards through the chain (each one step of every hop)
        self.drafted_tokens = 0  # draft tokens sent for verification (speculative decoding)
        # measured seconds of this session's chain steps by size: what adaptive draft lengths weigh
        self.step_costs = StepCostModel()
        self.last_generate: GenerateStats | None = None  # of the latest `generate` in this session
        self.verification_restarts = 0  # rollbacks after a spot check caught a server (client/verification.py)
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

    def __init__(self, config, head: ClientHead, backend: ChainBackend, active_adapter: str | None = None):
        config.use_cache = False  # the chain keeps the KV cache, not transformers
        super().__init__(config)
        self.head = head
        self.backend = backend
        # the LoRA adapter sessions run with unless `inference_session(adapter=...)` says otherwise
        self.active_adapter = active_adapter
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
    def from_local_ranges(
        cls,
        model: str | Path,
        ranges: list[tuple[int, int]],
        *,
        dtype: str = "float32",
        quant: str = "none",
        device: str = "cpu",
        cuda_graphs: bool = True,
        adapters: list[str | Path] = (),
        active_adapter: str | None = None,
    ) -> "DistributedModelForCausalLM":
        """All block ranges in this process: pipelined generation without a network. `device`: where
        the block ranges and the client head run (e.g. "cuda"). `adapters`: PEFT LoRA folders every
        range loads; `active_adapter`: the one sessions use by default."""
        path = resolve_model_path(model)
        head = ClientHead(path, dtype=dtype, model_path=path, device=device)
        num_blocks = head.config.num_hidden_layers
        if not ranges or ranges[-1][1] != num_blocks or any(not 0 <= s < e <= num_blocks for s, e in ranges):
            raise InvalidRequestError(
                f"block ranges {ranges} do not tile the model's blocks [0, {num_blocks}): "
                f"e.g. [(0, {num_blocks // 2}), ({num_blocks // 2}, {num_blocks})]"
            )
        block_ranges = [
            BlockRange(
                path,
                s,
                e,
                dtype=dtype,
                quant=quant,
                config=head.config,
                model_path=path,
                device=device,
                cuda_graphs=cuda_graphs,
                adapters=adapters,
            )
            for s, e in ranges
        ]
        return cls(head.config, head, LocalChain(block_ranges), active_adapter)

    @classmethod
    def from_pretrained(
        cls,
        model: str | Path,
        *,
        initial_peers: list[str],
        dtype: str = "float32",
        max_batch_rows: int = 4096,
        device: str = "cpu",
        active_adapter: str | None = None,
        **remote_kwargs,
    ) -> "DistributedModelForCausalLM":
        """Client of a swarm: `initial_peers` are multiaddrs of DHT peers (e.g. printed by `petals-chain dht`).
        `max_batch_rows` bounds the client head's cross-session batches (1 turns batching off).
        `device`: where the client head (embeddings, final norm, LM head) runs; hidden states leave it
        only at the wire, and logits come back on the device of the `input_ids` given.
        `active_adapter`: the LoRA adapter (as servers name it: its folder name) sessions run with;
        only chains whose every server serves it are used."""
        from petals_chain.client.remote import RemoteChain

        path = resolve_model_path(model)
        head = ClientHead(path, dtype=dtype, model_path=path, max_batch_rows=max_batch_rows, device=device)
        backend = RemoteChain(
            model=str(model), config=head.config, initial_peers=initial_peers, dtype=head.dtype, **remote_kwargs
        )
        return cls(head.config, head, backend, active_adapter)

    def get_input_embeddings(self):
        return self.head.embed

    def get_output_embeddings(self):
        return self.head.lm_head

    # -- sessions ----------------------------------------------------------------------------
    @contextmanager
    def inference_session(
        self,
        max_length: int = DEFAULT_MAX_LENGTH,
        *,
        prompt_ids: torch.Tensor | None = None,
        adapter: str | None = None,
        session_id: str | None = None,
        check_probability: float | None = None,
    ):
        """`with model.inference_session(max_length=...) as s:` keeps the conversation cached on the chain;
        every `generate` inside continues it (pass only the new tokens). `prompt_ids` [n]: the first
        prompt, offered to the servers' prefix caches (the session then starts past the reused part).
        `adapter`: this session's LoRA adapter (default: the model's `active_adapter`).
        `session_id`: what the orchestrator and servers call the session (default: a random id).
        `check_probability`: this session's chance per step of a spot check of its servers
        (client/verification.py; default: the model's `verification` config)."""
        if self._session is not None:
            raise InvalidRequestError("an inference session is already active on this model; close it first")
        if check_probability is not None and not 0.0 <= check_probability <= 1.0:
            raise InvalidRequestError(f"check_probability must be in [0, 1], got {check_probability}")
        prefix = None
        if prompt_ids is not None and not check_probability:  # an audit cannot cover a prefix a cache supplied
            prefix = PromptPrefix(prompt_ids.tolist(), self.head.embed_batched(prompt_ids))
        adapter = adapter if adapter is not None else self.active_adapter
        chain = self.backend.open_session(max_length, prefix, adapter, session_id=session_id)
        if check_probability is not None and chain.verifier is not None:
            chain.verifier.check_probability = check_probability
        # a reused prompt prefix is already on the chain
        reused = prompt_ids[: chain.position].tolist() if prompt_ids is not None else []
        session = InferenceSession(chain, max_length, reused)
        self._session = session
        try:
            yield session
        finally:
            self._session = None
            session.close()

    def generate(self, input_ids: torch.Tensor | None = None, *, max_length: int | None = None, **kwargs):
        """transformers' generate, run through the chain. Batch size 1 (one session per sequence).
        Speculative decoding is HF's own: `prompt_lookup_num_tokens=k` or `assistant_model=draft`; each
        round verifies every drafted token in one chain step and the chain rolls back the rejected ones.
        `prompt_lookup_schedule`: "adaptive" (default) sends 0..k of each prompt-lookup draft, the
        count that maximises expected tokens per second of measured chain time (a round with no match,
        or whose draft is not worth a longer step, is one plain 1-token step; client/speculation.py);
        "constant": every draft as HF's lookup makes it (up to k tokens).
        `check_probability`: the chance per step that the servers' work is spot-checked (a session opened
        here; client/verification.py); a catch rolls the session back and generates again from the last
        trusted token, so the output is what honest servers give."""
        if input_ids is None or input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise InvalidRequestError(
                "generate takes input_ids of shape [1, n]: one sequence per session "
                "(run several sessions, e.g. in threads, for several sequences)"
            )
        if kwargs.get("attention_mask") is not None and not bool(kwargs["attention_mask"].all()):
            raise InvalidRequestError("padding is not supported: pass one unpadded sequence")
        kwargs.pop("attention_mask", None)
        check_probability = kwargs.pop("check_probability", None)
        if self._session is not None:
            if check_probability is not None and self._session.chain.verifier is not None:
                self._session.chain.verifier.check_probability = check_probability
            full = torch.tensor([self._session.token_ids + input_ids[0].tolist()], dtype=torch.long)
            return self._generate_in(self._session, full, **kwargs)
        if max_length is not None:
            kwargs["max_length"] = max_length  # transformers' meaning: prompt + new tokens
        budget = self._session_length(input_ids.shape[1], kwargs)
        if max_length is not None:
            # an explicit max_length also reserves that much KV, even when max_new_tokens ends the
            # generation sooner (scripts/overload.py reserves whole slots this way)
            budget = max(budget, int(max_length))
        # HF's prompt lookup may draft past max_length (its cut is on the index it copies from): the
        # verification step then holds up to k more tokens than the output
        budget += int(kwargs.get("prompt_lookup_num_tokens") or 0)
        # the prompt goes with the open: hops that hold its prefix skip it (generate keeps only the
        # last position's logits, so the skipped positions' logits are never needed)
        with self.inference_session(
            max_length=budget, prompt_ids=input_ids[0], check_probability=check_probability
        ) as session:
            return self._generate_in(session, input_ids, **kwargs)

    def _session_length(self, prompt_tokens: int, kwargs: dict) -> int:
        """The most tokens transformers' generate will hold with these arguments, resolved as it does
        (transformers 5, `GenerationMixin._prepare_generated_length`): `max_new_tokens` (argument, else
        the generation configs') means prompt + that; else a `max_length` someone set is the total (a
        prompt already that long makes HF refuse, so one token more is enough); else HF's global default
        `max_length` (20) counts *new* tokens, capped by the model's positions. The KV is sized for it."""
        configs = [c for c in (kwargs.get("generation_config"), self.generation_config) if c is not None]
        max_new = kwargs.get("max_new_tokens")
        for config in configs:
            max_new = max_new if max_new is not None else getattr(config, "max_new_tokens", None)
        if max_new is not None:
            return prompt_tokens + int(max_new)
        max_length = kwargs.get("max_length")
        for config in configs:
            max_length = max_length if max_length is not None else getattr(config, "max_length", None)
        if max_length is not None:
            return max(int(max_length), prompt_tokens + 1)
        default_new = int(self.generation_config._get_default_generation_params()["max_length"])
        positions = getattr(self.config, "max_position_embeddings", None)
        return prompt_tokens + default_new if positions is None else min(prompt_tokens + default_new, positions)

    def _generate_in(
        self, session: InferenceSession, full_ids: torch.Tensor, *, prompt_lookup_schedule: str = "adaptive", **kwargs
    ):
        if prompt_lookup_schedule not in SCHEDULES:
            raise InvalidRequestError(f"prompt_lookup_schedule={prompt_lookup_schedule!r}: use one of {SCHEDULES}")
        self._session = session
        # read by `_get_candidate_generator`, which HF calls deep inside `generate`
        self._local.prompt_lookup_schedule = prompt_lookup_schedule
        kwargs.setdefault(
            "pad_token_id",
            self.config.pad_token_id if self.config.pad_token_id is not None else self.config.eos_token_id,
        )
        if kwargs.get("prompt_lookup_num_tokens") or kwargs.get("assistant_model") is not None:
            # HF's assisted decoding insists on a cache it can crop: it gets an empty DynamicCache that
            # only passes through `forward`; the chain holds the real KV and drops rejected drafts by
            # itself, seeing that the next ids share only a prefix with what it processed
            kwargs["use_cache"] = True
        steps, drafted = session.chain_steps, session.drafted_tokens
        out = self._generate_verified(session, full_ids, kwargs)
        session.token_ids = out[0].tolist()
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        session.last_generate = GenerateStats(
            sequences.shape[1] - full_ids.shape[1], session.chain_steps - steps, session.drafted_tokens - drafted
        )
        return out

    def _generate_verified(self, session: InferenceSession, full_ids: torch.Tensor, kwargs: dict):
        """HF's generate, started again from the last trusted token whenever a spot check caught a server
        (`VerificationRollback`: client/verification.py): the chain rolls back there (KV rollback), the
        step through the caught server fails over, and the tokens generated from its wrong hidden states
        are generated again, so the output is what honest servers give. A streamer sees the prompt and
        the trusted tokens again after a restart."""
        prompt_tokens = full_ids.shape[1]
        target_tokens = self._session_length(prompt_tokens, kwargs)  # prompt + new tokens, as HF resolves it
        ids, call_kwargs = full_ids, kwargs
        while True:
            out = None
            try:
                out = super().generate(ids, attention_mask=torch.ones_like(ids), **call_kwargs)
                if session.chain.verifier is not None:
                    session.chain.verifier.settle()  # audits still running may yet find a wrong row
                return out
            except VerificationRollback as rollback:
                session.verification_restarts += 1
                if session.verification_restarts > MAX_VERIFICATION_RESTARTS:
                    raise
                q = rollback.trusted_position
                sequences = None if out is None else (out if isinstance(out, torch.Tensor) else out.sequences)
                # the ids HF had: all of them after generate returned, else those the chain held before the step
                source = sequences[0].tolist() if sequences is not None else list(session.processed_ids)
                # tokens [0, q] are trusted (token q came from row q - 1's output); the prompt always is
                kept = full_ids[0].tolist() if q + 1 <= prompt_tokens else source[: q + 1]
                session.processed_ids = kept[: min(q, len(kept) - 1)]  # the next step recomputes from row q
                left = target_tokens - len(kept)
                if left <= 0:
                    return torch.tensor([kept], dtype=torch.long)
                ids = torch.tensor([kept], dtype=torch.long)
                call_kwargs = {k: v for k, v in kwargs.items() if k != "max_length"}
                call_kwargs["max_new_tokens"] = left

    def _get_candidate_generator(self, generation_config, *args, **kwargs):
        """HF's candidate generator; HF's prompt lookup is wrapped to choose its draft length per round
        (client/speculation.py) unless the schedule is "constant"."""
        generator = super()._get_candidate_generator(generation_config, *args, **kwargs)
        session = self._session
        if (
            isinstance(generator, PromptLookupCandidateGenerator)
            and session is not None
            and getattr(self._local, "prompt_lookup_schedule", "adaptive") == "adaptive"
        ):
            return AdaptivePromptLookup(generator, generation_config.prompt_lookup_num_tokens, session.step_costs)
        return generator

    def prepare_inputs_for_generation(self, input_ids, logits_to_keep: int = 0, past_key_values=None, **kwargs):
        return {"input_ids": input_ids, "logits_to_keep": logits_to_keep, "past_key_values": past_key_values}

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        past_key_values=None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Feed the chain the tokens it has not seen yet and return logits [1, n, vocab] for the last
        `logits_to_keep` of them (0: all new positions). transformers' generate passes 1, so a
        700-token prefill runs the LM head on one position, not 700."""
        session = self._session
        if session is None:
            with self.inference_session(max_length=input_ids.shape[1]) as s:
                out = self._forward_in(s, input_ids, logits_to_keep)
        else:
            out = self._forward_in(session, input_ids, logits_to_keep)
        out.past_key_values = past_key_values  # HF's placeholder cache (assisted decoding), untouched
        return out

    def _forward_in(
        self, session: InferenceSession, input_ids: torch.Tensor, logits_to_keep: int = 0
    ) -> CausalLMOutputWithPast:
        ids = input_ids[0].tolist()
        # Run from where `ids` leave what the chain holds (rolling it back when they differ), and at
        # least the positions whose logits are asked for: a sequence the chain already holds whole
        # (a regenerated turn) recomputes its last token, which costs one token, not the prompt.
        start = min(
            _common_prefix_tokens(ids, session.processed_ids), session.position, len(ids) - max(1, logits_to_keep)
        )
        if start < 0:
            raise InvalidRequestError(
                f"logits_to_keep={logits_to_keep} asks for more positions than the {len(ids)} input tokens"
            )
        if len(ids) > session.max_length:
            raise InvalidRequestError(
                f"the session was opened with max_length={session.max_length} but would hold "
                f"{len(ids)} tokens; open it with a larger max_length (speculative decoding "
                "verifies up to k drafted tokens past the output: add k)"
            )
        new = input_ids[0, start:]
        session.processed_ids = ids[:start]  # what the chain holds should this step fail
        started_s = time.perf_counter()
        embedded = self.head.embed_batched(new)
        with self.head.logits_batched.expecting():  # the LM head's batch may wait for this reply
            hidden = session.chain.step(embedded, start_position=start)
        if len(new) <= max(1, logits_to_keep):
            # a decode or verification step (every new position's logits are asked for); not the
            # prompt's step, whose cost is another regime: a 40-token chat prompt fitted into the
            # multi-token line tilted it, whatever the drafts' steps cost
            session.step_costs.observe(len(new), time.perf_counter() - started_s)
        session.processed_ids = ids
        session.chain_steps += 1
        session.drafted_tokens += max(0, logits_to_keep - 1)  # assisted decoding keeps one logit per draft + 1
        if logits_to_keep > 0:
            hidden = hidden[-logits_to_keep:]
        # on the ids' device (transformers' logits processors index the logits with the ids); HF's
        # assisted decoding edits them in place, which the head's logits (no inference-mode tensors)
        # allow without a copy: a session's rows are its own, though they may share a batch's storage
        logits = self.head.logits_batched(hidden, expected=True).to(input_ids.device, torch.float32)
        return CausalLMOutputWithPast(logits=logits.unsqueeze(0))


def _common_prefix_tokens(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


# PETALS' name for the same class, so `from petals_chain import AutoDistributedModelForCausalLM` reads as in PETALS.
AutoDistributedModelForCausalLM = DistributedModelForCausalLM
