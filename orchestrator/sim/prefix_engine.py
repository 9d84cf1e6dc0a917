"""The prefix-aware discrete-event simulator: chains of servers with bounded LRU prefix caches.

What orchestrator.sim.engine does, plus the prompt: a request of P prompt tokens and O output tokens
that starts on chain k reuses u_k tokens, the chain's usable prefix (the minimum over its hops of what
each hop's server cache holds, whole chunks, one token left to run:
petals_chain.wire.prefix_keys.usable_prefix_tokens), and takes
    sum over hops s of m_s [t_I(s) (P - u_k) + t_O(s) O] + t_o(s)
(footnote 11 of the paper with the matched prefix free). At its start every hop's cache stores the
prompt's chunks (least recently used chunks evicted first; a request's own chunks are touched leaf to
root, so an evicted chunk is never an ancestor of a cached one it was used with). The dispatcher's
PrefixIndex learns grants itself and is told every eviction (the servers' reports, here without
delay), so it may differ from the caches only by its own bound.

A chain is c_k parallel slots (the paper's model); the dispatcher is any of orchestrator.dispatch, fed
`DispatchRequest`s. Pure: the same inputs give the same result.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from orchestrator.dispatch import Dispatcher, DispatchRequest, ServerCost
from orchestrator.model import ChainSpec
from orchestrator.prefix_index import PrefixIndex, namespace
from orchestrator.sim.prefix_workloads import PromptRequest
from petals_chain.wire.prefix_keys import PREFIX_CHUNK_TOKENS, usable_prefix_tokens


class LruPrefixCache:
    """One server's prefix cache: at most `capacity_chunks` (namespace, chunk) entries, LRU."""

    def __init__(self, server: Hashable, capacity_chunks: int, on_evict=None):
        self.server = server
        self.capacity_chunks = capacity_chunks
        self._entries: OrderedDict[tuple[str, Hashable], None] = OrderedDict()
        self._on_evict = on_evict
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def held(self) -> set[tuple[str, Hashable]]:
        return set(self._entries)

    def match_chunks(self, ns: str, hashes: Sequence[Hashable]) -> int:
        n = 0
        for h in hashes:
            if (ns, h) not in self._entries:
                break
            n += 1
        return n

    def store(self, ns: str, hashes: Sequence[Hashable]) -> None:
        for h in reversed(hashes):  # leaf first: the root ends most recently used
            key = (ns, h)
            if key in self._entries:
                self._entries.move_to_end(key)
            else:
                self._entries[key] = None
        while len(self._entries) > self.capacity_chunks:
            (ns_old, h_old), _ = self._entries.popitem(last=False)
            self.evicted += 1
            if self._on_evict is not None:
                self._on_evict(self.server, ns_old, h_old)


@dataclass(frozen=True)
class PrefixSimResult:
    response_s: np.ndarray  # per request, arrival order
    wait_s: np.ndarray
    finish_s: np.ndarray
    start_s: np.ndarray
    chain_id: np.ndarray
    reused_tokens: np.ndarray  # prefill tokens taken from the chain's caches
    computed_tokens: np.ndarray  # prefill tokens the chain ran
    clients: tuple[str, ...]  # per request
    cache_contents: dict  # server -> the (namespace, chunk) entries its cache holds at the end

    def summary(
        self,
        *,
        horizon_s: float | None = None,
        w_in: float = 1.0,
        w_out: float = 2.0,
        output_tokens: np.ndarray | None = None,
        prompt_tokens: np.ndarray | None = None,
        well_behaved: Sequence[str] | None = None,
    ) -> dict:
        r = self.response_s
        out = {
            "n": int(len(r)),
            "mean_response_s": float(r.mean()),
            "p50_response_s": float(np.percentile(r, 50)),
            "p99_response_s": float(np.percentile(r, 99)),
            "mean_wait_s": float(self.wait_s.mean()),
            "reused_tokens": int(self.reused_tokens.sum()),
            "computed_tokens": int(self.computed_tokens.sum()),
        }
        total = self.reused_tokens.sum() + self.computed_tokens.sum()
        out["hit_rate"] = float(self.reused_tokens.sum() / total) if total else 0.0
        end = float(self.finish_s.max()) if horizon_s is None else horizon_s
        done = self.finish_s <= end
        out["throughput_rps"] = float(done.sum() / end) if end > 0 else math.nan
        if prompt_tokens is not None and output_tokens is not None:
            # each client's service: what its requests granted before the horizon asked for (VTC's measure,
            # w_in * input + w_out * output tokens), so a reused prefix is no less service
            granted = self.start_s <= end
            served: dict[str, float] = {}
            for c, g, p, o in zip(self.clients, granted, prompt_tokens, output_tokens):
                if g:
                    served[c] = served.get(c, 0.0) + w_in * p + w_out * o
            out["service_by_client"] = served
            out["jain_index"] = jain_index(list(served.values()))
        if well_behaved is not None:
            mask = np.array([c in set(well_behaved) for c in self.clients])
            if mask.any():
                out["well_behaved_p50_s"] = float(np.percentile(r[mask], 50))
                out["well_behaved_p99_s"] = float(np.percentile(r[mask], 99))
                out["well_behaved_mean_s"] = float(r[mask].mean())
        return out


