"""`petals-chain experiment table1 ...`: the paper's Table 1 on a live swarm (experiments/table1.py)."""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
from pathlib import Path

from orchestrator.cli_args import positive_float
from orchestrator.policies import POLICY_NAMES
from petals_chain.cli.args import DTYPE_CHOICES, CliParser, parse_size, positive_int

POLICIES = (*POLICY_NAMES, "petals-2.2")  # the registry's policies, and petals-2.2: real PETALS 2.2


def _policies(text: str) -> tuple[str, ...]:
    out = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [p for p in out if p not in POLICIES]
    if not out or bad:
        raise argparse.ArgumentTypeError(
            f"--policies takes a comma-separated subset of {','.join(POLICIES)}; got {text!r}"
        )
    return out


def _size(text: str) -> str:
    parse_size(text)  # raises argparse.ArgumentTypeError with the fix-it message
    return text.strip()


def _kv_plan_tokens(text: str) -> str:
    if text in ("max", "auto") or (text.isdigit() and int(text) >= 1):
        return text
    raise argparse.ArgumentTypeError(f"takes max, auto or a positive number of tokens, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    p = CliParser(
        prog="petals-chain experiment table1",
        description=(
            "The paper's Table 1 on a live swarm: per policy a fresh swarm (DHT, orchestrator --policy P, 9 servers: "
            "3 fast, 6 slow) in emulated WAN hosts, replaying the scaled Azure code trace. Writes summary.json, "
            "summary.md, records_<policy>.jsonl, cdf.png and the model check under --out."
        ),
    )
    p.add_argument(
        "--requests",
        type=int,
        default=250,
        help=(
            "requests replayed from the trace (default 250: five columns in about an hour here; the paper's 1000 "
            "take about 3.5 hours)"
        ),
    )
    p.add_argument("--offset", type=int, default=0, help="first trace request replayed (default 0)")
    p.add_argument(
        "--policies",
        type=_policies,
        default=POLICIES,
        help="comma-separated (default: all four policies, then real PETALS 2.2 as petals-2.2)",
    )
    p.add_argument(
        "--petals-work",
        default=None,
        help="PETALS 2.2 environment built by ../shared/anchors/petals_2_2_cpu.sh (default ~/.cache/petals-anchor)",
    )
    p.add_argument("--servers", type=int, default=9, help="servers (default 9: 3 fast, the rest slow)")
    p.add_argument("--fast-servers", type=int, default=3, help="how many of --servers are fast (default 3)")
    p.add_argument("--seed", type=int, default=0, help="RTT host sample and prompt tokens")
    p.add_argument(
        "--time-scale",
        type=positive_float,
        default=None,
        help="arrival times x this (default: auto, for --target-load of the CPUs)",
    )
    p.add_argument("--length-scale", type=positive_float, default=1 / 16, help="input lengths x this (default 1/16)")
    p.add_argument("--output-scale", type=positive_float, default=1.0, help="output lengths x this (default 1)")
    p.add_argument("--max-length", type=int, default=1024, help="servers' --max-length; outputs are cut to fit")
    p.add_argument("--target-load", type=positive_float, default=0.5, help="offered CPU load for the auto time scale")
    p.add_argument(
        "--calibrate-from",
        default=None,
        metavar="DIR",
        help=(
            "the auto time scale's CPU cost per request W measured in an earlier run's --out folder (its server hosts' "
            "CPU per finished request) instead of footnote 11's estimate from the start-up profile"
        ),
    )
    p.add_argument(
        "--leftover-placement",
        action="store_true",
        help=(
            "the orchestrator's --leftover-placement: servers GBP-CR leaves idle get blocks where GCA's chains are "
            "tightest (beyond the paper; off by default)"
        ),
    )
    p.add_argument(
        "--kv-plan-tokens",
        type=_kv_plan_tokens,
        default="max",
        metavar="max|auto|N",
        help=(
            "the orchestrator's --kv-plan-tokens: plan the cache reservation for sessions of N tokens; auto = the "
            "95th percentile of the replayed requests' prompt + output tokens; max (default) = the servers' "
            "--max-length (sessions reserve KV at their own length, so max counts fewer sessions than fit)"
        ),
    )
    p.add_argument(
        "--server-compute",
        choices=["auto", "shared", "parallel"],
        default="auto",
        help=(
            "the orchestrator's --server-compute: auto (default) = shared for servers with a live fit (a chain's "
            "capacity is cut where its busiest server saturates), parallel = the paper's model (capacities from "
            "the cache reservation alone, sessions batch without slowing each other)"
        ),
    )
    p.add_argument(
        "--daemons-in-share",
        action="store_true",
        help=(
            "count each server host's hivemind DHT process and p2p daemon against its CPU share (as runs "
            "recorded before this flag did; default: they run outside it, as a real host runs them beside its device)"
        ),
    )
    p.add_argument(
        "--max-batch-tokens",
        type=positive_int,
        default=2048,
        metavar="N",
        help=(
            "the servers' --max-batch-tokens (default 2048: no prompt of --max-length 1024 is cut): a smaller budget "
            "runs long prompts in chunks interleaved with other sessions' decode steps (chunked prefill)"
        ),
    )
    p.add_argument(
        "--cpus", type=positive_float, default=2.0, help="cores the auto time scale may count on (default 2)"
    )
    p.add_argument("--fast-budget", type=_size, default="480MiB", help="fast servers' --memory-budget")
    p.add_argument("--slow-budget", type=_size, default="240MiB", help="slow servers' --memory-budget")
    p.add_argument(
        "--slow-slowdown",
        type=positive_float,
        default=175 / 109,
        help="slow servers' launch-server --emulate-slowdown (default 175/109, the paper's ratio)",
    )
    p.add_argument(
        "--cpu",
        default="auto",
        metavar="SHARES",
        help="a CPU share (cores) per emulated host: auto (default: fast servers f, slow f / "
        "--slow-slowdown, client 0.5, together 0.9 x --cpus, when netem runs on CPU and cgroups are "
        "writable; else --emulate-slowdown makes slow servers), off, 0.25 (every host), or "
        "fast=0.2,slow=0.12,client=0.5 (roles or host names)",
    )
    p.add_argument(
        "--warmup-per-chain",
        type=int,
        default=2,
        help="calibration warm-up: sessions per placed server before the replay (not counted); the orchestrator "
        "may then re-plan once from the service it measured (0: no warm-up, no calibrated re-plan)",
    )
    p.add_argument(
        "--probe-per-chain",
        type=int,
        default=1,
        metavar="N",
        help="the model probe after each replay: N sessions of the replay's mean lengths through each chain "
        "of the final plan, one after another, each alone (the model check's lone requests; counted "
        "nowhere else; 0: none)",
    )
    p.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES, help="the servers' --dtype")
    p.add_argument("--device", default="cpu", help="the servers' --device (cuda: the GPU variant; no CPU shares)")
    p.add_argument(
        "--gpu-isolation",
        default="off",
        choices=["off", "mps"],
        help="with --device cuda: off (default; the nine processes time-slice the GPU) or mps (one CUDA MPS "
        "daemon for the run: their kernels run side by side, each process capped at --gpu-sm-percent "
        "of the SMs; needs nvidia-cuda-mps-control)",
    )
    p.add_argument(
        "--gpu-sm-percent",
        type=positive_float,
        default=100 / 3,
        help="--gpu-isolation mps: each process's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (default 33.3)",
    )
    p.add_argument(
        "--no-netem",
        action="store_true",
        help="run every process on 127.0.0.1 without WAN emulation (results are labelled so)",
    )
    p.add_argument(
        "--netem-backend",
        default="auto",
        choices=["auto", "kernel", "userspace"],
        help="netem's backend (default auto: kernel where sch_netem exists, else userspace)",
    )
    p.add_argument("--netem-name", default="", help="name of the emulated network (default: a fresh one per run)")
    p.add_argument(
        "--data", default=None, help="Azure trace file or data folder (default $PETALS_CHAIN_DATA, ../shared/data)"
    )
    p.add_argument("--rtt-data", default=None, help="RIPE Atlas file or data folder (same default)")
    p.add_argument(
        "--deadline", type=positive_float, default=600.0, help="seconds after the last arrival for stragglers"
    )
    p.add_argument("--out", default="results/table1", help="folder of the results (default results/table1)")
    p.add_argument(
        "--extend",
        action="store_true",
        help=(
            "add --policies as further columns to the run recorded in --out (the same command but for --policies: "
            "its requests, time scale and RTTs are reused, other settings must match); the summary covers every "
            "column in the folder. For a five-column table over more than one sitting"
        ),
    )
    p.add_argument(
        "--recompute",
        action="store_true",
        help="rebuild summary, plots and model check from the files in --out (no swarm is started)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="40 requests, policies proposed and petals (unless given): the CI smoke run",
    )
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m (default) or a checkpoint folder")
    return p


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: petals-chain experiment EXPERIMENT [options]\n\nexperiments:\n"
            "  table1  the paper's Table 1 on a live swarm: per policy a fresh swarm in emulated WAN hosts "
            "replaying the scaled Azure trace\n  prefix  prompt-aware dispatch (jffc, e2, d2lpm, ...) side by "
            "side on a local swarm with prefix caches\n\n`petals-chain experiment table1 --help` lists its options."
        )
        return 0
    if argv[0] == "prefix":  # prompt-aware dispatch side by side (experiments/prefix.py)
        from experiments.prefix import main as prefix_main

        return prefix_main(argv[1:])
    if argv[0] != "table1":
        print(f"petals-chain experiment: unknown experiment {argv[0]!r}; available: table1, prefix", file=sys.stderr)
        return 2
    rest = argv[1:]
    args = build_parser().parse_args(rest)
    if args.quick:
        if "--requests" not in rest:
            args.requests = 40
        if "--policies" not in rest:
            args.policies = ("proposed", "petals")
    if args.requests < 1 or not 1 <= args.fast_servers < args.servers or args.max_length < 2:
        print(
            "petals-chain experiment table1: need --requests >= 1, 1 <= --fast-servers < --servers, --max-length >= 2",
            file=sys.stderr,
        )
        return 2
    if args.gpu_isolation != "off" and not args.device.startswith("cuda"):
        print(
            f"petals-chain experiment table1: --gpu-isolation {args.gpu_isolation} isolates processes on a GPU; "
            "it needs --device cuda",
            file=sys.stderr,
        )
        return 2
    if args.gpu_sm_percent > 100:
        print(
            f"petals-chain experiment table1: --gpu-sm-percent is a percentage of the SMs, at most 100; "
            f"got {args.gpu_sm_percent:g}",
            file=sys.stderr,
        )
        return 2

    def terminate(*_):  # unwind through the drivers' `finally`: swarms stopped, emulated network removed
        raise SystemExit(128 + signal.SIGTERM)

    signal.signal(signal.SIGTERM, terminate)
    from experiments.hosts import EmulationUnavailableError
    from experiments.run import run_table1, write_results
    from experiments.table1 import Table1Config
    from netem.topology import DataNotFoundError

    cfg = Table1Config(
        requests=args.requests,
        policies=args.policies,
        servers=args.servers,
        fast_servers=args.fast_servers,
        seed=args.seed,
        offset=args.offset,
        time_scale=args.time_scale,
        length_scale=args.length_scale,
        output_scale=args.output_scale,
        max_length_tokens=args.max_length,
        target_load=args.target_load,
        n_cpus=args.cpus,
        fast_budget=args.fast_budget,
        slow_budget=args.slow_budget,
        slow_slowdown=args.slow_slowdown,
        netem=not args.no_netem,
        netem_backend=args.netem_backend,
        netem_name=args.netem_name,
        cpu=args.cpu,
        device=args.device,
        dtype=args.dtype,
        warmup_per_chain=args.warmup_per_chain,
        gpu_isolation=args.gpu_isolation,
        gpu_sm_percent=args.gpu_sm_percent,
        calibrate_from=args.calibrate_from,
        leftover_placement=args.leftover_placement,
        daemons_in_share=args.daemons_in_share,
        max_batch_tokens=args.max_batch_tokens,
        kv_plan_tokens=args.kv_plan_tokens,
        server_compute=args.server_compute,
        probe_per_chain=args.probe_per_chain,
        model=args.model,
        data=args.data,
        petals_work=args.petals_work,
        rtt_data=args.rtt_data,
        out=args.out,
        deadline_s=args.deadline,
        command="petals-chain experiment table1 " + shlex.join(rest),
        extend=args.extend,
    )
    try:
        summary = write_results(Path(cfg.out)) if args.recompute else run_table1(cfg)
    except (DataNotFoundError, ValueError, EmulationUnavailableError) as e:
        print(f"petals-chain experiment table1: {e}", file=sys.stderr)
        return 2
    except FileNotFoundError as e:  # after DataNotFoundError, its subclass
        hint = " (--recompute needs the folder of a run)" if args.recompute else ""
        print(f"petals-chain experiment table1: {e}{hint}", file=sys.stderr)
        return 2
    print(
        json.dumps(
            {
                p: {"finished": s["finished"], "failed": s["failed"], "mean_response_s": s["response_s"]["mean"]}
                for p, s in summary["policies"].items()
            },
            indent=1,
        )
    )
    print(f"results in {cfg.out}/ (summary.md, summary.json, records_*.jsonl, cdf.png, model_check.*)")
    return 0
