"""CUDA graphs for decode steps over sessions' static KV caches, and the attention backends on CUDA.

A decode step of a 7B model's block range launches ~35 kernels per block; on an H100 a block's
kernels take ~0.24 ms while launching them from Python takes ~0.7 ms, so eager decode is bound by
the launches, not the GPU. A captured graph replays all of a step's kernels with one launch.

What a graph bakes in is every tensor address it touches: the sessions' KV caches, the position
table, its own input/output buffers. So a graph belongs to one *set of sessions* (their caches are
static: allocated once at open for the session's max length, §2.1 of the paper) and to one version
of the position table; the position of each session is an input (a device tensor), which is why the
attention of a captured step runs over the whole static cache with a mask instead of a slice
(`family.write_and_attend` with `AttentionSegment.position`). A set is captured the second time it
decodes together (`capture_after`, 3: sets that form by chance as concurrent clients' steps
arrive at different times stay eager rather than each paying a capture), graphs are kept
LRU up to `max_graphs`, and sets larger than `max_batch` or steps of more than one token per session
(prefill, chunked prefill, speculative verification) run eagerly.
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


@dataclass
class _Graph:
    graph: "torch.cuda.CUDAGraph"
    kvs: list[weakref.ref]  # the sessions it was captured for (weak: a graph never keeps a session's KV alive)
    version: int
    hidden: torch.Tensor  # static input [B, hidden]
    positions: torch.Tensor  # static input [B] (long)
    out: torch.Tensor  # static output [B, hidden]

    def alive_for(self, kvs: list, version: int) -> bool:
        # A dead session's id may be reused by a new one; the weak references tell them apart.
        return version == self.version and all(ref() is kv for ref, kv in zip(self.kvs, kvs))


class DecodeGraphs:
    """Owned by one `BlockRange` and called only from its `forward` (the server's scheduler thread)."""

    def __init__(self, body: Callable[[torch.Tensor, torch.Tensor, list], torch.Tensor], *, hidden_size: int,
                 dtype: torch.dtype, device: torch.device, version: Callable[[], int], max_batch: int = 16,
                 max_graphs: int = 16, capture_after: int = 3):
        self.body = body
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, device
        self.version = version
        self.max_batch, self.max_graphs, self.capture_after = max_batch, max_graphs, capture_after
        self._graphs: OrderedDict[tuple[int, ...], _Graph] = OrderedDict()
        self._sightings: OrderedDict[tuple[int, ...], int] = OrderedDict()
        self._pool = None
        self.disabled_reason: str | None = None
        self.replays = 0
        self.captures = 0

    def run(self, steps) -> list[torch.Tensor] | None:
        """Outputs of a decode step (one row per step), or None: run it eagerly. Does not advance
        `past_tokens` (the caller does, as for an eager step)."""
        if self.disabled_reason is not None or len(steps) > self.max_batch:
            return None
        # one graph per set, whatever order the scheduler lists its sessions in
        order = sorted(range(len(steps)), key=lambda i: id(steps[i].kv))
        kvs = [steps[i].kv for i in order]
        key = tuple(id(kv) for kv in kvs)
        version = self.version()
        entry = self._graphs.get(key)
        if entry is not None and not entry.alive_for(kvs, version):
            del self._graphs[key]
            entry = None
        hidden = torch.cat([steps[i].hidden for i in order]).to(self.device, self.dtype)
        positions = torch.tensor([kv.past_tokens for kv in kvs], dtype=torch.long, device=self.device)
        if entry is None:
            seen = self._sightings.pop(key, 0) + 1
            if seen < self.capture_after:
                self._sightings[key] = seen
                while len(self._sightings) > 4 * self.max_graphs:
                    self._sightings.popitem(last=False)
                return None
            try:
                entry = self._capture(kvs, hidden, positions, version)
            except Exception as e:  # noqa: BLE001 - any capture failure falls back to eager for good
                self.disabled_reason = f"{type(e).__name__}: {e}"
                logger.warning("CUDA graph capture failed, decode runs eagerly from now on: %s", self.disabled_reason)
                torch.cuda.synchronize(self.device)
                return None
        else:
            self._graphs.move_to_end(key)
            entry.hidden.copy_(hidden)
            entry.positions.copy_(positions)
        entry.graph.replay()
        self.replays += 1
        out = entry.out.clone()  # the static output is overwritten by the next replay
        rows = [None] * len(steps)
        for row, i in enumerate(order):
            rows[i] = out[row:row + 1]
        return rows

    def _capture(self, kvs: list, hidden: torch.Tensor, positions: torch.Tensor, version: int) -> _Graph:
        static_hidden, static_positions = hidden.clone(), positions.clone()
        # Warm-up on a side stream, as torch.cuda.graphs requires: it writes each session's KV at its
        # current position, exactly what the replay below writes again.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self.body(static_hidden, static_positions, kvs)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads of the process (another range's scheduler, the client head) may
        # use the GPU meanwhile; only this thread's work is captured
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = self.body(static_hidden, static_positions, kvs)
        while len(self._graphs) >= self.max_graphs:
            self._graphs.popitem(last=False)
        entry = _Graph(graph, [weakref.ref(kv) for kv in kvs], version, static_hidden, static_positions, out)
        self._graphs[tuple(id(kv) for kv in kvs)] = entry
        self.captures += 1
        return entry
