"""CUDA graphs for decode steps over sessions' static KV caches, and the attention backends on CUDA.

A decode step of a 7B model's block range launches ~35 kernels per block; on an H100 a block's
kernels take ~0.24 ms while launching them from Python takes ~0.7 ms, so eager decode is bound by
the launches, not the GPU. A captured graph replays all of a step's kernels with one launch.

What a graph bakes in is every tensor address it touches: the sessions' KV caches, the position
table, its own input/output buffers. So a graph belongs to one *set of sessions* (their caches are
static: allocated once at open for the session's max length, §2.1 of the paper) and to one version
of the position table; each session's position is an input (a device tensor), which is why the
attention of a captured step runs over the whole static cache with a mask instead of a slice
(`models/attention.py:segment_attention` with `AttentionSegment.position`).

Concurrent clients' steps reach a server at different times, so the sessions of one batch change
from step to step. A graph is therefore captured for the sessions that decoded *recently* (within
`recent_steps` decode steps of this range), and replayed for any batch that is a subset of them: the
absent sessions' rows get zeros and their outputs are dropped. That is safe because a step writes
its keys/values at a session's `past_tokens` and never reads a position at or after it before
writing it, so the absent session's dummy write lands where its own next step writes first (a
session that is full, `past_tokens == max_length`, has no such position: a batch that would need
one runs eagerly). A set is captured the second time it is the recent set (sessions joining or
leaving re-capture; a dead session's graph is never replayed: weak references tell), graphs are
kept LRU up to `max_graphs`, and batches larger than `max_batch` or steps of more than one token
per session (prefill, chunked prefill, speculative verification) run eagerly.
"""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

Body = Callable[[torch.Tensor, torch.Tensor, list], torch.Tensor]


@contextmanager
def attention_backends(device: torch.device):
    """On CUDA, SDPA without cuDNN: with torch 2.11 SDPA picks cuDNN attention, which builds a new
    execution plan for every new KV length (measured: an 11-block step took 49.9 ms at new lengths
    vs 7.7 ms with cuDNN excluded). Flash and memory-efficient kernels need no planning; math is
    the fallback for shapes they refuse. On other devices nothing changes."""
    if device.type != "cuda":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        yield


