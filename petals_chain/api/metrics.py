"""The gateway's metrics, served on `/metrics` by `prometheus_client`.

Names follow vLLM's (`vllm:num_requests_running`, `vllm:time_to_first_token_seconds`, ...) under a
`petals_chain:` prefix, with the same `model_name` label, so a Grafana dashboard built for vLLM
or SGLang needs only the prefix changed; the chain-specific ones (hops, failovers, prefix-cache
hits) are extra. Each gateway owns its own `CollectorRegistry` (no process-global state: tests
run several gateways in one process).
"""

from __future__ import annotations

import threading

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "petals_chain:"
# vLLM's buckets for the same histograms (vllm/engine/metrics.py), so dashboards' quantiles line up
TTFT_BUCKETS_S = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS_S = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_BUCKETS_S = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
HOP_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16)
CONTENT_TYPE = CONTENT_TYPE_LATEST
# our finish reasons as vLLM labels them (a request the client hung up on is vLLM's "abort")
FINISHED_REASON = {"stop": "stop", "length": "length", "cancelled": "abort", "tool_calls": "stop"}


class GatewayMetrics:
    def __init__(self, model_name: str = ""):
        self.registry = CollectorRegistry(auto_describe=True)
        self._lock = threading.Lock()
        # the queue's and sessions' counts have one owner each (the gateway's event loop); the
        # gauges read them when scraped
        self.active_sessions = 0
        self.waiting = 0
        self.model_name = model_name
        m = {"model_name": model_name}
        r = self.registry

        def gauge(name, doc, fn):
            g = Gauge(PREFIX + name, doc, ["model_name"], registry=r)
            g.labels(**m).set_function(fn)

        gauge("num_requests_running", "Sessions running through the swarm now.", lambda: self.active_sessions)
        gauge("num_requests_waiting", "Requests waiting in the gateway's admission queue.", lambda: self.waiting)
        self.http_requests = Counter(
            PREFIX + "http_requests", "HTTP requests by endpoint and status.", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of finished requests.", ["model_name"], registry=r
        ).labels(**m)
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Generated tokens of finished requests.", ["model_name"], registry=r
        ).labels(**m)
        self.request_success = Counter(
            PREFIX + "request_success",
            "Finished requests (choices) by finish reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self._success_m = m

        def hist(name, doc, buckets):
            return Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets, registry=r).labels(**m)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token (from admission).", TTFT_BUCKETS_S)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive generated tokens.", ITL_BUCKETS_S)
        self.e2e = hist("e2e_request_latency_seconds", "Request latency from arrival to last token.", REQUEST_BUCKETS_S)
        self.queue_time = hist(
            "request_queue_time_seconds", "Time a request waited in the gateway's queue.", REQUEST_BUCKETS_S
        )
        self.hops = hist("request_hops", "Servers in the chain each session ran through.", HOP_BUCKETS)
        self.failovers = Counter(
            PREFIX + "failovers", "Hops replaced after a server failed mid-session.", ["model_name"], registry=r
        ).labels(**m)
        self.prefix_hit_tokens = Counter(
            PREFIX + "prefix_cache_hit_tokens",
            "Prompt tokens every hop of the chain took from its prefix cache.",
            ["model_name"],
            registry=r,
        ).labels(**m)
        self.prefix_queried_tokens = Counter(
            PREFIX + "prefix_cache_queries",
            "Prompt tokens offered to the chain's prefix caches.",
            ["model_name"],
            registry=r,
        ).labels(**m)
        # speculative decoding (--speculative): draft tokens verified in chain steps, and those accepted
        self.drafted_tokens = Counter(
            PREFIX + "spec_decode_num_draft_tokens", "Draft tokens verified (speculative).", ["model_name"], registry=r
        ).labels(**m)
        self.accepted_draft_tokens = Counter(
            PREFIX + "spec_decode_num_accepted_tokens",
            "Draft tokens accepted (speculative).",
            ["model_name"],
            registry=r,
        ).labels(**m)

    def watch_client_head(self, head) -> None:
        """Export the client head's LM head batching (`ClientHead.logits_batched`, a RowBatcher that
        owns its counters; read when scraped): calls, the batches they were run in, and rows.
        Sessions per LM head batch = calls / batches: how well concurrent requests share the head."""
        self.registry.register(_RowBatcherCollector(head.logits_batched, self.model_name))

    def request(self, endpoint: str, status: int) -> None:
        self.http_requests.labels(endpoint=endpoint, status=str(status)).inc()

    def generation(
        self,
        *,
        prompt_tokens: int,
        completion_tokens: int,
        finish_reason: str,
        ttft_s: float | None,
        token_times_s: list[float],
        e2e_s: float,
        hops: int,
        failovers: int,
        prefix_hit_tokens: int,
        drafted_tokens: int = 0,
        accepted_draft_tokens: int = 0,
    ) -> None:
        """One finished session (one choice of a request)."""
        self.drafted_tokens.inc(drafted_tokens)
        self.accepted_draft_tokens.inc(accepted_draft_tokens)
        self.prompt_tokens.inc(prompt_tokens)
        self.prefix_queried_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.request_success.labels(
            finished_reason=FINISHED_REASON.get(finish_reason, finish_reason), **self._success_m
        ).inc()
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        for a, b in zip(token_times_s, token_times_s[1:]):
            self.itl.observe(b - a)
        self.e2e.observe(e2e_s)
        if hops:
            self.hops.observe(hops)
        self.failovers.inc(failovers)
        self.prefix_hit_tokens.inc(prefix_hit_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _RowBatcherCollector:
    def __init__(self, batcher, model_name: str):
        self.batcher = batcher
        self.model_name = model_name

    def describe(self):
        return []  # no fixed description: collected on scrape only

    def collect(self):
        b = self.batcher
        for name, doc, value in (
            ("client_head_lm_calls", "Sessions' calls of the client's LM head.", b.batched_calls),
            ("client_head_lm_batches", "Batched LM head runs those calls shared.", b.batches),
            ("client_head_lm_rows", "Rows (positions) the LM head computed.", b.rows),
        ):
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
