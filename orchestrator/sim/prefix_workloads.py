"""Shared-prompt workloads for the prefix-aware simulator (orchestrator.sim.prefix_engine).

The seeds' workloads (Preble §2 / Table 1, the DLPM paper's §6), scaled to a chain of CPU-share
servers, each a generator of prompts as chained chunk names (the same chaining as
petals_chain.wire.prefix_keys: chunk i's name covers chunks 0..i, so two prompts share name i exactly
when they share their first i+1 chunks). A chunk is PREFIX_CHUNK_TOKENS tokens; every prompt ends in
a part chunk of TAIL_TOKENS tokens that is never cached (the server runs at least one token).

- ``tooluse``: one system prompt shared by all, then one of ``n_tools`` tool descriptions drawn with
  Zipf(1.1) popularity (Toolbench's skew), then the user's own query.
- ``chat``: multi-turn conversations per client: a turn's prompt is the conversation so far (system
  prompt, earlier questions and answers) plus the new question.
- ``tot``: tree of thoughts: a problem, then a path of thoughts; each request extends a node of one of
  its client's trees by one thought (branching: nodes are extended again at random).
- ``longdoc``: long-document QA: one of ``n_docs`` long documents, then a short question.

Arrivals come from the Azure LLM inference trace (orchestrator.sim.traces), rescaled to a target mean
rate; each arrival belongs to a client drawn by the clients' rate weights (a flooder is a client with
a large weight). Everything is drawn from one injected numpy Generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from petals_chain.wire.prefix_keys import PREFIX_CHUNK_TOKENS

TAIL_TOKENS = 8
WORKLOADS = ("tooluse", "chat", "tot", "longdoc")


@dataclass(frozen=True)
class PromptRequest:
    arrival_s: float
    client_id: str
    hashes: tuple  # chained chunk names of the prompt's full chunks
    prompt_tokens: int
    output_tokens: int


def _chain(parent: int, segment: int, n_chunks: int) -> list[int]:
    """Chained names of a segment's chunks after `parent` (ints: Python hashes tuples of ints reproducibly)."""
    out = []
    h = parent
    for j in range(n_chunks):
        h = hash((h, segment, j))
        out.append(h)
    return out


class _Workload:
    output_tokens = 16

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self._segments = 0

    def segment(self) -> int:
        self._segments += 1
        return self._segments

    def prompt(self, client: str) -> tuple[list[int], int]:
        raise NotImplementedError


class ToolUse(_Workload):
    output_tokens = 16

    def __init__(
        self,
        rng,
        n_tools: int = 64,
        system_chunks: int = 32,
        tool_chunks: int = 64,
        query_chunks: int = 4,
        zipf_s: float = 1.1,
    ):
        super().__init__(rng)
        self.system = _chain(0, self.segment(), system_chunks)
        self.tools = [self.system + _chain(self.system[-1], self.segment(), tool_chunks) for _ in range(n_tools)]
        w = 1.0 / np.arange(1, n_tools + 1) ** zipf_s
        self.p = w / w.sum()
        self.query_chunks = query_chunks

    def prompt(self, client):
        tool = self.tools[int(self.rng.choice(len(self.tools), p=self.p))]
        return tool + _chain(tool[-1], self.segment(), self.query_chunks), 0


class Chat(_Workload):
    output_tokens = 64

    def __init__(
        self, rng, system_chunks: int = 16, question_chunks: int = 4, p_new: float = 0.25, max_turns: int = 12
    ):
        super().__init__(rng)
        self.system = _chain(0, self.segment(), system_chunks)
        self.question_chunks, self.p_new, self.max_turns = question_chunks, p_new, max_turns
        self.conversations: dict[str, list[list[int]]] = {}

    def prompt(self, client):
        convs = self.conversations.setdefault(client, [])
        convs[:] = [c for c in convs if len(c) < self.max_turns * 10 * self.question_chunks]
        if not convs or self.rng.random() < self.p_new:
            convs.append(list(self.system))
        conv = convs[int(self.rng.integers(len(convs)))]
        prompt = conv + _chain(conv[-1], self.segment(), self.question_chunks)
        # the answer becomes part of the conversation's history for its next turn
        conv[:] = prompt + _chain(prompt[-1], self.segment(), self.output_tokens // PREFIX_CHUNK_TOKENS)
        return prompt, 0


class TreeOfThoughts(_Workload):
    output_tokens = 32

    def __init__(self, rng, problem_chunks: int = 32, thought_chunks: int = 8, p_new: float = 0.1, max_depth: int = 4):
        super().__init__(rng)
        self.problem_chunks, self.thought_chunks, self.p_new, self.max_depth = (
            problem_chunks,
            thought_chunks,
            p_new,
            max_depth,
        )
        self.trees: dict[str, list[list[list[int]]]] = {}  # client -> trees -> nodes (prompt paths)

    def prompt(self, client):
        trees = self.trees.setdefault(client, [])
        if not trees or self.rng.random() < self.p_new:
            trees.append([_chain(0, self.segment(), self.problem_chunks)])
            trees[:] = trees[-4:]  # a client works on its few latest problems
        tree = trees[int(self.rng.integers(len(trees)))]
        parents = [n for n in tree if (len(n) - self.problem_chunks) // self.thought_chunks < self.max_depth]
        parent = parents[int(self.rng.integers(len(parents)))]
        node = parent + _chain(parent[-1], self.segment(), self.thought_chunks)
        tree.append(node)
        return node, 0


class LongDocQA(_Workload):
    output_tokens = 8

    def __init__(self, rng, n_docs: int = 16, doc_chunks: int = 192, question_chunks: int = 2):
        super().__init__(rng)
        self.docs = [_chain(0, self.segment(), doc_chunks) for _ in range(n_docs)]
        self.question_chunks = question_chunks

    def prompt(self, client):
        doc = self.docs[int(self.rng.integers(len(self.docs)))]
        return doc + _chain(doc[-1], self.segment(), self.question_chunks), 0


def make_workload(name: str, rng: np.random.Generator) -> _Workload:
    table = {"tooluse": ToolUse, "chat": Chat, "tot": TreeOfThoughts, "longdoc": LongDocQA}
    if name not in table:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    return table[name](rng)


def prompt_requests(
    workload: str, arrivals_s: np.ndarray, clients: dict[str, float], rng: np.random.Generator
) -> list[PromptRequest]:
    """One request per arrival; its client drawn by the weights of `clients` (name -> rate weight)."""
    w = make_workload(workload, rng)
    names = list(clients)
    p = np.array([clients[c] for c in names], dtype=float)
    p /= p.sum()
    who = rng.choice(len(names), size=len(arrivals_s), p=p)
    out = []
    for t, c in zip(np.asarray(arrivals_s, dtype=float), who):
        client = names[int(c)]
        hashes, _ = w.prompt(client)
        out.append(
            PromptRequest(
                float(t), client, tuple(hashes), len(hashes) * PREFIX_CHUNK_TOKENS + TAIL_TOKENS, w.output_tokens
            )
        )
    return out
