"""The start-up profile: what a step through this server's whole hosted range costs, measured through
the server's real step path (a `StepScheduler` batch over `BlockRange.forward`, CUDA synchronized),
warm-up excluded, and fitted with the orchestrator's own service model
(petals_chain.algorithms.service_fit.fit_service: wall = t_o + t_I P + t_O D per batch, P and D the
prefill and decode block-tokens).

Timed by wall seconds on CUDA (the device's speed), by CPU seconds otherwise (`profile_clock`: a
profile taken while other work shares the cores must not measure the neighbours and then live on in
the cache), and under a CPU quota by CPU seconds divided by the quota in cores ("cpu/share"): a host
with a quarter of a core serves a sustained load at a quarter of a core's speed, while the short
batches of a profile run at full speed until the period's quota is spent, so their wall time would
announce a device several times faster than the one the live batches then show (measured: 1.08 ms
per block-token announced at a 0.19 share, about 5 ms per block-token served).

Why not one block in a tight loop (the former profile): its weights stay in the CPU's cache, while a
real step streams every block's weights (x1.3-1.6 on the project machine), and it saw no per-step
overhead at all. Prefills of two lengths and decode steps entering at two blocks make t_o, t_I and
t_O separable.

The profile is cached in `<cache>/throughput.json` under a key of model, device, dtype, quantization,
block count, torch threads and the process's CPU quota (an emulated host's share: netem/cpu.py), so
servers of another speed never share an entry; `forget_profile` drops an entry the live service
contradicted, so the next start measures again instead of trusting it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from netem.cpu import own_cpu_share
from petals_chain.models.checkpoint import cache_dir

logger = logging.getLogger(__name__)

# v2: oneDNN-packed linears (a faster step); v3: t_B fitted apart and the lone step announced (see
# `RangeProfile.lone_decode_s_per_block`); older and unversioned entries are never read
PROFILE_VERSION = "range-v3"


@dataclass(frozen=True)
class RangeProfile:
    prefill_s_per_token: float  # t_I, per block
    decode_s_per_token: float  # t_O, per block and decode row: what each further session in a batch adds
    step_overhead_s: float  # t_o, per step of this server whatever its blocks
    blocks: int
    batches: int  # measured batches the fit used (warm-up excluded)
    step_block_s: float = 0.0  # t_B, per block and step whatever its rows (the weights' cost)

    @property
    def lone_step_s(self) -> float:
        """One session's decode step through the whole range: t_o + m (t_B + t_O)."""
        return self.step_overhead_s + self.blocks * (self.step_block_s + self.decode_s_per_token)

    @property
    def lone_decode_s_per_block(self) -> float:
        """What the server announces as its t_O (the paper's: one session's decode seconds per token and
        block): the lone step over the range's blocks.

        Why not the fitted t_O: a CPU step of 1 to 3 rows costs about one row's (oneDNN-packed
        linears), so the marginal t_O per row is a fraction of a lone step, and without t_B the fit
        put the rest in t_o. Announced alone it read the same on hosts of 0.193 and 0.120 cores
        (a Table 1 quick run, docs/results.md: 1.35 and 1.35 ms) while their lone steps differ by their
        shares; the orchestrator then planned slow servers from a fast twin's fit."""
        return self.lone_step_s / self.blocks


def profile_key(model_name: str, block_range, variant: str = "") -> str:
    share = own_cpu_share()  # an emulated host's CPU share (netem/cpu.py) makes another device
    return "|".join(
        [
            PROFILE_VERSION,
            model_name,
            str(block_range.device),
            str(block_range.dtype).removeprefix("torch."),
            block_range.quant,
            f"blocks={block_range.end - block_range.start}",
            f"threads={torch.get_num_threads()}",
            f"cpu={'all' if share is None else f'{share:.3f}'}",
            f"clock={profile_clock(block_range)}",
            *([variant] if variant else []),
        ]
    )


def profile_clock(block_range) -> str:
    """What the profile times: "wall" on CUDA (the device's speed is what a batch takes there),
    "cpu/share" under a CPU quota (CPU seconds / the quota's cores: the sustained speed of that share,
    see the module's docstring), else "cpu" (the process's CPU seconds: on a CPU shared with other
    work, wall time would measure the neighbours; a profile taken during an overload must not outlive
    it)."""
    if torch.device(block_range.device).type == "cuda":
        return "wall"
    return "cpu" if own_cpu_share() is None else "cpu/share"


def profile_seconds(wall_s: float, cpu_s: float, clock: str, share_cores: float | None) -> float:
    """What one profiled batch counts as by `clock` (see `profile_clock`)."""
    if clock == "wall":
        return wall_s
    if clock == "cpu":
        return cpu_s
    if clock == "cpu/share":
        if not share_cores or share_cores <= 0:
            raise ValueError("clock 'cpu/share' needs the process's CPU quota in cores (> 0)")
        return cpu_s / share_cores
    raise ValueError(f"unknown profile clock {clock!r}: 'wall', 'cpu' or 'cpu/share'")


