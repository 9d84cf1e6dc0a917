"""`petals-chain experiment table1`: the paper's Table 1 (§4.2) on a live swarm.

For each policy, on a fresh swarm (DHT peer, `petals-chain orchestrator --policy P`, 9 `launch-server
--blocks auto` servers: 3 fast with the larger memory budget, 6 slow with the smaller one and an
emulated slowdown), in emulated WAN hosts (netem, RIPE Atlas RTTs) or on localhost (`--no-netem`),
the load generator replays the scaled Azure code trace; records, the summary table, a CDF plot and
the model check go to `--out`.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from experiments import report, workload
from experiments.cpu import CpuMeter

# Thread bounds for every process: 9 servers must not thrash a few cores.
THREAD_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
PETALS_22 = "petals-2.2"  # the real PETALS 2.2 column (experiments/petals22.py)
SLOW_OVER_FAST = 175.0 / 109.0  # the paper's slow/fast per-block time (§4.1.1: 175 ms vs 109 ms)
FITS_SETTLED_S = 8.0  # no new batch record for this long after the warm-up: 4 of the orchestrator's 2 s reads


@dataclass
class Table1Config:
    requests: int = 250  # the paper: 1,000 (about 3.5 h here for five columns; 250 fit an hour)
    policies: tuple[str, ...] = ("proposed", "petals", "bprr", "jffc-only")
    servers: int = 9
    fast_servers: int = 3
    seed: int = 0
    offset: int = 0
    time_scale: float | None = None  # None: auto (workload.auto_time_scale)
    length_scale: float = 1 / 16
    output_scale: float = 1.0
    max_length_tokens: int = 1024
    target_load: float = 0.5
    n_cpus: float = 2.0
    step_overhead_cpu_s: float = 0.02
    fast_budget: str = "480MiB"
    slow_budget: str = "240MiB"
    slow_slowdown: float = SLOW_OVER_FAST
    rho_bar: float = 0.7
    netem: bool = True
    netem_backend: str = "auto"
    netem_name: str = ""  # the emulated network's name ("" -> a fresh one per run: runs side by side never clash)
    model: str = "smollm2-135m"
    data: str | None = None
    rtt_data: str | None = None
    out: str = "results/table1"
    petals_work: str | None = None  # PETALS 2.2 environment built by ../shared/anchors/petals_2_2_cpu.sh
    # compute isolation (netem/cpu.py): "auto" (shares when netem runs on CPU with writable cgroups),
    # "off", or a spec: 0.25 for every host, or fast=0.2,slow=0.12,client=0.5 (roles or host names)
    cpu: str = "auto"
    # a server host's hivemind DHT process and p2p daemon: outside its CPU share (False, the default: a real
    # host runs them on its own CPU beside the device the share stands for; netem/cpu.py) or inside (True)
    daemons_in_share: bool = False
    # the servers' --max-batch-tokens: one batched forward's token budget, longer prompts run in chunks
    # interleaved with other sessions' decode steps (chunked prefill; 2048, the servers' default, never cuts
    # a prompt of this experiment's --max-length 1024)
    max_batch_tokens: int = 2048
    device: str = "cpu"  # the servers' --device (cuda: the GPU variant)
    dtype: str = "float32"  # the servers' --dtype (bfloat16 for the GPU variant)
    # the GPU variant's isolation (experiments/gpu_mps.py): "off" (the processes time-slice the GPU) or
    # "mps" (one MPS daemon for the run; each process capped at gpu_sm_percent of the SMs)
    gpu_isolation: str = "off"
    gpu_sm_percent: float = 100 / 3
    # calibration warm-up before the replay: this many sessions per placed server (not counted), then the
    # orchestrator may re-plan once from the model fitted on them (0: plan from the start-up profile only)
    warmup_per_chain: int = 2
    warmup_timeout_s: float = 240.0
    # the auto time scale's W measured in an earlier run's results folder instead of footnote 11's estimate
    calibrate_from: str | None = None
    leftover_placement: bool = False  # the orchestrator's --leftover-placement (proposed: idle servers get blocks)
    # the orchestrator's --kv-plan-tokens: "max" (the servers' --max-length), "auto" (the replayed
    # requests' 95th percentile of prompt + output tokens) or a number of tokens
    kv_plan_tokens: str = "max"
    server_compute: str = "auto"  # the orchestrator's --server-compute (auto, shared, parallel)
    # the model probe after the replay: this many sessions per chain of the final plan, one after another
    # (each alone in the system: the model check's lone requests), counted nowhere else (0: none)
    probe_per_chain: int = 1
    probe_timeout_s: float = 600.0
    deadline_s: float = 600.0
    command: str = ""
    # run `policies` as further columns of the run recorded in `out` (experiments/run.py: extend_base)
    extend: bool = False
    extra: dict = field(default_factory=dict)


def server_names(cfg: Table1Config) -> list[str]:
    return [f"fast{i}" if i < cfg.fast_servers else f"slow{i - cfg.fast_servers}" for i in range(cfg.servers)]


CLIENT_CPU_SHARE = 0.5  # the client host: DHT peer, orchestrator, load generator (embeddings, LM head)
HEADROOM = 0.9  # of the cores: the delay hub and the kernel need some too


def cpu_shares(cfg: Table1Config) -> tuple[dict[str, float] | None, str]:
    """Host -> CPU share (cores) and why. With shares, slow servers are slow by their share (fast share /
    slow_slowdown) and run no --emulate-slowdown: a CPU quota makes an emulated host an independent
    device of a stated speed, as a MIG slice is, where sleeping after each batch (the emulation) left
    all servers competing for the same cores. Without them (no netem, a CUDA device, cgroups not
    writable, --cpu off) the emulated slowdown stays: a CPU quota does not slow GPU kernels."""
    hosts = ["client", *server_names(cfg)]
    if cfg.cpu == "off":
        return None, "--cpu off: hosts share the machine's cores; slow servers by --emulate-slowdown"
    if not cfg.netem:
        return None, "no CPU shares without netem hosts (--no-netem); slow servers by --emulate-slowdown"
    if cfg.device != "cpu":
        return (
            None,
            f"no CPU shares on {cfg.device}: a CPU quota does not slow GPU kernels; slow servers by --emulate-slowdown",
        )
    if cfg.cpu == "auto":
        from netem import cpu as netem_cpu

        try:
            why = netem_cpu.writable(netem_cpu.detect())
        except netem_cpu.CpuLimitUnavailableError as e:
            why = str(e)
        if why:
            return None, f"no CPU shares ({why}); slow servers by --emulate-slowdown"
        n_fast = cfg.fast_servers
        n_slow = cfg.servers - n_fast
        # fast f, slow f / ratio, client 0.5: together HEADROOM of the cores, so no host waits for another
        fast = (HEADROOM * cfg.n_cpus - CLIENT_CPU_SHARE) / (n_fast + n_slow / cfg.slow_slowdown)
        if fast <= 0.02:
            return (
                None,
                f"{cfg.n_cpus:g} cores are too few for {cfg.servers} servers' shares; slow servers by "
                f"--emulate-slowdown",
            )
        shares = {"client": CLIENT_CPU_SHARE, "fast": min(1.0, fast), "slow": min(1.0, fast) / cfg.slow_slowdown}
        default = None
    else:
        from netem.cpu import parse_shares

        default, shares = parse_shares(cfg.cpu)
    out = {}
    for h in hosts:
        role = "client" if h == "client" else ("fast" if h.startswith("fast") else "slow")
        share = shares.get(h, shares.get(role, default))
        if share is not None:
            out[h] = float(share)
    return out or None, "CPU shares per host (cores): " + ", ".join(f"{h}={v:.3f}" for h, v in out.items())


def server_args(cfg: Table1Config, shares: dict[str, float] | None = None) -> list[list[str]]:
    dev = (
        ["--max-batch-tokens", str(cfg.max_batch_tokens)]
        + ([] if cfg.device == "cpu" else ["--device", cfg.device])
        + ([] if cfg.dtype == "float32" else ["--dtype", cfg.dtype])
    )
    if shares:  # a host at a fraction of a core announces late when busy: a 15 s record, not 6 s, so the
        dev = dev + ["--announce-period", "5"]  # orchestrator does not drop a starved server as gone
    out = []
    for n in server_names(cfg):
        if n.startswith("fast"):
            out.append(["--memory-budget", cfg.fast_budget, *dev])
        elif shares and n in shares:  # slow by its smaller CPU share
            out.append(["--memory-budget", cfg.slow_budget, *dev])
        else:
            out.append(["--memory-budget", cfg.slow_budget, "--emulate-slowdown", f"{cfg.slow_slowdown:.4f}", *dev])
    return out


def measured_block_times(model: str, device: str = "cpu", dtype: str = "float32"):
    """t_I, t_O (and t_o per step) of the whole model's range through the servers' real step path with
    1 thread: the servers' own start-up profile (server/range_profile.py, cached in the same file)."""
    import torch

    from petals_chain.models.checkpoint import load_config, resolve_model_path
    from petals_chain.runtime.block_range import BlockRange
    from server.range_profile import cached_range_profile

    torch.set_num_threads(1)
    path = resolve_model_path(model)
    n = load_config(path).num_hidden_layers
    return cached_range_profile(BlockRange(path, 0, n, device=device, dtype=dtype, model_path=path), model), path


