"""Adaptive draft length for speculative decoding by prompt lookup over a chain.

A verification step of k drafts costs more than a plain 1-token step wherever the servers' compute
grows with the step's tokens (one CPU thread, SmolLM2-135M, 10 blocks, 300 tokens cached: 23.5 ms
for 1 token, 38 / 52 / 64 / 77 ms for 2 / 3 / 5 / 9), and a draft rejected at its first token buys
nothing: with a fixed k, free chat (where prompt lookup keeps finding 1-gram "matches" that the model
does not follow) pays a (k+1)-token step for one token every round. So each round sends the k in
0..K that maximises the expected tokens per second of chain time,

    (1 + E[min(m, k)]) / t(k + 1),

where m is how many tokens of the full K-token draft the model goes on to generate (the accepted
prefix), E its mean over the recent drafts, and t(n) the measured time of an n-token chain step.
k = 0 is one plain 1-token step: exactly what a round costs without speculation.

Acceptance is measured for every draft, sent or not. Prompt lookup drafts point masses, so a draft
token is accepted exactly when it equals the token the model picks there (greedy or sampled, HF's
rule in `_assisted_decoding`); a draft held back is compared with the tokens the model generates in
the next rounds. So a chat that stopped drafting notices at no cost when the model starts to quote.
The acceptance rule itself stays HF's: only the draft's length changes, so the output does not.
"""

from __future__ import annotations

from collections import deque

import torch
from transformers.generation.candidate_generator import CandidateGenerator

# A step longer than this is a prompt (prefill), another regime than drafts' verification steps
MAX_MODELLED_STEP_TOKENS = 64
# A step slower than this many times its predicted cost counts as this many times: one step slowed by
# a load spike on a shared machine (5x measured) would otherwise make verification look dear for the
# next 10-15 rounds (few multi-token steps carry the fit) and stop drafting there; a lasting change is
# still followed, by up to this factor per step
OUTLIER_RATIO = 2.0
# HF's `num_assistant_tokens_schedule` says "constant" for a fixed draft length
SCHEDULES = ("adaptive", "constant")


class StepCostModel:
    """The measured seconds of an n-token chain step. 1-token steps and multi-token steps are modelled
    apart because they run different kernels (on CPU a 1-token step's matmuls are matrix-vector
    products; from 2 tokens on they are matrix products, measured 1.6x the time at 2 tokens) and so do
    not lie on one line: t(1) is a running mean of 1-token steps, t(n >= 2) a line fitted to the
    multi-token steps (least squares with exponential forgetting, so that it follows the load).
    Every step ages the multi-token measurements, 1-token steps too: when drafting stops because
    verification looked too dear, the prediction drifts back to a 1-token step's cost, so a stale or
    unlucky measurement is retried now and then instead of stopping drafting for good."""

    def __init__(self, forget: float = 0.9):
        self.forget = forget  # weight kept by older observations at each new one of the same kind
        self.single_s: float | None = None
        self._sums = [0.0] * 5  # decayed sums over multi-token steps: w, w*n, w*t, w*n*n, w*n*t

    def observe(self, n_tokens: int, seconds: float) -> None:
        if n_tokens < 1 or n_tokens > MAX_MODELLED_STEP_TOKENS or seconds <= 0:
            return
        predicted = self.predict_s(n_tokens)
        if predicted is not None:
            seconds = min(seconds, OUTLIER_RATIO * predicted)
        self._sums = [s * self.forget for s in self._sums]
        if n_tokens == 1:
            mix = 1.0 - self.forget
            self.single_s = seconds if self.single_s is None else (1 - mix) * self.single_s + mix * seconds
            return
        w, wn, wt, wnn, wnt = self._sums
        self._sums = [w + 1, wn + n_tokens, wt + seconds, wnn + n_tokens * n_tokens, wnt + n_tokens * seconds]

    def predict_s(self, n_tokens: int) -> float | None:
        """Seconds of an n-token step; None before any step of its kind (and of the other) was seen."""
        w, wn, wt, wnn, wnt = self._sums
        if n_tokens == 1 or w == 0:
            # no multi-token step yet: assume it costs a 1-token step (the optimistic guess makes the
            # first drafting round measure it)
            return self.single_s
        mean_n, mean_t = wn / w, wt / w
        var_n = wnn / w - mean_n * mean_n
        slope = (wnt / w - mean_n * mean_t) / var_n if var_n > 0.25 else 0.0  # one size seen: flat
        # never decreasing in n (noise can tilt the fit)
        predicted = mean_t + max(0.0, slope) * (n_tokens - mean_n)
        if self.single_s is not None:
            # a prior of one pseudo-step costing what a 1-token step costs: with few (or old)
            # measurements a too-high one (a kernel's first run, a load spike) would otherwise stop
            # drafting for good, since only drafting measures multi-token steps again
            predicted = max(self.single_s, (w * predicted + self.single_s) / (w + 1))
        return max(predicted, 1e-9)


