"""`--service-log PATH`: one JSON line per batch the scheduler ran, for fairness measurements.

Each line: `{"t_s": start (monotonic s), "service_s": batch wall time (on CUDA after a synchronize),
"cpu_s": CPU seconds of the server process during the batch, "ok": bool,
"items": [[client_id, n_tokens, is_prefill], ...], "blocks": [blocks each item's step ran, ...], "backlogged": [client
ids with steps still
waiting while the batch ran], "waiting_for_memory": [client ids with a session waiting in the
admission queue], "counters": {client_id: weighted service the policy charged}}`.
`scripts/bench_fairness.py` reads it to measure service gaps between backlogged clients.
"""

from __future__ import annotations

import json
import threading


class ServiceLog:
    def __init__(self, path: str):
        self._file = open(path, "a", buffering=1, encoding="utf-8")  # line-buffered: readable while running
        self._lock = threading.Lock()

    def write(self, record: dict) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        with self._lock:
            self._file.close()
