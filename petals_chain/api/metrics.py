"""The gateway's counters, served as Prometheus text on `/metrics`."""
from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable

TTFT_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class GatewayMetrics:
    def __init__(self, clock: Callable[[], float] = time.monotonic, rate_window_s: float = 60.0):
        self.clock = clock
        self.rate_window_s = rate_window_s
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, int]] = Counter()  # (endpoint, HTTP status)
        self.finished: Counter[str] = Counter()  # finish_reason
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.ttft_buckets = [0] * len(TTFT_BUCKETS_S)
        self.ttft_sum_s = 0.0
        self.ttft_count = 0
        self.drafted_tokens = 0  # speculative decoding (--speculative): draft tokens verified, and accepted
        self.accepted_draft_tokens = 0
        self.active_sessions = 0
        self.waiting = 0
        self._recent: deque[tuple[float, int]] = deque()  # (finish time, completion tokens)

    def request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] += 1

    def generation(self, prompt_tokens: int, completion_tokens: int, ttft_s: float | None, finish_reason: str,
                   drafted_tokens: int = 0, accepted_draft_tokens: int = 0) -> None:
        with self._lock:
            self.drafted_tokens += drafted_tokens
            self.accepted_draft_tokens += accepted_draft_tokens
            self.finished[finish_reason] += 1
            self.prompt_tokens += prompt_tokens
            self.completion_tokens += completion_tokens
            if ttft_s is not None:
                self.ttft_sum_s += ttft_s
                self.ttft_count += 1
                for i, bound in enumerate(TTFT_BUCKETS_S):
                    if ttft_s <= bound:
                        self.ttft_buckets[i] += 1
            self._recent.append((self.clock(), completion_tokens))

    def tokens_per_s(self) -> float:
        """Completion tokens of requests finished within the last `rate_window_s`, per second."""
        now = self.clock()
        with self._lock:
            while self._recent and now - self._recent[0][0] > self.rate_window_s:
                self._recent.popleft()
            return sum(n for _, n in self._recent) / self.rate_window_s

    def render(self) -> str:
        rate = self.tokens_per_s()
        p = "petals_chain_api"
        with self._lock:
            lines = [f"# TYPE {p}_requests_total counter"]
            lines += [f'{p}_requests_total{{endpoint="{e}",status="{s}"}} {n}' for (e, s), n in sorted(self.requests.items())]
            lines.append(f"# TYPE {p}_finished_total counter")
            lines += [f'{p}_finished_total{{finish_reason="{r}"}} {n}' for r, n in sorted(self.finished.items())]
            lines += [f"# TYPE {p}_prompt_tokens_total counter", f"{p}_prompt_tokens_total {self.prompt_tokens}",
                      f"# TYPE {p}_completion_tokens_total counter", f"{p}_completion_tokens_total {self.completion_tokens}",
                      f"# TYPE {p}_drafted_tokens_total counter", f"{p}_drafted_tokens_total {self.drafted_tokens}",
                      f"# TYPE {p}_accepted_draft_tokens_total counter",
                      f"{p}_accepted_draft_tokens_total {self.accepted_draft_tokens}",
                      f"# TYPE {p}_time_to_first_token_seconds histogram"]
            lines += [f'{p}_time_to_first_token_seconds_bucket{{le="{b}"}} {n}' for b, n in zip(TTFT_BUCKETS_S, self.ttft_buckets)]
            lines += [f'{p}_time_to_first_token_seconds_bucket{{le="+Inf"}} {self.ttft_count}',
                      f"{p}_time_to_first_token_seconds_sum {self.ttft_sum_s:.6f}",
                      f"{p}_time_to_first_token_seconds_count {self.ttft_count}",
                      f"# TYPE {p}_tokens_per_second gauge", f"{p}_tokens_per_second {rate:.3f}",
                      f"# TYPE {p}_active_sessions gauge", f"{p}_active_sessions {self.active_sessions}",
                      f"# TYPE {p}_waiting_requests gauge", f"{p}_waiting_requests {self.waiting}"]
        return "\n".join(lines) + "\n"