class CalibrationError(ValueError):
    """An earlier run's folder cannot give the CPU cost of a request."""


def measured_cpu_s_per_request(folder: str | Path, servers_only: bool) -> tuple[float, str]:
    """W measured in an earlier run (`--calibrate-from DIR`): CPU seconds used during its replay per
    finished request, of the first policy among proposed, jffc-only, bprr, petals that ran there.
    With CPU shares only the server hosts count (the capacity W is divided by is their shares);
    without, all our processes (the capacity is the machine's cores)."""
    folder = Path(folder)
    for policy in ("proposed", "jffc-only", "bprr", "petals"):
        run_file, rec_file = folder / f"run_{policy}.json", folder / f"records_{policy}.jsonl"
        if not (run_file.exists() and rec_file.exists()):
            continue
        run = json.loads(run_file.read_text())
        done = sum(report.finished(r) for r in report.read_records(rec_file))
        if not done:
            continue
        servers_cpu = report.server_hosts_cpu_s(run.get("host_cpu"))
        if servers_only and servers_cpu is not None:
            used, what = servers_cpu, "the server hosts' CPU"
        elif not servers_only and (run.get("cpu") or {}).get("ours_cpu_s") is not None:
            used = run["cpu"]["ours_cpu_s"]
            what = "our processes' CPU"
        else:
            continue
        return used / done, (
            f"W = {used / done:.2f} CPU-s per request measured in {folder} ({policy}: {what} "
            f"during the replay, {used:.0f} CPU-s / {done} finished requests)"
        )
    raise CalibrationError(
        f"--calibrate-from {folder}: no run_<policy>.json with "
        f"{'per-host CPU (host_cpu)' if servers_only else 'CPU use'} "
        f"and finished records there; give the folder of an earlier `petals-chain experiment table1 --out` run "
        f"{'with CPU shares' if servers_only else 'without CPU shares'}"
    )


