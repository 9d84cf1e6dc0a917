"""What this server's batches really cost: one `BatchService` record per batch the scheduler ran
(wall and CPU seconds, sessions, blocks, prefill and decode tokens and block-tokens), kept in a
bounded window and served by cursor in `rpc_info` (`InfoRequest.service_since_seq`), so the
orchestrator fits its service model from live service, not from a start-up guess.

CPU seconds are the process's (`time.process_time`: every thread, torch's intra-op pool included)
over the batch's wall interval; on CUDA the scheduler synchronizes before it stops the clock, so
the wall time is the kernels' and not their launch's.
"""

from __future__ import annotations

import threading
from collections import deque

from petals_chain.wire.records import BatchService

MAX_RECORDS = 512  # ~ the last minute of a busy server; the orchestrator polls every few seconds
MAX_REPLY_RECORDS = 256  # keeps rpc_info's metadata far below wire.MAX_METADATA_BYTES (~60 bytes each)


class ServiceMeter:
    def __init__(self, max_records: int = MAX_RECORDS):
        self._records: deque[BatchService] = deque(maxlen=max_records)
        self._lock = threading.Lock()
        self._next_seq = 0

    def on_batch(self, batch: dict) -> None:
        """The scheduler's per-batch record (server.scheduler: `items`, `service_s`, `cpu_s`, `blocks`)."""
        if not batch.get("ok", True):
            return  # a failed batch measures nothing about service
        items = batch["items"]  # [client_id, n_tokens, is_prefill]
        blocks = batch.get("blocks") or [0] * len(items)
        pre = [(n, b) for (_, n, is_prefill), b in zip(items, blocks) if is_prefill]
        dec = [(n, b) for (_, n, is_prefill), b in zip(items, blocks) if not is_prefill]
        with self._lock:
            self._records.append(
                BatchService(
                    seq=self._next_seq,
                    wall_s=float(batch["service_s"]),
                    cpu_s=float(batch.get("cpu_s", 0.0)),
                    sessions=len(items),
                    blocks=max(blocks, default=0),
                    prefill_tokens=sum(n for n, _ in pre),
                    decode_tokens=sum(n for n, _ in dec),
                    prefill_block_tokens=sum(n * b for n, b in pre),
                    decode_block_tokens=sum(n * b for n, b in dec),
                )
            )
            self._next_seq += 1

    def since(self, seq: int | None) -> list[BatchService] | None:
        """Records after `seq` (oldest first, at most MAX_REPLY_RECORDS: the newest); None for no cursor."""
        if seq is None:
            return None
        with self._lock:
            out = [r for r in self._records if r.seq > seq]
        return out[-MAX_REPLY_RECORDS:]

    def records(self) -> list[BatchService]:
        with self._lock:
            return list(self._records)