def jain_index(xs: Sequence[float]) -> float:
    """Jain's fairness index (sum x)^2 / (n sum x^2): 1 when all equal, 1/n when one takes all."""
    x = np.asarray(xs, dtype=float)
    return float(x.sum() ** 2 / (len(x) * (x**2).sum())) if len(x) and (x**2).sum() > 0 else math.nan


def simulate_prefix(
    dispatcher: Dispatcher,
    chains: Sequence[ChainSpec],
    requests: Sequence[PromptRequest],
    *,
    costs: dict[Hashable, ServerCost],
    overhead_s: float = 0.0,
    cache_chunks: int,
    sharing: str = "swarm",
    index: PrefixIndex | None = None,
) -> PrefixSimResult:
    """Run `requests` (sorted by arrival) through `dispatcher` over `chains` (ChainSpec.servers name the
    servers, `costs` their t_I / t_O per block and token). `index`: the dispatcher's, told of evictions."""
    servers = sorted({s for k in chains for s in k.servers})
    on_evict = index.evict if index is not None else None
    caches = {s: LruPrefixCache(s, cache_chunks, on_evict) for s in servers}
    n = len(requests)
    arr = [q.arrival_s for q in requests]
    if any(b < a for a, b in zip(arr, arr[1:])):
        raise ValueError("requests must be sorted by arrival")
    start = [math.nan] * n
    finish = [math.nan] * n
    chain = [-1] * n
    reused = [0] * n
    computed = [0] * n
    heap: list[tuple[float, int]] = []
    i = 0
    while i < n or heap:
        if heap and (i >= n or heap[0][0] <= arr[i]):
            now, job = heapq.heappop(heap)
            finish[job] = now
            starts = dispatcher.on_completion(job)
        else:
            now = arr[i]
            q = requests[i]
            starts = dispatcher.on_arrival(
                i, None, DispatchRequest(q.client_id, q.hashes, q.prompt_tokens, q.output_tokens)
            )
            i += 1
        for s in starts:
            j = s.job_id
            if chain[j] != -1:
                raise RuntimeError(f"job {j} started twice")
            q = requests[j]
            k = chains[s.chain_id]
            nss = [namespace(sharing, q.client_id, b.start) for b in k.blocks]
            held = [caches[srv].match_chunks(ns, q.hashes) * PREFIX_CHUNK_TOKENS for srv, ns in zip(k.servers, nss)]
            u = usable_prefix_tokens(held, q.prompt_tokens)
            miss = q.prompt_tokens - u
            service = sum(
                (b.end - b.start) * (costs[srv].t_in_s * miss + costs[srv].t_out_s * q.output_tokens) + overhead_s
                for srv, b in zip(k.servers, k.blocks)
            )
            for srv, ns in zip(k.servers, nss):
                caches[srv].store(ns, q.hashes)
            chain[j], start[j], reused[j], computed[j] = s.chain_id, now, u, miss
            heapq.heappush(heap, (now + service, j))
    if any(math.isnan(f) for f in finish):
        raise RuntimeError("some requests never finished")
    a, st, fi = np.array(arr), np.array(start), np.array(finish)
    return PrefixSimResult(
        fi - a,
        st - a,
        fi,
        st,
        np.array(chain),
        np.array(reused),
        np.array(computed),
        tuple(q.client_id for q in requests),
        {s: c.held() for s, c in caches.items()},
    )