def choose_scale(cfg: Table1Config, trace, num_blocks: int, times) -> tuple[workload.Scale, dict]:
    """The stated factors; with no --time-scale, auto_time_scale at --target-load of the CPUs, with W
    estimated by footnote 11 or (--calibrate-from) measured in an earlier run."""
    probe = workload.Scale(1.0, cfg.length_scale, cfg.output_scale, cfg.max_length_tokens)
    reqs = workload.scale_requests(trace, cfg.requests, probe, offset=cfg.offset)
    s = workload.summary(reqs)
    hops = 1 + (cfg.servers - cfg.fast_servers) / cfg.servers  # rough mean chain length, for the overhead term
    w = workload.cpu_s_per_request(
        times.prefill_s_per_token,
        times.lone_decode_s_per_block,
        num_blocks,
        s["mean_input_tokens"],
        s["mean_output_tokens"],
        step_overhead_cpu_s=cfg.step_overhead_cpu_s,
        hops=hops,
    )
    shares, _ = cpu_shares(cfg)
    # with shares the servers' compute is what their shares add up to, not the machine's cores
    capacity = sum(v for h, v in shares.items() if h != "client") if shares else cfg.n_cpus
    estimate = w
    if cfg.time_scale is None and cfg.calibrate_from:
        w, measured = measured_cpu_s_per_request(cfg.calibrate_from, servers_only=bool(shares))
        reason = (
            f"time scale auto from measured service: {measured}; footnote 11 estimated {estimate:.2f}; "
            f"target CPU load {cfg.target_load} of {capacity:.2f} cores "
            f"({'the servers CPU shares' if shares else 'the machine'})."
        )
    elif cfg.time_scale is None:
        reason = (
            f"time scale auto: W = {w:.2f} CPU-s per request (footnote 11 with t_I = "
            f"{times.prefill_s_per_token * 1e3:.3f} ms, t_O = {times.lone_decode_s_per_block * 1e3:.3f} ms per token "
            f"per block measured through the whole range's step path on 1 thread, L = {num_blocks}, "
            f"+ {cfg.step_overhead_cpu_s * 1e3:.0f} ms per step and hop), target CPU load {cfg.target_load} of "
            f"{capacity:.2f} cores ({'the servers CPU shares' if shares else 'the machine'})."
        )
    else:
        reason = "time scale given by --time-scale."
    ts = (
        cfg.time_scale
        if cfg.time_scale is not None
        else workload.auto_time_scale(s["rate_per_s"], w, capacity, cfg.target_load)
    )
    scale = workload.Scale(ts, cfg.length_scale, cfg.output_scale, cfg.max_length_tokens)
    scaled = workload.scale_requests(trace, cfg.requests, scale, offset=cfg.offset)
    info = {
        **scale.to_dict(),
        **workload.summary(scaled),
        "offset": cfg.offset,
        "trace_rate_per_s": s["rate_per_s"],
        "trace_interarrival_cv": s["interarrival_cv"],
        "cpu_s_per_request_estimate": w,
        "cpu_s_per_request_footnote11": estimate,
        "cpu_s_per_request_measured_in": cfg.calibrate_from,
        "offered_cpu_load_estimate": workload.offered_load(
            workload.rate_per_s([r.arrival_s for r in scaled]), w, capacity
        ),
        "peak_window_s": workload.PEAK_WINDOW_S,
        "peak_offered_cpu_load_estimate": workload.peak_offered_load([r.arrival_s for r in scaled], w, capacity),
        "server_cpu_capacity": capacity,
        "cpu_shares": shares,
        "cpu_shares_reason": cpu_shares(cfg)[1],
        "time_scale_reason": reason,
        "slow_servers_emulated_slowdown": None if shares else cfg.slow_slowdown,
        "fast_budget": cfg.fast_budget,
        "slow_budget": cfg.slow_budget,
    }
    return scale, {**info, "_requests": scaled}


def make_launcher(cfg: Table1Config, rtt_ms):
    if not cfg.netem:
        from experiments.hosts import Localhost

        return Localhost()
    from experiments.hosts import EmulatedHosts

    return EmulatedHosts(
        server_names(cfg),
        rtt_ms,
        backend=cfg.netem_backend,
        name=cfg.netem_name or f"t1{uuid.uuid4().hex[:5]}",
        cpu=cpu_shares(cfg)[0],
    )


