"""One API request's generation: a session through the swarm, token by token, in a worker thread.

The decode loop is ours rather than transformers' `generate` because a gateway needs what that
does not give per request: a random generator of its own (`seed` must reproduce a request while
other requests sample concurrently, and `generate` draws from torch's global RNG), stop strings
checked on the decoded text, a cancel flag checked between steps (client disconnect), and every
token handed out as it comes. Sampling uses transformers' own logits warpers (temperature, top-k,
top-p);
greedy (temperature 0) is argmax, token for token what `generate(do_sample=False)` produces.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

from petals_chain.api.constrain import TextConstraint
from petals_chain.client.model import MAX_VERIFICATION_RESTARTS, DistributedModelForCausalLM
from petals_chain.client.speculation import AdaptivePromptLookup
from petals_chain.errors import InvalidRequestError, VerificationRollback

# pick_allowed's candidates per round after a rejected first pick: a softmax and a multinomial (or a sort)
# over the whole vocabulary cost about as much for 64 candidates as for one
REJECTION_DRAWS = 64


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # sample among the k likeliest tokens only (0: all)
    stop: tuple[str, ...] = ()
    seed: int | None = None
    prompt_lookup_tokens: int = 0  # speculative decoding by prompt lookup: up to K drafts per step (0: off)
    prompt_lookup_schedule: str = "adaptive"  # or "constant": K every round (client/speculation.py)
    top_logprobs: int | None = None  # None: no logprobs; k: each token's logprob and the k likeliest
    # the reply's text must follow this (a forced tool call); it ends when the text is complete
    constraint: TextConstraint | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability under the model (log_softmax of the LM head's logits,
    before temperature / top-p), and the `top` likeliest tokens at that position, best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class GenerationResult:
    text: str = ""
    completion_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)  # the generated tokens (a stop string's included)
    finish_reason: str = "length"  # "stop" (eos or a stop string), "length", "cancelled"
    time_to_first_token_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)  # when each token was produced (clock)
    logprobs: list[TokenLogprob] | None = None  # per generated token, when asked for
    chain: str = ""
    hops: int = 0  # servers in the chain the session ran on
    failovers: int = 0
    prefix_hit_tokens: int = 0  # prompt tokens every hop took from its prefix cache
    drafted_tokens: int = 0  # prompt lookup: draft tokens verified, and those accepted
    accepted_draft_tokens: int = 0
    verification_restarts: int = 0  # rollbacks after a spot check caught a server (client/verification.py)


class StopScanner:
    """Incremental detokenization with stop strings: `push(full_text)` returns the new text that is
    safe to send. It holds back a trailing replacement character (half of a multi-byte character)
    and any tail that could still grow into a stop string, and cuts the text at the first stop string."""

    def __init__(self, stop: tuple[str, ...]):
        self.stop = tuple(s for s in stop if s)
        self.sent = ""
        self.stopped = False

    def push(self, text: str, final: bool = False) -> str:
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            text, final, self.stopped = text[:cut], True, True
        hold = 0
        if not final:
            hold = 1 if text.endswith("\ufffd") else 0
            body = text[: len(text) - hold]
            hold += max(
                (
                    next((k for k in range(min(len(s) - 1, len(body)), 0, -1) if body.endswith(s[:k])), 0)
                    for s in self.stop
                ),
                default=0,
            )
        safe = max(len(text) - hold, len(self.sent))
        delta = text[len(self.sent) : safe]
        self.sent = text[:safe]
        return delta


class StreamTakenBackError(VerificationRollback):
    """A catch would take back text a stream already sent: the request fails (its client retries)."""


class ShownText:
    """What a request's `on_text` was given, so that a rollback after a spot check's catch
    (client/verification.py) takes back only what nobody saw. While the session's work may yet be
    found wrong soon (`SessionVerifier.holding`: a probation audit of one of its servers is running),
    a stream's text is held back, so a server that corrupts every step is caught before any of its
    text is shown. After a rollback the corrected text is given again from its start: the part
    already shown is matched and swallowed, and text that differs from what was shown raises
    `VerificationRollback` (a stream cannot take text back)."""

    def __init__(self, on_text: Callable[[str, list[TokenLogprob]], None], streamed: bool):
        self.on_text = on_text
        self.streamed = streamed
        self.text = ""  # given to on_text
        self.logprobs = 0  # entries given to on_text
        self._held_text = ""
        self._held: list[TokenLogprob] = []
        self._replay: str | None = None  # after a rollback: shown text the corrected one must match yet

    def give(self, delta: str, entries: list[TokenLogprob], hold: bool = False) -> None:
        self._held_text += delta
        self._held += entries
        if hold or not (self._held_text or self._held):
            return
        delta, entries = self._held_text, self._held
        self._held_text, self._held = "", []
        if self._replay is not None and self.streamed:
            n = min(len(delta), len(self._replay))
            if delta[:n] != self._replay[:n]:
                raise self.diverged()
            delta, self._replay = delta[n:], self._replay[n:] or None
        if delta or entries:
            self.text += delta
            self.logprobs += len(entries)
            self.on_text(delta, entries)

    def restart(self) -> None:
        """A rollback: what was held is dropped, the corrected text will come again from its start."""
        self._held_text, self._held = "", []
        self._replay = self.text or None

    def finish(self) -> None:
        if self._replay is not None and self.streamed:  # the corrected text ended before what was shown
            raise self.diverged()

    @staticmethod
    def diverged() -> StreamTakenBackError:
        return StreamTakenBackError(
            "a spot check caught a server returning wrong hidden states after part of this streamed reply was "
            "sent, and the corrected reply differs from what was sent, which a stream cannot take back; the "
            "server is banned now: retry the request"
        )


def run_generation(
    model: DistributedModelForCausalLM,
    tokenizer,
    prompt_ids: list[int],
    params: SamplingParams,
    *,
    cancel: threading.Event,
    on_text: Callable[[str, list[TokenLogprob]], None],
    session_id: str | None = None,
    clock: Callable[[], float] = time.perf_counter,
    adapter: str | None = None,
    streamed: bool = True,
) -> GenerationResult:
    """Generate for one request (blocking; run it in a worker thread). `on_text(delta, logprobs)`
    gets each piece of text as soon as it is safe to send, with the logprobs of the tokens
    generated since the previous call (empty unless `params.top_logprobs` is set). The session
    opens with the prompt, so hops whose prefix caches hold its start skip it (a chat's next turn
    resends the conversation); `session_id` (the request id in it) names the session in the
    orchestrator's and servers' logs. The session is closed (its chain released) on every way
    out, cancellation and errors included. `adapter`: the session's LoRA adapter.

    With spot checks on, a catch (`VerificationRollback`) rolls the session back to the last trusted
    token and decoding goes on from there, as `DistributedModelForCausalLM.generate` does, so greedy
    output is what honest servers give. `streamed`: `on_text`'s text is shown as it comes (see
    `ShownText`: held back during a probation audit; a rollback whose corrected text differs from
    text already shown fails the request); otherwise a rollback takes back text silently.

    With `params.constraint`, the text the constraint forces is fed without sampling (its tokens go
    through the chain with the next step, and their logprobs come from that step's logits), every
    sampled token is the best (greedy) or a sample (temperature) among the tokens that keep the text
    a valid prefix, and generation stops ("stop") when the text is complete."""
    start_s = clock()
    generator = torch.Generator().manual_seed(
        params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    )
    warpers = LogitsProcessorList()
    if params.temperature > 0:
        if params.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(params.temperature))
        if params.top_k > 0:  # HF's order in `generate`: temperature, top-k, top-p
            warpers.append(TopKLogitsWarper(params.top_k))
        if params.top_p < 1.0:
            warpers.append(TopPLogitsWarper(params.top_p))
    eos = _eos_ids(model, tokenizer)
    scanner = StopScanner(params.stop)
    result = GenerationResult()
    tokens = list(prompt_ids)
    generated: list[int] = []
    pending: list[TokenLogprob] = []  # logprobs not yet handed out with a text delta
    if params.top_logprobs is not None:
        result.logprobs = []
    constraint = params.constraint

    def pick(ids: list[int], logits: torch.Tensor, draws: int = 1) -> list[int]:
        """Greedy: the best token (`draws` > 1: the `draws` best, best first, ties by index as argmax breaks
        them); sampling: `draws` independent samples (with replacement) of the warped distribution."""
        if params.temperature > 0:
            scores = warpers(torch.tensor([ids], dtype=torch.long), logits)
            return torch.multinomial(torch.softmax(scores, dim=-1), draws, replacement=draws > 1, generator=generator)[
                0
            ].tolist()
        if draws == 1:
            return [int(logits.argmax(dim=-1)[0])]
        return torch.sort(logits[0], descending=True, stable=True).indices[:draws].tolist()

    def pick_allowed(ids: list[int], logits: torch.Tensor, reply: list[int]) -> int:
        """`pick` among the tokens that keep `reply`'s text a valid prefix: reject and mask picks until one
        fits (the best token usually does; masking then re-warping is masking before sampling). After a
        rejected first pick, candidates come REJECTION_DRAWS at a time (greedy: the next best in order;
        sampling: independent draws, whose first fitting one has the same distribution as drawing again
        after each rejection): a random model's forced call rejects hundreds of tokens per step, and each
        pick is a softmax and a multinomial (or an argmax) over the whole vocabulary."""
        logits = logits.clone()
        rejected: set[int] = set()
        draws = 1
        while len(rejected) < logits.shape[-1]:
            for token in pick(ids, logits, draws):
                if token in rejected:
                    continue
                if (
                    token not in eos
                    and constraint.check(tokenizer.decode(reply + [token], skip_special_tokens=True)).ok
                    and tokenizer.decode([token], skip_special_tokens=True)
                ):
                    return token
                rejected.add(token)
                logits[0, token] = float("-inf")
            draws = REJECTION_DRAWS
        raise InvalidRequestError("no token of the vocabulary continues the forced tool call: use tool_choice 'auto'")

    def forced_ids(reply: list[int]) -> tuple[list[int], bool]:
        """The tokens of the text the constraint forces next, and whether the text is then complete."""
        text = tokenizer.decode(reply, skip_special_tokens=True)
        check = constraint.check(text)
        if check.complete or not check.forced:
            return [], check.complete
        ids = tokenizer.encode(check.forced, add_special_tokens=False)
        after = tokenizer.decode(reply + ids, skip_special_tokens=True)
        if after != text + check.forced:  # e.g. a tokenizer that adds a leading space: let pick_allowed spell it
            return [], False
        return ids, constraint.check(after).complete

    shown = ShownText(on_text, streamed)
    with model.inference_session(
        max_length=len(prompt_ids) + params.max_tokens,
        prompt_ids=torch.tensor(prompt_ids, dtype=torch.long),
        adapter=adapter,
        session_id=session_id,
    ) as session:
        result.chain = session.chain.describe()
        result.hops = session.chain.num_hops
        result.prefix_hit_tokens = session.position  # the open skipped what every hop had cached
        verifier = session.chain.verifier  # None on local chains
        drafter = None
        if params.prompt_lookup_tokens > 0 and constraint is None:
            # HF's own n-gram drafter (the one `generate(prompt_lookup_num_tokens=k)` uses), its draft
            # length chosen per round from this session's measured steps unless "constant"
            drafter = PromptLookupCandidateGenerator(
                num_output_tokens=params.prompt_lookup_tokens, max_length=len(prompt_ids) + params.max_tokens
            )
            if params.prompt_lookup_schedule == "adaptive":
                drafter = AdaptivePromptLookup(drafter, params.prompt_lookup_tokens, session.step_costs)

        def holding() -> bool:
            return streamed and verifier is not None and verifier.holding()

        def roll_back(q: int) -> None:
            """Back to the last trusted token: tokens [0, q] are (token q came from row q - 1), the prompt always."""
            nonlocal scanner, pending
            keep = min(len(tokens), max(len(prompt_ids), q + 1))
            n = keep - len(prompt_ids)
            if streamed and result.logprobs is not None and n < shown.logprobs:
                raise ShownText.diverged()  # logprobs computed from wrong hidden states were sent
            del tokens[keep:], generated[n:], result.token_times_s[n:]
            if result.logprobs is not None:
                del result.logprobs[n:]
                pending = result.logprobs[min(shown.logprobs, n) :]
            session.processed_ids = tokens[: min(q, len(tokens) - 1)]  # the next step recomputes from row q
            result.finish_reason = "length"
            scanner = StopScanner(params.stop)  # the corrected text comes again from its start
            shown.restart()

        def decode() -> None:
            """Decode until the budget, a stop or a cancel, then let the running audits finish and send the
            rest of the text; a catch raises `VerificationRollback` from anywhere in it."""
            nonlocal pending
            while len(generated) < params.max_tokens and result.finish_reason == "length":
                if cancel.is_set():
                    result.finish_reason = "cancelled"
                    break
                forced, complete = forced_ids(generated) if constraint is not None else ([], False)
                forced = forced[: params.max_tokens - len(generated)]
                if complete and not forced:
                    result.finish_reason = "stop"
                    break
                draft: list[int] = []
                if drafter is not None:
                    candidates, _ = drafter.get_candidates(torch.tensor([tokens], dtype=torch.long))
                    # never verify past the request's budget: the last token of a step is the model's own
                    draft = candidates[0, len(tokens) :].tolist()[: params.max_tokens - len(generated) - 1]
                step_tokens: list[int] = list(forced)
                if complete and result.logprobs is None:  # the closing of a forced call needs no step
                    logits = None
                else:
                    # one chain step takes the forced tokens and verifies every draft; the session rolls
                    # back the rejected ones by itself
                    logits = model(
                        torch.tensor([tokens + forced + draft], dtype=torch.long),
                        logits_to_keep=len(forced) + len(draft) + 1,
                    ).logits[0]
                # Standard acceptance with a point-mass draft: pick position i's token as plain decoding
                # would (argmax, or a sample of the model's distribution there) and keep going while it
                # equals the draft: greedy output is identical, sampled output has the model's distribution.
                for i in range(0 if complete else len(draft) + 1):
                    row = logits[len(forced) + i : len(forced) + i + 1]
                    step_tokens.append(
                        pick(tokens + step_tokens, row)[0]
                        if constraint is None
                        else pick_allowed(tokens + step_tokens, row, generated + step_tokens)
                    )
                    if i == len(draft) or step_tokens[-1] != draft[i]:
                        break
                result.drafted_tokens += len(draft)
                now_s = clock()
                for n, token in enumerate(step_tokens):
                    # a token after the step's first pick was a draft
                    result.accepted_draft_tokens += n > len(forced)
                    if result.logprobs is not None:
                        entry = token_logprob(logits[n], token, params.top_logprobs)
                        result.logprobs.append(entry)
                        pending.append(entry)
                    if result.time_to_first_token_s is None:
                        result.time_to_first_token_s = now_s - start_s
                    result.token_times_s.append(now_s)
                    tokens.append(token)
                    generated.append(token)
                    if token in eos and constraint is None:
                        result.finish_reason = "stop"
                        break
                    delta = scanner.push(tokenizer.decode(generated, skip_special_tokens=True))
                    if delta or pending:
                        shown.give(delta, pending, hold=holding())
                        pending = []
                    if scanner.stopped:
                        result.finish_reason = "stop"
                        break
            if verifier is not None and result.finish_reason != "cancelled":
                # audits still running may yet find a wrong row: roll back and go on then
                verifier.settle()
            if result.finish_reason != "cancelled":
                delta = scanner.push(tokenizer.decode(generated, skip_special_tokens=True), final=True)
                shown.give(delta, pending)  # with what was held back
                pending = []
                shown.finish()

        while True:
            try:
                decode()
                break
            except VerificationRollback as rollback:
                if isinstance(rollback, StreamTakenBackError):
                    raise
                result.verification_restarts += 1
                session.verification_restarts += 1
                if result.verification_restarts > MAX_VERIFICATION_RESTARTS:
                    raise
                roll_back(rollback.trusted_position)
        result.failovers = getattr(session.chain, "failovers", 0)
        result.chain = session.chain.describe()  # the chain that served the answer (after any failover)
    result.text = scanner.sent
    result.completion_tokens = len(generated)
    result.token_ids = generated
    return result


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """`token`'s entry from one position's logits [vocab]: HF's `log_softmax` of the same logits."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    best = torch.topk(logprobs, top) if top > 0 else None
    alternatives = () if best is None else tuple(zip(best.indices.tolist(), best.values.tolist()))
    return TokenLogprob(token, float(logprobs[token]), alternatives)


def _eos_ids(model, tokenizer) -> frozenset[int]:
    ids = model.config.eos_token_id
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