class AdaptivePromptLookup(CandidateGenerator):
    """HF's candidate-generator interface around HF's own prompt lookup (`lookup`, drafting up to
    `max_draft_tokens`): each round keeps the first k tokens of its draft, k chosen as the module
    docstring says from `step_costs` (the session's measured chain steps) and the last `window`
    drafts' acceptance. Used by `DistributedModelForCausalLM.generate` (HF's assisted-decoding loop)
    and by the API gateway's decode loop (`draft`)."""

    def __init__(self, lookup: CandidateGenerator, max_draft_tokens: int, step_costs: StepCostModel, window: int = 16):
        if max_draft_tokens < 1:
            raise ValueError(f"max_draft_tokens must be >= 1, got {max_draft_tokens}")
        self.lookup = lookup
        self.max_draft_tokens = max_draft_tokens
        self.step_costs = step_costs
        self.accepted = deque(maxlen=window)  # m of each resolved draft (accepted prefix of the full draft)
        # drafts whose fate is not known yet: (position of their first token, the full draft); a
        # draft is resolved within its length in rounds (each round adds a token at least), so this
        # holds at most max_draft_tokens entries
        self.pending: list[tuple[int, list[int]]] = []
        self.pending_matched: list[int] = []  # tokens each pending draft has matched so far: lower bounds
        self.chosen_k: list[int] = []  # the k of every round that had a draft (for stats and tests)

    def get_candidates(self, input_ids: torch.LongTensor, **kwargs) -> tuple[torch.LongTensor, None]:
        draft = self.draft(input_ids)
        if not draft:
            return input_ids, None
        return torch.cat([input_ids, torch.tensor([draft], dtype=input_ids.dtype, device=input_ids.device)], 1), None

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, num_matches: int):
        """Nothing to do here: the next `draft` sees the accepted tokens in its ids."""

    def draft(self, input_ids: torch.LongTensor) -> list[int]:
        """The tokens to verify after `input_ids` [1, n] this round: a prefix of the lookup's draft."""
        ids = input_ids[0].tolist()
        self._resolve(ids)
        candidates, _ = self.lookup.get_candidates(input_ids)
        full = candidates[0, len(ids) : len(ids) + self.max_draft_tokens].tolist()
        if not full:
            return []  # no match: a plain 1-token step
        self.pending.append((len(ids), full))
        k = self.choose_k(len(full))
        self.chosen_k.append(k)
        return full[:k]

    def choose_k(self, available: int) -> int:
        """argmax over k in 0..available of expected tokens per second of chain time (ties: fewer)."""
        observed = [*self.accepted, *self.pending_matched]
        best_k, best_rate = 0, None
        single_s = self.step_costs.predict_s(1)
        for k in range(available + 1):
            # before any draft was judged, assume every drafted token is accepted (one round finds out)
            gain = sum(min(m, k) for m in observed) / len(observed) if observed else k
            seconds = self.step_costs.predict_s(k + 1)
            # costs not measured yet: every step size alike
            rate = (1 + gain) / (seconds if seconds is not None and single_s is not None else 1.0)
            if best_rate is None or rate > best_rate * (1 + 1e-9):
                best_k, best_rate = k, rate
        return best_k

    def _resolve(self, ids: list[int]) -> None:
        """Compare every pending draft with the tokens generated since it was drafted."""
        self.pending_matched, still = [], []
        for start, full in self.pending:
            seen = ids[start : start + len(full)]
            matched = next((i for i, (a, b) in enumerate(zip(seen, full)) if a != b), len(seen))
            if matched < len(seen) or len(seen) == len(full):
                self.accepted.append(matched)  # rejected at `matched`, or accepted whole
            else:
                still.append((start, full))
                self.pending_matched.append(matched)
        self.pending = still