def server_models(status: dict) -> dict:
    """Per server name, the orchestrator's model from its /status: t_I, t_O (fitted when it had live
    batches), t_o per step (fitted; None: the per-block default), per-hop cost, RTT, tau_p, tau_c."""
    return {
        s["name"]: {
            "t_I": s["t_I"],
            "t_O": s["t_O"],
            "t_o": s.get("t_o"),
            "t_B": s.get("t_B"),
            "hop_cost_s": s.get("hop_cost"),
            "transfer_s_per_token": s.get("transfer_s_per_token"),
            "rtt_s": s["rtt"],
            "tau_p": s["tau_p"],
            "tau_c": s["tau_c"],
            "memory": s["memory"],
            "model_source": (s.get("model") or {}).get("source", "announced"),
        }
        for s in status["servers"]
    }


def host_cpu_use(after: dict, before: dict, wall_s: float) -> dict:
    """Per host with a share: the share and the cores it used during the replay (measured by its cgroup)."""
    out = {}
    for h, a in after.items():
        b = before.get(h, {})
        used = None if a.get("cpu_s") is None or b.get("cpu_s") is None else a["cpu_s"] - b["cpu_s"]
        held = (
            None
            if a.get("throttled_s") is None or b.get("throttled_s") is None
            else a["throttled_s"] - b["throttled_s"]
        )
        daemons = (
            None
            if a.get("daemons_cpu_s") is None or b.get("daemons_cpu_s") is None
            else a["daemons_cpu_s"] - b["daemons_cpu_s"]
        )
        out[h] = {
            "share_cores": a["cores"],
            "cpuset": a.get("cpuset"),
            "cpu_s": used,
            "used_cores": None if used is None or wall_s <= 0 else used / wall_s,
            "throttled_s": held,
            "daemons_cores": None if daemons is None or wall_s <= 0 else daemons / wall_s,
        }
    return out


def start_loadgen(
    cfg: Table1Config, launcher, swarm, req_file: Path, rec_file: Path, policy: str, extra_args: tuple[str, ...] = ()
) -> subprocess.Popen:
    return launcher.popen(
        "loadgen",
        [
            sys.executable,
            "-m",
            "experiments.loadgen",
            "--initial-peers",
            *swarm.initial_peers,
            "--model",
            cfg.model,
            "--dtype",
            cfg.dtype,
            "--device",
            cfg.device,
            "--requests",
            str(req_file),
            "--out",
            str(rec_file),
            "--policy",
            policy,
            "--seed",
            str(cfg.seed),
            "--deadline",
            str(cfg.deadline_s),
            *extra_args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**swarm.env},
        start_new_session=True,
    )


def stop_loadgen(gen: subprocess.Popen | None) -> None:
    """Kill a load generator still running (its own process group: it runs in a session of its own, so
    a SIGTERM to the experiment does not reach it). Called before its swarm stops: a load generator left
    running records its requests in flight as failed by servers that were only being torn down."""
    if gen is None or gen.poll() is not None:
        return
    try:
        os.killpg(gen.pid, signal.SIGKILL)
    except ProcessLookupError:  # it ended between poll() and killpg
        pass
    gen.wait(timeout=30)


def calibration_warmup(cfg: Table1Config, launcher, swarm, status: dict, requests, out_dir: Path, policy: str) -> dict:
    """Run `warmup_per_chain` sessions per placed server (the trace's first requests, 1 s apart; records go
    to warmup_<policy>.jsonl and count nowhere), wait until the orchestrator's fits from them are final
    (every placed server fitted, or no new batch to read), then give it its one re-plan from the calibrated model (hold
    5 s) and wait for that plan
    to be online. Returns the /status the replay starts from."""
    # per placed server, not per chain: JFFC sends the first sessions to the fastest chains, and a
    # per-request router has no chains yet; every placed server should see some of them
    n = max(1, cfg.warmup_per_chain * sum(1 for s in status["servers"] if s["end"] > s["start"]))
    warm = [{**r.to_dict(), "arrival_s": float(i)} for i, r in enumerate(requests[:n])]
    req_file, rec_file = out_dir / f"warmup_requests_{policy}.json", out_dir / f"warmup_{policy}.jsonl"
    req_file.write_text(json.dumps(warm))
    url = swarm.orchestrator_url
    v0 = status["plan_version"]
    print(f"[{policy}] calibration warm-up: {n} sessions ...", flush=True)
    gen = start_loadgen(cfg, launcher, swarm, req_file, rec_file, f"{policy}-warmup")
    try:
        gen.communicate(timeout=cfg.warmup_timeout_s)
    except subprocess.TimeoutExpired:
        stop_loadgen(gen)  # its whole process group, as on an interrupt
        gen.communicate()
    finally:
        stop_loadgen(gen)
    deadline = time.monotonic() + cfg.warmup_timeout_s
    counts, settled_since = None, time.monotonic()
    while time.monotonic() < deadline:  # fitted: every placed server's model is live, or the plan moved, or
        st = launcher.fetch_json("orchestrator", url + "status")  # the fits are final (below)
        placed = [s for s in st["servers"] if s["end"] > s["start"]]
        if st["plan_version"] > v0 or all((s.get("model") or {}).get("source") == "live" for s in placed):
            break
        # The warm-up is over, so no batch comes after it: once no placed server's batch count moved for
        # FITS_SETTLED_S (the orchestrator reads them every 2 s and refits then), the fits are final. A
        # server that JFFC's routing gave too few batches to fit (or none) stays on its start-up profile
        # however long we wait: waiting for it spent the whole warmup_timeout_s (240 s) for nothing.
        now_counts = {s["peer_id"]: (s.get("model") or {}).get("batches") for s in placed}
        if now_counts != counts:
            counts, settled_since = now_counts, time.monotonic()
        elif time.monotonic() - settled_since >= FITS_SETTLED_S:
            break
        time.sleep(2.0)
    t_fit = time.monotonic()
    while time.monotonic() - t_fit < 45.0:  # the trigger holds 5 s and checks every 10 s
        st = launcher.fetch_json("orchestrator", url + "status")
        if st["plan_version"] > v0:
            break
        time.sleep(2.0)
    # The warm-up had its chance: from here the replay runs on one plan. Without the hold the calibrated
    # model, refitted on the replay's own batches, re-planned minutes into it (every column of the x1.17
    # runs before this hold, docs/results.md: slow servers swapped halves mid-replay, one column's slow chains
    # drained for up to 60 s in its first burst).
    st = hold_model_replans(launcher, swarm)
    deadline = time.monotonic() + 120.0  # a re-plan decided before the hold: its wait for sessions is 60 s
    while st["model_replan_pending"] and st["plan_version"] == v0 and time.monotonic() < deadline:
        time.sleep(1.0)
        st = launcher.fetch_json("orchestrator", url + "status")
    if st["plan_version"] > v0:
        print(
            f"[{policy}] the calibrated model re-planned (v{st['plan_version']}): waiting for it to be online",
            flush=True,
        )
        with launcher.cpu_unlimited():  # servers loading their new ranges: not measured either
            st = wait_plan(launcher, url, swarm)
    else:
        print(f"[{policy}] the calibrated model kept the plan", flush=True)
    return st


