"""Per-block compute times the orchestrator plans with (paper footnote 11), measured at start.

`t_I` (prefill seconds per token per block) and `t_O` (decode seconds per token per block) are
measured on one block of the loaded range and cached per model/device/dtype/quantization/threads
in `<cache>/throughput.json`, so a restart does not measure again.
"""
from __future__ import annotations

import fcntl
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from petals_chain.models.checkpoint import cache_dir
from petals_chain.runtime.block_range import BlockRange, StepInput


@dataclass(frozen=True)
class BlockTimes:
    prefill_s_per_token: float  # t_I
    decode_s_per_token: float  # t_O


def measure_block_times(block_range: BlockRange, *, prefill_tokens: int = 128, decode_steps: int = 16,
                        repeats: int = 3) -> BlockTimes:
    """Median over `repeats` of a prefill and of decode steps through one block (a session entering
    at the range's last block runs only that block)."""
    prefill, decode = [], []
    gen = torch.Generator().manual_seed(0)
    device = torch.device(block_range.device)

    def sync() -> None:  # GPU work is asynchronous: a clock read before it finishes times the launch
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for repeat in range(repeats + 1):  # the first round warms up (kernel selection, allocations): not timed
        kv = block_range.allocate_kv(prefill_tokens + decode_steps, first_block=block_range.end - 1)
        x = torch.randn(prefill_tokens, block_range.hidden_size, generator=gen).to(device, block_range.dtype)
        sync()
        t0 = time.perf_counter()
        block_range.forward([StepInput(kv, x)])
        sync()
        t1 = time.perf_counter()
        for _ in range(decode_steps):
            block_range.forward([StepInput(kv, x[:1])])
        sync()
        if repeat > 0:
            prefill.append((t1 - t0) / prefill_tokens)
            decode.append((time.perf_counter() - t1) / decode_steps)
    return BlockTimes(sorted(prefill)[len(prefill) // 2], sorted(decode)[len(decode) // 2])


def cached_block_times(block_range: BlockRange, model_name: str, *, path: Path | None = None,
                       variant: str = "") -> BlockTimes:
    """`variant` tells apart ranges that time differently on the same device (an emulated slowdown)."""
    path = path or cache_dir() / "throughput.json"
    key = "|".join([model_name, str(block_range.device), str(block_range.dtype).removeprefix("torch."),
                    block_range.quant, f"threads={torch.get_num_threads()}", *([variant] if variant else [])])
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cache = json.loads(path.read_text()) if path.is_file() else {}
        if key in cache:
            return BlockTimes(**cache[key])
        times = measure_block_times(block_range)
        cache[key] = asdict(times)
        path.write_text(json.dumps(cache, indent=2, sort_keys=True))
        return times