def measure_range(
    block_range,
    *,
    prefill_tokens: tuple[int, int] = (16, 64),
    decode_steps: int = 4,
    repeats: int = 3,
    clock: str = "wall",
) -> RangeProfile:
    """Prefills of two lengths from the first block, decode steps entering at the first and at the
    middle block, `repeats` times, through a StepScheduler batch each (after one warm-up round that
    is not counted); the fit of the batches' seconds by `clock` (`profile_seconds`)."""
    from petals_chain.algorithms.service_fit import fit_service
    from server.policies import make_policy
    from server.scheduler import StepScheduler
    from server.service_meter import ServiceMeter
    from server.step_request import StepRequest

    start, end = block_range.start, block_range.end
    entries = sorted({start, (start + end) // 2})
    gen = torch.Generator().manual_seed(0)
    device = torch.device(block_range.device)
    failures: list[BaseException] = []

    def deliver(_out, err):
        if err is not None:
            failures.append(err)

    def step(scheduler: StepScheduler, kv, x) -> None:  # one batch: submitted, then run on this thread
        scheduler.submit(StepRequest(kv, x, key="profile", client_id="profile"), deliver)
        while scheduler.run_once():
            pass

    def batched_decode(scheduler: StepScheduler, n: int) -> None:
        """One batch of `n` sessions' decode steps: with a single block, decode block-tokens vary only
        with the batch size, and without that variation t_o and t_O cannot be told apart."""
        x = torch.randn(1, block_range.hidden_size, generator=gen).to(device, block_range.dtype)
        kvs = [block_range.allocate_kv(3, first_block=start) for _ in range(n)]
        for kv in kvs:
            step(scheduler, kv, x)  # each session's first token
        for i, kv in enumerate(kvs):
            scheduler.submit(StepRequest(kv, x, key=f"profile-{i}", client_id="profile"), deliver)
        while scheduler.run_once():
            pass

    def round_(scheduler: StepScheduler) -> None:
        for n in prefill_tokens:
            kv = block_range.allocate_kv(n + 1, first_block=start)
            step(scheduler, kv, torch.randn(n, block_range.hidden_size, generator=gen).to(device, block_range.dtype))
        for first in entries:
            kv = block_range.allocate_kv(1 + decode_steps, first_block=first)
            x = torch.randn(1, block_range.hidden_size, generator=gen).to(device, block_range.dtype)
            for _ in range(1 + decode_steps):  # the first token is a 1-token prefill, then decode steps
                step(scheduler, kv, x)
        batched_decode(scheduler, 3)

    meter = ServiceMeter()
    warm = StepScheduler(block_range, make_policy("fcfs"), start_thread=False)
    round_(warm)  # weights paged in, allocator warmed: not counted
    sched = StepScheduler(block_range, make_policy("fcfs"), start_thread=False, on_batch=meter.on_batch)
    for _ in range(repeats):
        round_(sched)
    warm.stop()
    sched.stop()
    if failures:
        raise failures[0]
    recs = [r for r in meter.records() if r.decode_block_tokens or r.prefill_tokens > 1]
    share = own_cpu_share()
    # with sessions and blocks, as the orchestrator fits live service: the lone steps (entering at two
    # blocks) anchor t_o and t_B, the 3-session batch the marginal t_O
    fit = fit_service(
        [r.prefill_block_tokens for r in recs],
        [r.decode_block_tokens for r in recs],
        [profile_seconds(r.wall_s, r.cpu_s, clock, share) for r in recs],
        sessions=[r.sessions for r in recs],
        blocks=[r.blocks for r in recs],
    )
    if fit is None or fit.t_I_s is None:
        raise RuntimeError(
            f"the start-up profile of blocks [{start}, {end}) could not be fitted from "
            f"{len(recs)} batches; check the range loads and runs"
        )
    return RangeProfile(fit.t_I_s, fit.t_O_s, fit.t_o_s, end - start, fit.samples, step_block_s=fit.t_B_s)


def _cache_path(path: Path | None) -> Path:
    return path or cache_dir() / "throughput.json"


def cached_range_profile(block_range, model_name: str, *, path: Path | None = None, variant: str = "") -> RangeProfile:
    """The cached profile of this range's shape on this device and CPU share, or a fresh measurement
    (then cached). `variant` tells apart ranges that time differently on the same device."""
    path = _cache_path(path)
    key = profile_key(model_name, block_range, variant)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cache = json.loads(path.read_text()) if path.is_file() else {}
        if key in cache:
            # say where it came from: a timing read from the cache is not this start's measurement
            print(
                f"start-up profile from the cache {path} (measured at an earlier start as {key!r}); remove "
                "that entry or the file to measure again",
                file=sys.stderr,
                flush=True,
            )
            return RangeProfile(**cache[key])
        prof = measure_range(block_range, clock=profile_clock(block_range))
        cache[key] = asdict(prof)
        path.write_text(json.dumps(cache, indent=2, sort_keys=True))
        return prof


def forget_profile(block_range, model_name: str, *, path: Path | None = None, variant: str = "") -> bool:
    """Drop the cached entry of this range (the live service disagreed with it): the next start measures."""
    path = _cache_path(path)
    key = profile_key(model_name, block_range, variant)
    if not path.is_file():
        return False
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cache = json.loads(path.read_text())
        if cache.pop(key, None) is None:
            return False
        path.write_text(json.dumps(cache, indent=2, sort_keys=True))
        return True


def disagrees(
    profile: RangeProfile, live_lone_step_s: float, live_samples: int, *, factor: float = 2.0, min_samples: int = 50
) -> bool:
    """Whether live service contradicts the cached profile: a lone decode step through the range more
    than `factor` times slower or faster. The lone step, not t_O: how a fit splits a step between
    t_o, t_B and t_O depends on the batches it saw, the whole step does not.

    Why a factor of 2 (it was +-50 %): under load a lone step's CPU time grows (a full Table 1 run,
    docs/results.md: 1.45-1.77x the profile's on 13 of 18 servers, in CPU seconds per share as in wall
    seconds, so not the quota's throttling), the orchestrator's live fit follows that, and a profile
    measured again would read the same as before: dropping it only cost each next start a minute. The
    check is for a profile taken in a bad moment (one measured during an overload read 5x)."""
    ratio = live_lone_step_s / profile.lone_step_s
    return live_samples >= min_samples and not 1.0 / factor <= ratio <= factor