def model_probe(cfg: Table1Config, launcher, swarm, status: dict, scale_info: dict, out_dir: Path, policy: str) -> dict:
    """After the replay: `probe_per_chain` sessions of the replay's mean lengths through each dispatchable
    chain of `status`, one after another, so each runs alone in the system (the model check needs
    requests alone, and under the trace's bursts few or none are: one full run had none, docs/results.md).
    Each session avoids every server outside its chain, so the orchestrator's JFFC grants that chain
    (a per-request router, the PETALS policy, computes its own route and ignores this: its probes go
    where it routes them). Records go to probe_<policy>.jsonl (counted nowhere but in the model check)."""
    every = [k for k in status["chains"] if k.get("dispatchable", True)]
    # avoiding the servers outside a chain lets JFFC grant that chain or any chain over a subset of its
    # servers (slow2 -> fast1 when fast1 alone is a chain: JFFC takes fast1, the faster): probe only the
    # chains that no other chain's servers fit inside. Every server still gets a probe unless all of its
    # chains contain a smaller chain (the summary counts what was probed)
    chains = probe_targets(every)
    placed = {s["peer_id"] for s in status["servers"] if s["end"] > s["start"]}
    l_in = max(1, round(scale_info["mean_input_tokens"]))
    l_out = max(2, round(scale_info["mean_output_tokens"]))
    probes = [
        {
            "index": PROBE_INDEX0 + i,
            "arrival_s": 0.0,
            "input_tokens": l_in,
            "output_tokens": l_out,
            "avoid": sorted(placed - set(k["servers"])),
        }
        for i, k in enumerate(c for c in chains for _ in range(cfg.probe_per_chain))
    ]
    if not probes:
        return {"sessions": 0, "finished": 0, "reason": "no dispatchable chain"}
    req_file, rec_file = out_dir / f"probe_requests_{policy}.json", out_dir / f"probe_{policy}.jsonl"
    req_file.write_text(json.dumps(probes))
    print(
        f"[{policy}] model probe: {len(probes)} sessions ({l_in} + {l_out} tokens), {cfg.probe_per_chain} per "
        f"chain, one after another ...",
        flush=True,
    )
    gen = start_loadgen(
        cfg, launcher, swarm, req_file, rec_file, f"{policy}-probe", ("--sequential", "--acquire-timeout", "120")
    )
    try:
        out, _ = gen.communicate(timeout=cfg.probe_timeout_s)
    except subprocess.TimeoutExpired:
        stop_loadgen(gen)
        out, _ = gen.communicate()
    finally:
        stop_loadgen(gen)
    done = report.read_records(rec_file) if rec_file.exists() else []
    facts = {
        "sessions": len(probes),
        "finished": sum(1 for r in done if r.get("error") is None),
        "input_tokens": l_in,
        "output_tokens": l_out,
        "exit": gen.returncode,
        "chains_not_probed": len(every) - len(chains),
    }
    if gen.returncode != 0:
        facts["tail"] = (out or "").splitlines()[-15:]
    return facts


def probe_targets(chains: list[dict]) -> list[dict]:
    """The chains a probe can reach by avoiding every other server: those that hold no other chain."""
    sets = [frozenset(k["servers"]) for k in chains]
    return [k for k, mine in zip(chains, sets) if not any(o < mine for o in sets)]


PROBE_INDEX0 = 1_000_000  # probe records' indices: apart from the replay's


PLAN_ERROR_GRACE_S = 60.0


