"""`petals-chain orchestrator`: the online orchestrator of one model (docs/online-orchestrator.md)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from orchestrator.cli_args import parse_c, positive_float
from orchestrator.dispatch import DISPATCHERS
from orchestrator.model import SERVER_COMPUTE
from orchestrator.planner import POLICIES
from orchestrator.tuning import TUNINGS
from petals_chain.cli.args import (
    LOG_LEVELS,
    CliParser,
    identity_path,
    listen_maddr,
    non_negative_float,
    non_negative_int,
    peer_maddr,
    positive_int,
)
from petals_chain.process.heap import freeze_startup_heap


def build_parser() -> argparse.ArgumentParser:
    p = CliParser(prog="petals-chain orchestrator", description=__doc__)
    p.add_argument("--model", default="smollm2-135m", help="embedded model name or local checkpoint folder")
    p.add_argument("--initial-peers", nargs="+", required=True, type=peer_maddr, help="multiaddrs of DHT peers")
    p.add_argument(
        "--host-maddrs",
        nargs="+",
        default=["/ip4/0.0.0.0/tcp/0"],
        type=listen_maddr,
        help="multiaddrs to listen on (default /ip4/0.0.0.0/tcp/0)",
    )
    p.add_argument(
        "--identity-path",
        default=None,
        type=identity_path,
        help="private key file for a stable peer id (`petals-chain identity new PATH` makes one)",
    )
    p.add_argument(
        "--allowed-peers",
        default=None,
        metavar="FILE",
        help="private swarm: plan only with servers whose peer id is in FILE and answer only listed "
        "peers (clients and servers; one id a line, # comments)",
    )
    p.add_argument(
        "--policy",
        choices=POLICIES,
        default="proposed",
        help="proposed = GBP-CR + GCA + JFFC; petals / bprr = their placement + per-request routing; "
        "jffc-only = whole model per server + JFFC",
    )
    p.add_argument("--c", type=parse_c, default=None, help="cache reservation of GBP-CR: auto (default) or N")
    p.add_argument("--tuning", choices=TUNINGS, default="lower", help="objective for tuning c (default lower)")
    p.add_argument(
        "--leftover-placement",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="give servers GBP-CR leaves idle blocks where GCA is tightest, kept only if that lowers neither "
        "the total rate nor raises the Theorem 3.7 lower bound; c auto's ties (objectives within 1%%) then "
        "go to the larger total rate after this step (default off: docs/orchestrator.md)",
    )
    p.add_argument(
        "--arrival-rate", type=positive_float, default=0.5, help="lambda, sessions per second (planning input)"
    )
    p.add_argument("--rho", type=positive_float, default=0.7, help="target load rho_bar in (0, 1)")
    p.add_argument(
        "--mean-input-tokens", type=positive_float, default=64.0, help="expected l_in (updated from finished sessions)"
    )
    p.add_argument(
        "--mean-output-tokens",
        type=positive_float,
        default=32.0,
        help="expected l_out (updated from finished sessions)",
    )
    p.add_argument(
        "--length-prior-sessions",
        type=positive_float,
        default=1.0,
        help=(
            "how many finished sessions --mean-input-tokens / --mean-output-tokens count as in the running estimate "
            "of the lengths (default 1: the first finished sessions soon replace them)"
        ),
    )
    p.add_argument(
        "--per-block-overhead-ms", type=non_negative_float, default=1.0, help="t_o of footnote 11 (default 1 ms)"
    )
    p.add_argument(
        "--per-step-overhead-ms",
        type=non_negative_float,
        default=0.0,
        help="added to the measured RTT per step in tau_c",
    )
    p.add_argument(
        "--relay",
        choices=["server", "client"],
        default="server",
        help="how the swarm's clients relay (their default: server): tau_c = steps x max RTT_ij / 2 over "
        "the possible predecessors (footnote 4) or steps x the RTT from here",
    )
    p.add_argument(
        "--server-compute",
        choices=list(SERVER_COMPUTE),
        default="auto",
        help=(
            "how a server serves concurrent sessions: shared = its compute is split among them (a CPU: n sessions "
            "keep it busy t_o steps + n x their compute, and the plan's chain times grow with the chain's load), "
            "parallel = the paper's model (GPU batches: sessions do not slow each other), auto (default) = shared "
            "for servers with a live fit (its t_O is the marginal cost of one more session), parallel before"
        ),
    )
    p.add_argument(
        "--kv-plan-tokens",
        type=positive_int,
        default=None,
        metavar="N",
        help=(
            "plan the cache reservation (s_c, c*) for sessions of N tokens (prompt + output) instead of the servers' "
            "--max-length: a server reserves each session's KV at the session's own max_length, so a workload of "
            "short sessions fits more of them than the planner counts; a longer session still runs if its servers "
            "have the memory, and waits in their admission queue if not (default: the servers' --max-length)"
        ),
    )
    p.add_argument(
        "--expected-servers",
        type=non_negative_int,
        default=0,
        help="plan as soon as this many servers registered (default: when none joined for --settle)",
    )
    p.add_argument(
        "--expected-wait",
        type=non_negative_float,
        default=180.0,
        help="with --expected-servers: plan with fewer measured servers after this many seconds (default 180)",
    )
    p.add_argument(
        "--settle", type=non_negative_float, default=5.0, help="seconds without a new server before the first plan"
    )
    p.add_argument(
        "--replan-period", type=positive_float, default=60.0, help="slow time scale: seconds between re-plans"
    )
    p.add_argument(
        "--force-replan",
        action="store_true",
        help="re-planning may move servers that hold live sessions (at the --drain-timeout deadline, or at once "
        "without a drain): they close those sessions with a typed error and the clients fail over, replaying them",
    )
    p.add_argument(
        "--lease-ttl", type=positive_float, default=15.0, help="seconds a session lease lives without a heartbeat"
    )
    p.add_argument(
        "--dispatch",
        choices=sorted(DISPATCHERS),
        default="jffc",
        help="dispatcher over the chains of proposed / jffc-only (orchestrator.dispatch; the simulator's "
        "--dispatch): jffc (the paper), jsq, jiq, sed, sa-jsq (a FIFO queue per chain), or the "
        "prompt-aware e2 (Preble), d2lpm (fair, D2LPM), rr-lpm, vtc-rr (docs/prefix-dispatch.md)",
    )
    p.add_argument(
        "--prefix-sharing",
        choices=["client", "swarm"],
        default="client",
        help="whose cached prefixes the prompt-aware dispatchers match a session against: its own "
        "client's (default; dispatch reveals nothing of other clients' prompts) or every client's "
        "(use with servers started with --prefix-sharing swarm)",
    )
    p.add_argument(
        "--prefix-index-entries",
        type=positive_int,
        default=1 << 18,
        help="bound of the global prefix index (server, namespace, chunk) entries, LRU (default 262144)",
    )
    p.add_argument(
        "--client-quantum-sessions",
        type=positive_float,
        default=1.0,
        help="d2lpm: DLPM's per-client quantum Q^u at the central queue, in expected sessions' charge "
        "(default 1: a flooder's backlog yields to a light client within a session or two; larger favours "
        "locality over fairness, and the bound 2 (U + Q^u) |W| grows with it)",
    )
    p.add_argument(
        "--chain-quantum-sessions",
        type=positive_float,
        default=4.0,
        help="d2lpm: D2LPM's per-client, per-chain quantum Q^w, in expected sessions' charge (default 4): how "
        "much a client sends to the chain holding its prefix before others get its next sessions "
        "(larger: more locality, less even load; not in the fairness bound)",
    )
    p.add_argument(
        "--fair-skips",
        type=non_negative_int,
        default=32,
        help="d2lpm: a waiting session whose client holds credit goes first once other clients' grants passed "
        "it over this many times (default 32: bounds a light client's cache misses behind a flooder's hits; "
        "0: the DLPM paper's order, the longest match among the clients with credit)",
    )
    p.add_argument(
        "--queue",
        choices=["fifo", "fair"],
        default="fifo",
        help="central queue order when no chain has a free slot: fifo (JFFC as in the paper) or fair "
        "(the waiting session whose client received the least service goes first: VTC counters)",
    )
    p.add_argument(
        "--calibrate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="plan from each server's live service (t_I, t_O and per-step t_o fitted from its batches, "
        "the clients' measured per-hop cost in tau_c) once it ran enough batches; --no-calibrate "
        "plans from the start-up profile and the flags only",
    )
    p.add_argument(
        "--replan-threshold",
        type=positive_float,
        default=0.2,
        help="re-plan when the calibrated model moves the planned rate or c* by more than this "
        "(relative) for 30 s; re-armed below half of it (default 0.2)",
    )
    p.add_argument(
        "--model-replan-period",
        type=positive_float,
        default=300.0,
        help="at most one re-plan asked by the calibrated model per this many seconds (default 300)",
    )
    p.add_argument(
        "--model-replans",
        type=int,
        default=None,
        help="at most this many re-plans asked by the calibrated model (default: no limit; the Table 1 "
        "experiment allows 1, after its calibration warm-up). SIGUSR1 to the orchestrator holds them "
        "from then on (a measurement that must run on one plan; /status: model_replans_held)",
    )
    p.add_argument(
        "--drain-timeout",
        "--model-replan-wait",
        dest="drain_timeout",
        type=non_negative_float,
        default=60.0,
        help="a re-plan that moves servers first stops granting sessions on chains through them and waits "
        "up to this many seconds for their sessions to end; then it plans again with the servers "
        "still holding sessions kept on their ranges (with --force-replan: tells them to move at once, their "
        "sessions fail over). 0: no drain (default 60)",
    )
    p.add_argument(
        "--max-moves-per-replan",
        type=positive_int,
        default=None,
        metavar="N",
        help="at most N servers holding blocks move per re-plan, each step drained; the rest move at "
        "later re-plans (default: no limit)",
    )
    p.add_argument(
        "--replan-min-gain",
        type=non_negative_float,
        default=0.02,
        help="a re-plan that moves servers is installed only if it lowers the model's mean response "
        "(the tuning objective) by at least this fraction; /status says why one was not (default 0.02)",
    )
    p.add_argument(
        "--equivalent-servers",
        type=non_negative_float,
        default=0.05,
        metavar="REL",
        help="servers of the same memory whose tau_c, tau_p agree within REL (relative) are "
        "interchangeable: a plan that differs from the installed one only by swapping them "
        "moves nothing (default 0.05)",
    )
    p.add_argument(
        "--plan-process-min-servers",
        type=non_negative_int,
        default=1000,
        metavar="N",
        help="plan in a separate worker process once N servers are measured, so that planning a large "
        "swarm never delays the RPC handlers (acquires, releases); 0: always plan in the control thread "
        "(default 1000)",
    )
    p.add_argument(
        "--replan-hold",
        type=float,
        default=30.0,
        help="seconds the calibrated model must keep the plan moved before it re-plans (default 30)",
    )
    p.add_argument(
        "--lost-after",
        type=non_negative_float,
        default=10.0,
        help="seconds a server's record may be missing from the DHT before the orchestrator drops it and "
        "its chains (a server that announces offline is dropped at once; default 10)",
    )
    p.add_argument(
        "--exclude-after-reports",
        type=positive_int,
        default=3,
        metavar="K",
        help="stop planning a server once K distinct peers sent verification reports of it returning "
        "wrong hidden states that the orchestrator's own third opinion confirmed (default 3; one "
        "client's reports never suffice unless K is 1)",
    )
    p.add_argument("--http-host", default="127.0.0.1", help="address of the status page (default 127.0.0.1)")
    p.add_argument("--http-port", type=int, default=0, help="status page port (0: pick a free one; -1: no HTTP)")
    p.add_argument(
        "--log-level",
        default="WARNING",
        type=str.upper,
        choices=LOG_LEVELS,
        help="Python logging level (default WARNING)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not -1 <= args.http_port <= 65535:
        print(f"petals-chain orchestrator: --http-port must be in -1..65535, got {args.http_port}", file=sys.stderr)
        return 2
    if args.queue == "fair" and args.dispatch != "jffc":
        print(
            "petals-chain orchestrator: --queue fair orders JFFC's central queue; use it with --dispatch jffc",
            file=sys.stderr,
        )
        return 2
    if not 0 < args.rho < 1:
        print("petals-chain orchestrator: --rho must lie in (0, 1)", file=sys.stderr)
        return 2
    from petals_chain.errors import PetalsChainError
    from petals_chain.models.checkpoint import load_config, resolve_model_path
    from petals_chain.transport.membership import load_allowed_peers

    try:
        num_blocks = load_config(resolve_model_path(args.model)).num_hidden_layers
        allowed_peers = load_allowed_peers(args.allowed_peers)
    except PetalsChainError as e:
        print(f"petals-chain orchestrator: {e}", file=sys.stderr)
        return 2
    from orchestrator.service.core import Orchestrator, OrchestratorConfig
    from orchestrator.service.http import serve_http

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    orch = Orchestrator(
        OrchestratorConfig(
            model=args.model,
            initial_peers=args.initial_peers,
            num_blocks=num_blocks,
            host_maddrs=args.host_maddrs,
            policy=args.policy,
            c=args.c,
            tuning=args.tuning,
            leftover_placement=args.leftover_placement,
            arrival_rate_per_s=args.arrival_rate,
            rho_bar=args.rho,
            mean_input_tokens=args.mean_input_tokens,
            mean_output_tokens=args.mean_output_tokens,
            length_prior_sessions=args.length_prior_sessions,
            per_block_overhead_s=args.per_block_overhead_ms / 1e3,
            per_step_overhead_s=args.per_step_overhead_ms / 1e3,
            relay=args.relay,
            server_compute=args.server_compute,
            kv_plan_tokens=args.kv_plan_tokens,
            expected_servers=args.expected_servers,
            expected_wait_s=args.expected_wait,
            settle_s=args.settle,
            replan_period_s=args.replan_period,
            force_replan=args.force_replan,
            lease_ttl_s=args.lease_ttl,
            queue=args.queue,
            dispatch=args.dispatch,
            prefix_sharing=args.prefix_sharing,
            prefix_index_entries=args.prefix_index_entries,
            client_quantum_sessions=args.client_quantum_sessions,
            chain_quantum_sessions=args.chain_quantum_sessions,
            fair_skips=args.fair_skips,
            calibrate=args.calibrate,
            replan_enter=args.replan_threshold,
            replan_exit=args.replan_threshold / 2,
            model_replan_period_s=args.model_replan_period,
            replan_hold_s=args.replan_hold,
            drain_timeout_s=args.drain_timeout,
            max_moves_per_replan=args.max_moves_per_replan,
            replan_min_gain=args.replan_min_gain,
            equivalent_servers_rel=args.equivalent_servers,
            plan_process_min_servers=args.plan_process_min_servers,
            lost_after_s=args.lost_after,
            max_model_replans=args.model_replans,
            identity_path=args.identity_path,
            allowed_peers=allowed_peers,
            exclude_after_reports=args.exclude_after_reports,
        )
    )
    # SIGUSR1: hold the calibrated re-plans (a measurement that must run on one plan; Orchestrator.hold_model_replans).
    # The handler runs on the main thread, which only waits for `stop` below and never holds the core's lock.
    signal.signal(signal.SIGUSR1, lambda *_: orch.hold_model_replans())
    http = None
    if args.http_port >= 0:
        http = serve_http(orch, args.http_host, args.http_port)
        orch.http_port = http.server_address[1]
    url = f"http://{args.http_host}:{orch.http_port}/" if http else "(no HTTP)"
    freeze_startup_heap("orchestrator")  # dispatch never meets a full collection of the start-up heap
    print(f"orchestrator ready: {orch.model} as {orch.peer_id}, policy {args.policy}, status {url}", flush=True)
    from petals_chain.process.signals import wait_handling_signals

    wait_handling_signals(stop)
    if http is not None:
        http.shutdown()
    orch.shutdown()
    print("orchestrator stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