class CudaGraphCapture:
    """Captures `body` on the static buffers into a CUDA graph; `replay()` relaunches it."""

    def __init__(self, device: torch.device):
        self.device = device
        self._pool = None

    def __call__(self, body: Body, hidden: torch.Tensor, positions: torch.Tensor, kvs: list):
        # Warm-up on a side stream, as torch.cuda.graphs requires: it writes each session's KV at
        # its current position, which the replay writes again (or which the session's next step
        # writes first, for a session absent from this batch).
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            body(hidden, positions, kvs)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()  # graphs share one memory pool
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads of the process (another range's scheduler, the client head)
        # may use the GPU meanwhile; only this thread's work is captured
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = body(hidden, positions, kvs)
        return graph.replay, out


def call_capture(body: Body, hidden: torch.Tensor, positions: torch.Tensor, kvs: list):
    """A stand-in for CudaGraphCapture that runs `body` on the static buffers at every replay: the
    selection and subset logic of DecodeGraphs, testable on a CPU."""
    out = body(hidden, positions, kvs)

    def replay():
        out.copy_(body(hidden, positions, kvs))

    return replay, out


@dataclass
class _Graph:
    replay: Callable[[], None]
    kvs: list[weakref.ref]  # the sessions it was captured for (weak: a graph never keeps a session's KV alive)
    version: int
    hidden: torch.Tensor  # static input [B, hidden]
    positions: torch.Tensor  # static input [B] (long)
    out: torch.Tensor  # static output [B, hidden]

    def members(self) -> list | None:
        """The captured sessions, or None when one has died (its id may now name another session)."""
        kvs = [ref() for ref in self.kvs]
        return None if any(kv is None for kv in kvs) else kvs


class DecodeGraphs:
    """Owned by one `BlockRange` and called only from its `forward` (the server's scheduler thread)."""

    def __init__(
        self,
        body: Body,
        *,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        version: Callable[[], int],
        capture: Callable | None = None,
        max_batch: int = 16,
        max_graphs: int = 8,
        capture_after: int = 2,
        recent_steps: int = 8,
    ):
        self.body = body
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, torch.device(device)
        self.version = version
        self.capture = capture or CudaGraphCapture(self.device)
        self.max_batch, self.max_graphs = max_batch, max_graphs
        self.capture_after, self.recent_steps = capture_after, recent_steps
        self._graphs: OrderedDict[tuple[int, ...], _Graph] = OrderedDict()
        self._sightings: OrderedDict[tuple[int, ...], int] = OrderedDict()
        self._recent: OrderedDict[int, tuple[weakref.ref, int]] = OrderedDict()  # id -> (session, last step no.)
        self._step_no = 0
        self.disabled_reason: str | None = None
        self.replays = 0
        self.captures = 0
        self.padded_rows = 0  # rows of absent sessions computed and dropped

    def run(self, steps) -> list[torch.Tensor] | None:
        """Outputs of a decode step (one row per step), or None: run it eagerly. Does not advance
        `past_tokens` (the caller does, as for an eager step)."""
        if self.disabled_reason is not None or len(steps) > self.max_batch:
            return None
        batch = [s.kv for s in steps]
        members = self._recent_set(batch)
        version = self.version()
        key = tuple(id(kv) for kv in members)
        entry = self._valid(self._graphs.get(key), members, version)
        if entry is None:
            self._graphs.pop(key, None)
            seen = self._sightings.pop(key, 0) + 1
            if seen >= self.capture_after:
                entry = self._capture(members, version)
                if entry is None:
                    return None
            else:
                self._sightings[key] = seen
                while len(self._sightings) > 4 * self.max_graphs:
                    self._sightings.popitem(last=False)
                entry, members = self._superset_graph(batch, version)
                if entry is None:
                    return None
        else:
            self._graphs.move_to_end(key)
        return self._replay(entry, members, steps)

    def _recent_set(self, batch: list) -> list:
        """This batch's sessions plus the others that decoded within `recent_steps` steps, by id."""
        self._step_no += 1
        for kv in batch:
            self._recent.pop(id(kv), None)
            self._recent[id(kv)] = (weakref.ref(kv), self._step_no)
        in_batch = {id(kv) for kv in batch}
        others = []
        for ident, (ref, last) in list(self._recent.items()):
            kv = ref()
            if kv is None or self._step_no - last >= self.recent_steps:
                del self._recent[ident]
            elif ident not in in_batch:
                others.append(kv)
        room = self.max_batch - len(batch)
        others = others[-room:] if room > 0 else []  # the most recent ones
        return sorted(batch + others, key=id)

    def _valid(self, entry: _Graph | None, members: list, version: int) -> _Graph | None:
        if entry is None or entry.version != version:
            return None
        alive = entry.members()
        return entry if alive is not None and all(a is b for a, b in zip(alive, members)) else None

    def _superset_graph(self, batch: list, version: int) -> tuple[_Graph | None, list]:
        """The smallest captured graph whose sessions include the whole batch."""
        wanted = {id(kv) for kv in batch}
        best, best_members = None, []
        for key, entry in self._graphs.items():
            if wanted <= set(key) and entry.version == version and (best is None or len(key) < len(best_members)):
                members = entry.members()
                if members is not None:
                    best, best_members = entry, members
        return best, best_members

    def _capture(self, members: list, version: int) -> _Graph | None:
        hidden = torch.zeros(len(members), self.hidden_size, dtype=self.dtype, device=self.device)
        positions = torch.tensor(
            [min(kv.past_tokens, kv.max_length_tokens - 1) for kv in members], dtype=torch.long, device=self.device
        )
        if any(kv.past_tokens >= kv.max_length_tokens for kv in members):
            return None  # a full session has no free position for the capture's warm-up write
        try:
            replay, out = self.capture(self.body, hidden, positions, members)
        except Exception as e:  # noqa: BLE001 - any capture failure falls back to eager for good
            self.disabled_reason = f"{type(e).__name__}: {e}"
            logger.warning("CUDA graph capture failed, decode runs eagerly from now on: %s", self.disabled_reason)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return None
        while len(self._graphs) >= self.max_graphs:
            self._graphs.popitem(last=False)
        entry = _Graph(replay, [weakref.ref(kv) for kv in members], version, hidden, positions, out)
        self._graphs[tuple(id(kv) for kv in members)] = entry
        self.captures += 1
        return entry

    def _replay(self, entry: _Graph, members: list, steps) -> list[torch.Tensor] | None:
        row_of = {id(kv): row for row, kv in enumerate(members)}
        in_batch = {id(s.kv) for s in steps}
        if any(kv.past_tokens >= kv.max_length_tokens for kv in members if id(kv) not in in_batch):
            return None  # an absent full session: no position its dummy row may write (see the module doc)
        rows = torch.tensor([row_of[id(s.kv)] for s in steps], dtype=torch.long, device=self.device)
        entry.hidden.zero_()
        entry.hidden.index_copy_(0, rows, torch.cat([s.hidden for s in steps]).to(self.device, self.dtype))
        entry.positions.copy_(torch.tensor([kv.past_tokens for kv in members], dtype=torch.long, device=self.device))
        entry.replay()
        self.replays += 1
        self.padded_rows += len(members) - len(steps)
        out = entry.out.index_select(0, rows)  # a copy: the static output is overwritten by the next replay
        return list(out.split(1))