def hold_model_replans(launcher, swarm, timeout_s: float = 30.0) -> dict:
    """SIGUSR1 to the orchestrator (`Orchestrator.hold_model_replans`): its calibrated model decides no
    re-plan from now on. Returns its /status once that says so."""
    os.kill(swarm.orchestrator_process.pid, signal.SIGUSR1)
    deadline = time.monotonic() + timeout_s
    while True:
        st = launcher.fetch_json("orchestrator", swarm.orchestrator_url + "status")
        if st.get("model_replans_held"):
            return st
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the orchestrator did not hold its calibrated re-plans within {timeout_s:.0f} s of "
                "SIGUSR1 (is it older than this driver?)"
            )
        time.sleep(0.5)


def wait_plan(launcher, url: str, swarm, timeout_s: float = 600.0) -> dict:
    """The orchestrator's /status once its plan is online (every server it placed serves its range)."""
    deadline = time.monotonic() + timeout_s
    error_since = None  # when the current plan error was first seen with every server registered
    while True:
        dead = [s.name for s in swarm.servers if not s.alive]
        if dead:
            sp = next(s for s in swarm.servers if not s.alive)
            raise RuntimeError(f"server(s) {', '.join(dead)} exited during start-up:\n" + "\n".join(sp.lines[-15:]))
        status = launcher.fetch_json("orchestrator", url + "status")
        if status.get("plan_installed"):
            return status
        # A plan error while servers are still registering is expected (too few yet); one that stays
        # PLAN_ERROR_GRACE_S after all of them registered will not go away: say it now, not at the timeout.
        err = status.get("plan_error")
        if err and len(status.get("servers") or []) >= len(swarm.servers):
            if error_since is None or error_since[0] != err:
                error_since = (err, time.monotonic())
            elif time.monotonic() - error_since[1] > PLAN_ERROR_GRACE_S:
                raise RuntimeError(
                    f"the orchestrator cannot plan with all {len(swarm.servers)} servers registered "
                    f"(for {PLAN_ERROR_GRACE_S:.0f} s): {err}"
                )
        else:
            error_since = None
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the orchestrator's plan was not online within {timeout_s:.0f} s: "
                f"{status.get('plan_error') or status.get('events', [])[-3:]}"
            )
        time.sleep(1.0)


def orchestrator_args(cfg: Table1Config, policy: str, scale_info: dict) -> list[str]:
    """`petals-chain orchestrator` arguments of one column: the policy, the scaled load it plans for, and
    at most one re-plan, from the calibrated model right after the warm-up."""
    args = [
        "--policy",
        policy,
        "--expected-servers",
        str(cfg.servers),
        "--arrival-rate",
        f"{scale_info['rate_per_s']:.6f}",
        "--rho",
        str(cfg.rho_bar),
        "--mean-input-tokens",
        f"{scale_info['mean_input_tokens']:.3f}",
        "--mean-output-tokens",
        f"{scale_info['mean_output_tokens']:.3f}",
        "--lease-ttl",
        "60",
        "--replan-period",
        "1e9",
        # the calibrated model may re-plan once, right after the warm-up, never during the replay
        "--model-replans",
        "1" if cfg.warmup_per_chain > 0 else "0",
        "--model-replan-period",
        "1",
        "--replan-hold",
        "5",
        # the stated means are the whole replay's: the warm-up's few sessions (the trace's first requests,
        # 14.5 output tokens against 22.7 in the full run) must not replace them in the planner's model
        "--length-prior-sessions",
        str(cfg.requests),
        # every grant and release in log_<policy>_orchestrator.txt: how a queue that stalls got there
        "--log-level",
        "INFO",
    ]
    if cfg.leftover_placement:  # blocks for the servers GBP-CR leaves idle (orchestrator/placement_leftover.py)
        args.append("--leftover-placement")
    tokens = kv_plan_tokens(cfg, scale_info.get("_requests", ()))
    if tokens is not None:
        args += ["--kv-plan-tokens", str(tokens)]
    if cfg.server_compute != "auto":
        args += ["--server-compute", cfg.server_compute]
    return args


def kv_plan_tokens(cfg: Table1Config, requests) -> int | None:
    """The session length the orchestrator's cache reservation is planned for (--kv-plan-tokens), None for
    the servers' --max-length. auto: the 95th percentile of the replayed sessions' prompt + output tokens
    (what each session opens with), within the servers' limit."""
    if cfg.kv_plan_tokens == "max":
        return None
    if cfg.kv_plan_tokens == "auto":
        lengths = sorted(r.input_tokens + r.output_tokens for r in requests)
        if not lengths:
            return None
        return min(cfg.max_length_tokens, lengths[min(len(lengths) - 1, math.ceil(0.95 * len(lengths)) - 1)])
    return min(cfg.max_length_tokens, int(cfg.kv_plan_tokens))


def run_policy(
    cfg: Table1Config, policy: str, scale_info: dict, rtt_ms, out_dir: Path, gpu_env: dict[str, str] | None = None
) -> dict:
    """One fresh swarm for `policy`: start, wait for its plan, replay, collect; always stops everything.
    `gpu_env`: the MPS clients' environment (experiments/gpu_mps.py) for every process of the swarm."""
    from petals_chain.swarm.local import LocalSwarm

    requests = scale_info["_requests"]
    req_file = out_dir / "requests.json"
    req_file.write_text(json.dumps([r.to_dict() for r in requests]))
    rec_file = out_dir / f"records_{policy}.jsonl"
    orch_args = orchestrator_args(cfg, policy, scale_info)
    launcher = make_launcher(cfg, rtt_ms)
    swarm = LocalSwarm(
        cfg.model,
        [None] * cfg.servers,
        server_args=["--num-threads", "1", "--max-length", str(cfg.max_length_tokens)],
        per_server_args=[
            a + ["--service-log", str(out_dir / f"service_{policy}_{n}.jsonl")]
            for a, n in zip(server_args(cfg, cpu_shares(cfg)[0]), server_names(cfg))
        ],
        orchestrator_args=orch_args,
        placement=launcher.placement,
        names=server_names(cfg),
        env={**THREAD_ENV, **(gpu_env or {})},
        start_timeout_s=600,
    )
    result: dict = {"policy": policy, "where": launcher.label}
    lines: list[str] = []  # the load generator's output
    gen = None  # the replay's load generator
    try:
        t_start = time.monotonic()
        print(f"[{policy}] starting a fresh swarm ({launcher.label}) ...", flush=True)
        # start-up (imports, weights, the profile: timed in CPU seconds per share) is not measured: the
        # hosts' quotas apply from the warm-up on, so a 0.12-core host does not take minutes to load
        with launcher.cpu_unlimited():
            swarm.start(wait_servers=False)  # the plan is what counts: a server it leaves out never gets a range
            status = wait_plan(launcher, swarm.orchestrator_url, swarm)
        result["startup_s"] = time.monotonic() - t_start
        if not cfg.daemons_in_share:
            result["daemons_exempted"] = launcher.exempt_daemons({s.name: s.process.pid for s in swarm.servers})
        (out_dir / f"status_{policy}.json").write_text(json.dumps(status, indent=1))
        names = {s["peer_id"]: s["name"] for s in status["servers"]}
        idle = [s for s in status["servers"] if s["assigned"] is None and s["end"] <= s["start"]]
        left_out = [s["name"] for s in idle if s["rtt"] is None]
        unused = [s["name"] for s in idle if s["rtt"] is not None]
        if left_out:
            print(
                f"[{policy}] not in the plan (no RTT measurement when it was made): {', '.join(left_out)}", flush=True
            )
        if unused:
            print(f"[{policy}] measured but given no blocks by the plan: {', '.join(unused)}", flush=True)
        result.update(
            c=status["c"],
            placement={s["name"]: [s["start"], s["end"]] for s in status["servers"]},
            left_out_of_plan=left_out,
            unused_by_plan=unused,
            chains=[
                {
                    "servers": [names.get(p, p) for p in k["servers"]],
                    "blocks": k.get("blocks"),
                    "capacity": k["capacity"],
                    "service_time_s": k["service_time"],
                }
                for k in status["chains"]
            ],
            servers=server_models(status),
        )
        print(
            f"[{policy}] plan online after {result['startup_s']:.0f} s: c = {status['c']}, placement "
            + ", ".join(f"{k}={v}" for k, v in result["placement"].items()),
            flush=True,
        )
        if gpu_env:  # an MPS server is listed once a client made its CUDA context through the daemon
            from experiments.gpu_mps import server_list

            mps_servers = server_list(gpu_env)
            result["gpu_isolation"] = {"mode": "mps", "sm_percent": cfg.gpu_sm_percent, "mps_servers": mps_servers}
            print(
                f"[{policy}] GPU isolation: MPS, {cfg.gpu_sm_percent:.0f} % of the SMs per process, "
                f"MPS server(s) {mps_servers or 'none: the servers did not connect'}",
                flush=True,
            )
        if cfg.warmup_per_chain > 0:
            status = calibration_warmup(cfg, launcher, swarm, status, requests, out_dir, policy)
            result["calibration"] = {
                "plan_version": status["plan_version"],
                "model_replans": status.get("model_replans"),
                "c": status["c"],
                "servers": server_models(status),
                "placement": {s["name"]: [s["start"], s["end"]] for s in status["servers"]},
            }
            (out_dir / f"status_{policy}_calibrated.json").write_text(json.dumps(status, indent=1))
            result.update(
                c=status["c"],
                placement=result["calibration"]["placement"],
                chains=[
                    {
                        "servers": [names.get(p, p) for p in k["servers"]],
                        "blocks": k.get("blocks"),
                        "capacity": k["capacity"],
                        "service_time_s": k["service_time"],
                    }
                    for k in status["chains"]
                    if k["dispatchable"]
                ],
                servers=server_models(status),
            )
        before, t_replay = launcher.cpu_report(), time.monotonic()
        meter = CpuMeter(
            [p.pid for p in [swarm.dht_process, swarm.orchestrator_process] if p]
            + [s.process.pid for s in swarm.servers]
        )
        gen = start_loadgen(cfg, launcher, swarm, req_file, rec_file, policy)
        meter.add(gen.pid)

        def pump():
            for line in gen.stdout:
                lines.append(line.rstrip("\n"))
                if line.startswith("loadgen:"):
                    print(f"[{policy}] {line.strip()}", flush=True)

        threading.Thread(target=pump, daemon=True).start()
        limit_s = requests[-1].arrival_s + cfg.deadline_s + 180
        t_end = time.monotonic() + limit_s
        while gen.poll() is None and time.monotonic() < t_end:
            meter.sample()
            time.sleep(2.0)
        if gen.poll() is None:
            stop_loadgen(gen)
            result["loadgen_error"] = f"load generator killed after {limit_s:.0f} s"
        result["cpu"] = meter.report()
        result["host_cpu"] = host_cpu_use(launcher.cpu_report(), before, time.monotonic() - t_replay)
        result["loadgen_exit"] = gen.wait(timeout=30)
        if result["loadgen_exit"] != 0:
            result["loadgen_tail"] = lines[-20:]
        final = None
        try:
            final = launcher.fetch_json("orchestrator", swarm.orchestrator_url + "status")
            (out_dir / f"status_{policy}_final.json").write_text(json.dumps(final, indent=1))
            result["final_metrics"] = final["metrics"]
            # the orchestrator's model as it stood at the end (fitted from live service): the model check's
            result["final_servers"] = server_models(final)
        except Exception as e:  # noqa: BLE001 - the summary says so; records are what count
            result["final_metrics"] = {"error": str(e)}
        # the probe measures the chains of the plan the replay ran on, after the model above was taken
        if cfg.probe_per_chain > 0 and final is not None:
            try:
                probe_status = final
                if not final.get("plan_installed"):
                    # a model re-plan made during the replay may still be moving servers: probe the plan
                    # once it is online (its servers keep the fits the model check reads from `final`)
                    print(
                        f"[{policy}] the plan is not online yet (a re-plan moves servers): waiting for it "
                        "before the probe",
                        flush=True,
                    )
                    probe_status = wait_plan(launcher, swarm.orchestrator_url, swarm, timeout_s=300)
                result["probe"] = model_probe(cfg, launcher, swarm, probe_status, scale_info, out_dir, policy)
            except Exception as e:  # noqa: BLE001 - the probe is extra: the replay's results stand without it
                result["probe"] = {"error": f"{type(e).__name__}: {e}"}
    finally:
        stop_loadgen(gen)  # interrupted mid-replay: before the servers go (see stop_loadgen)
        swarm.stop()
        launcher.close()
        write_process_logs(out_dir, policy, swarm, lines)
    records = report.rewrite_records(rec_file, requests, policy)
    result["records"] = records
    return result


def write_process_logs(out_dir: Path, policy: str, swarm, loadgen_lines: list[str]) -> None:
    """What the run's processes printed (warnings, failures, the orchestrator's events), one file each:
    `log_<policy>_orchestrator.txt`, `log_<policy>_<server>.txt`, `log_<policy>_loadgen.txt`; the
    records say what happened to each request, these say why (a stalled queue, a failed release)."""
    outputs = {"orchestrator": swarm.orchestrator_lines, "loadgen": loadgen_lines}
    outputs.update({s.name: s.lines for s in swarm.servers})
    for name, lines in outputs.items():
        (out_dir / f"log_{policy}_{name}.txt").write_text("\n".join(lines) + "\n" if lines else "")


def run_petals_column(
    cfg: Table1Config, scale_info: dict, rtt_ms, out_dir: Path, times, block_bytes: int, hidden_size: int
) -> dict:
    """Real PETALS 2.2 on the same hosts, trace and budgets (experiments/petals22.py), or why it cannot run."""
    from experiments import petals22
    from petals_chain.cli.args import parse_size

    python, model = petals22.petals_paths(cfg.petals_work)
    reason = petals22.why_unavailable(python, model)
    if reason:
        return {"policy": "petals-2.2", "unavailable": reason, "records": []}
    specs = []
    for name, args in zip(server_names(cfg), server_args(cfg)):
        budget = parse_size(args[1])
        k = cfg.slow_slowdown if name.startswith("slow") else 1.0
        specs.append(
            {
                "name": name,
                "num_blocks": petals22.petals_num_blocks(budget, block_bytes, hidden_size),
                "throughput": 1.0 / (k * times.lone_decode_s_per_block),
                "budget_bytes": budget,
            }
        )
    if sum(s["num_blocks"] for s in specs) < scale_info["num_blocks"] or min(s["num_blocks"] for s in specs) < 1:
        return {
            "policy": "petals-2.2",
            "records": [],
            "unavailable": (
                f"PETALS' memory rule gives {[s['num_blocks'] for s in specs]} blocks for these budgets: they cannot "
                f"cover the model's {scale_info['num_blocks']} blocks"
            ),
        }
    requests = scale_info["_requests"]
    req_file = out_dir / "requests.json"
    req_file.write_text(json.dumps([r.to_dict() for r in requests]))
    rec_file = out_dir / "records_petals-2.2.jsonl"
    launcher = make_launcher(cfg, rtt_ms)
    result: dict = {"policy": "petals-2.2", "where": launcher.label}
    print(f"[petals-2.2] starting real PETALS 2.2 ({launcher.label}) ...", flush=True)
    try:
        facts = petals22.run_petals22(
            cfg,
            launcher,
            req_file,
            rec_file,
            specs,
            python,
            model,
            cfg.deadline_s,
            requests[-1].arrival_s,
            lambda m: print(m, flush=True),
        )
        result.update(facts)
    except RuntimeError as e:
        result["unavailable"] = f"PETALS 2.2 did not run here: {e}"
    finally:
        launcher.close()
    result["records"] = report.rewrite_records(rec_file, requests, "petals-2.2") if "unavailable" not in result else []
    return result
