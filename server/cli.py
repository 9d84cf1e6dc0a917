"""`launch-server`: host a contiguous range of a model's blocks in a petals-chain swarm."""

from __future__ import annotations

import argparse
import logging
import re
import signal
import sys
import threading

from petals_chain.cli.args import (
    DTYPE_CHOICES,
    LOG_LEVELS,
    CliParser,
    identity_path,
    listen_maddr,
    non_negative_float,
    non_negative_int,
    parse_size,
    peer_maddr,
    positive_float,
    positive_int,
    probability,
    run_main,
)

__all__ = ["build_parser", "main", "parse_size"]  # parse_size lives in petals_chain.cli.args (one parser of sizes)


def parse_size_or_zero(text: str) -> int:
    """parse_size that also takes 0 (for room that may be left out)."""
    return 0 if text.strip() == "0" else parse_size(text)


def parse_budget(text: str) -> int | str:
    return "auto" if text.strip() == "auto" else parse_size(text)


def parse_blocks(text: str) -> tuple[int, int] | str:
    if text.strip() == "auto":
        return "auto"
    m = re.fullmatch(r"(\d+):(\d+)", text.strip())
    if not m or int(m.group(1)) >= int(m.group(2)):
        raise argparse.ArgumentTypeError(f"bad --blocks {text!r}: use auto, or START:END with START < END, e.g. 10:20")
    return int(m.group(1)), int(m.group(2))


def build_parser() -> argparse.ArgumentParser:
    from server.policies import POLICIES, describe_policies  # light: no torch

    p = CliParser(
        prog="launch-server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="scheduling policies (--policy NAME) and their --policy-arg parameters:\n" + describe_policies(),
    )
    p.add_argument("--model", default="smollm2-135m", help="embedded model name or local checkpoint folder")
    p.add_argument(
        "--blocks",
        type=parse_blocks,
        default=None,
        help="block range START:END (0-based, END exclusive), or auto: load what the orchestrator assigns "
        "(the default when an orchestrator of the model is in the DHT)",
    )
    p.add_argument(
        "--num-blocks",
        type=positive_int,
        default=None,
        metavar="N",
        help="without an orchestrator: serve N blocks, choosing the span that most raises the swarm's "
        "weakest blocks from the DHT records (PETALS' rule), and move when the swarm changes enough",
    )
    p.add_argument(
        "--balance-quality",
        type=probability,
        default=0.75,
        help="with --num-blocks: move when the swarm's weakest block would serve at least 1/Q times "
        "more after the move (default 0.75, as PETALS)",
    )
    p.add_argument(
        "--rebalance-period",
        type=positive_float,
        default=30.0,
        metavar="S",
        help="with --num-blocks: seconds between checks of the swarm (jittered x0.5-1.5; default 30)",
    )
    p.add_argument(
        "--no-orchestrator",
        action="store_true",
        help="ignore any orchestrator: serve the --blocks given (required then)",
    )
    p.add_argument(
        "--orchestrator-wait",
        type=non_negative_float,
        default=30.0,
        help="with --blocks auto: seconds to wait for an orchestrator to appear in the DHT",
    )
    p.add_argument(
        "--initial-peers",
        nargs="+",
        required=True,
        type=peer_maddr,
        help="multiaddrs of DHT peers (from `petals-chain dht`)",
    )
    p.add_argument(
        "--memory-budget",
        type=parse_budget,
        default=parse_size("2GiB"),
        help="memory M_j this server offers for blocks + KV cache (default 2GiB), or auto: the device's "
        "free memory minus 10%% of its total (at least 1 GiB) for activations and CUDA graphs",
    )
    p.add_argument("--max-length", type=positive_int, default=2048, help="longest session (tokens) this server accepts")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=DTYPE_CHOICES,
        help="dtype of the hosted blocks, their KV caches and the hidden states (default float32; on a "
        "CPU float16 decodes about twice as fast, its weights streaming half the bytes)",
    )
    p.add_argument(
        "--quant",
        default="none",
        choices=["none", "nf4", "int8"],
        help="quantize the blocks' linear layers while loading (bitsandbytes; budgeted at the quantized size)",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument(
        "--adapters",
        nargs="+",
        default=[],
        metavar="PATH",
        help="PEFT LoRA adapter folders to serve for the hosted blocks; a session picks one by its folder "
        "name (client: active_adapter=NAME), sessions with different adapters batch together",
    )
    p.add_argument(
        "--no-cuda-graphs",
        action="store_true",
        help="on CUDA, run decode steps eagerly instead of replaying captured CUDA graphs "
        "(petals_chain/runtime/decode_graphs.py); for debugging and comparisons",
    )
    p.add_argument(
        "--host-maddrs", nargs="+", default=["/ip4/0.0.0.0/tcp/0"], type=listen_maddr, help="multiaddrs to listen on"
    )
    p.add_argument(
        "--announce-maddrs",
        "--public-maddrs",
        nargs="+",
        default=None,
        metavar="MADDR",
        help="addresses other peers should dial, for a host with a known public address or a forwarded "
        "port, e.g. /ip4/203.0.113.7/tcp/31337 (explicit port, also in --host-maddrs)",
    )
    p.add_argument(
        "--no-relay",
        action="store_true",
        help="never use libp2p relays: a server the dial-back check finds unreachable stops with the reason "
        "instead of joining through a relay",
    )
    p.add_argument(
        "--no-relay-service",
        action="store_true",
        help="a reachable server relays for servers behind NATs by default; this refuses",
    )
    p.add_argument(
        "--direct-port",
        type=int,
        default=None,
        metavar="PORT",
        help="also take the per-step streams on plain TCP at PORT (0: a free port), beside the p2p daemons: "
        "about 1.5 ms less per hop and step. Clients get a ticket over p2p (authenticated) first, "
        "but the TCP traffic is not encrypted: for loopback, a LAN or a private network only "
        "(default: off; petals_chain/transport/direct_stream.py)",
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
        help="private swarm: serve only the peer ids in FILE (one a line, # comments); clients and the "
        "orchestrator must be listed. Others get a NotAllowedError",
    )
    p.add_argument("--name", default="", help="human-readable name shown in records and status pages")
    p.add_argument(
        "--policy",
        default="fcfs",
        choices=list(POLICIES),
        help="local scheduling policy of steps and admissions (see below)",
    )
    p.add_argument(
        "--policy-arg",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a parameter of the policy, repeatable, e.g. --policy vtc --policy-arg w_out=2",
    )
    p.add_argument(
        "--max-batch-tokens",
        type=positive_int,
        default=2048,
        help="token budget of one batched forward; longer prompts run in chunks of at most this many "
        "tokens, interleaved with other sessions' steps (chunked prefill)",
    )
    p.add_argument(
        "--prefill-tokens-while-decoding",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="while sessions decode, a batch carries at most N prompt rows (decode steps still take the "
        "rest of --max-batch-tokens), so a decoding session's next token never waits behind a full "
        "budget of others' prompt chunks; e.g. 32 on a CPU server (0: off, the default)",
    )
    p.add_argument(
        "--batch-gather",
        type=non_negative_float,
        default=0.5,
        metavar="FRACTION",
        help="before a batch, wait for sessions expected back with their next step within this "
        "fraction of the last batch's time, so concurrent sessions share batches (0: never wait; "
        "default 0.5; server/scheduler.py)",
    )
    p.add_argument(
        "--session-idle-timeout",
        type=non_negative_float,
        default=300.0,
        help="seconds a session's stream may stay silent before the server closes it and frees its KV (0: never)",
    )
    p.add_argument(
        "--admission-timeout",
        type=non_negative_float,
        default=10.0,
        help="seconds a session may wait for KV memory in the admission queue when the budget is full "
        "(0: refuse at once with out_of_cache)",
    )
    p.add_argument(
        "--admission-queue",
        type=non_negative_int,
        default=64,
        help="sessions that may wait for KV memory at once; more are refused with out_of_cache",
    )
    p.add_argument(
        "--prefix-sharing",
        default="client",
        choices=["client", "swarm", "off"],
        help="prefix KV cache scope: client (default: a client reuses only prefixes of its own prompts; the "
        "key includes its authenticated peer id, so nobody can hit or time another's prompt), swarm "
        "(all clients share: more hits, but a hit's speed tells a client another sent that prefix, "
        "and clients' hashes are trusted: use only among trusted clients), off (no cache)",
    )
    p.add_argument(
        "--prefix-cache-max",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="most memory the prefix cache may hold (default: whatever the budget has free; it is always "
        "evicted, LRU, before a session would be refused)",
    )
    p.add_argument(
        "--prefix-cache-min",
        type=parse_size_or_zero,
        default=0,
        metavar="SIZE",
        help="memory of --memory-budget set aside for the prefix cache: sessions never take it, so cached "
        "prefixes survive a full server (advertised free slots shrink by it; default 0)",
    )
    p.add_argument(
        "--service-log",
        default=None,
        metavar="PATH",
        help="append one JSON line per batch (clients served, tokens, backlog) for fairness measurements",
    )
    p.add_argument(
        "--max-step-tokens",
        type=positive_int,
        default=None,
        help="most tokens (rows x sequence) one inference step or forward request may carry, advertised "
        "in rpc_info; larger requests get a request_too_large error (default: --max-length)",
    )
    p.add_argument("--num-threads", type=positive_int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--announce-period", type=positive_float, default=2.0, help="seconds between DHT announcements")
    p.add_argument(
        "--emulate-slowdown",
        type=float,
        default=1.0,
        metavar="K",
        help="EMULATION, off by default: every batch (and the t_I/t_O profiling) runs for real, then "
        "sleeps until it took K times its compute time, emulating a K-times slower device "
        "(server/emulation.py; used by `petals-chain experiment table1`)",
    )
    p.add_argument(
        "--test-corrupt",
        default=None,
        metavar="MODE",
        help="TEST ONLY, off by default: return WRONG hidden states, to test clients' verification "
        "(server/corruption.py): noise[:SCALE] on every step, rare:P[:SCALE] (a small perturbation "
        "on a share P of steps), skip-last (never run the last block), after:N (honest for N "
        "sessions, then noise). Never use it in a real swarm",
    )
    p.add_argument(
        "--test-corrupt-seed",
        type=non_negative_int,
        default=0,
        metavar="SEED",
        help="TEST ONLY: seed of --test-corrupt's random choices and noise",
    )
    p.add_argument(
        "--log-level",
        default="WARNING",
        type=str.upper,
        choices=LOG_LEVELS,
        help="Python logging level (default WARNING)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """`argv=None`: run as the `launch-server` program (exits the process when done, see `run_main`)."""
    return run_main("launch-server", _main, sys.argv[1:] if argv is None else argv, exit_process=argv is None)


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    # checks of the flags alone first: they answer at once, before anything heavy is imported
    if not args.emulate_slowdown >= 1.0:
        print(
            f"launch-server: --emulate-slowdown must be >= 1 (a slower device), got {args.emulate_slowdown}",
            file=sys.stderr,
        )
        return 2
    if args.test_corrupt is not None:
        from server.corruption import parse_mode  # light: no model loads

        try:
            parse_mode(args.test_corrupt)
        except ValueError as e:
            print(f"launch-server: {e}", file=sys.stderr)
            return 2
        print(
            f"launch-server: TEST ONLY --test-corrupt {args.test_corrupt}: this server returns wrong hidden states",
            file=sys.stderr,
            flush=True,
        )
    if args.num_blocks is not None and args.blocks is not None:
        print("launch-server: give --blocks START:END or --num-blocks N, not both", file=sys.stderr)
        return 2
    if args.blocks is None and args.no_orchestrator and args.num_blocks is None:
        print("launch-server: --no-orchestrator needs --blocks START:END or --num-blocks N", file=sys.stderr)
        return 2
    if args.direct_port is not None and not 0 <= args.direct_port <= 65535:
        print(
            f"launch-server: --direct-port must be in 0..65535 (0: a free port), got {args.direct_port}",
            file=sys.stderr,
        )
        return 2
    if args.blocks == "auto" and args.no_orchestrator:
        print("launch-server: --blocks auto needs an orchestrator; drop --no-orchestrator", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from petals_chain.errors import PetalsChainError
    from petals_chain.transport.membership import load_allowed_peers
    from server.policies import (  # light: checks flags before torch loads
        make_policy,
        parse_policy_args,
    )

    try:
        policy_args = parse_policy_args(args.policy, args.policy_arg)
        make_policy(args.policy, policy_args)  # the policy's own checks, before anything loads
    except PetalsChainError as e:
        print(f"launch-server: {e}", file=sys.stderr)
        return 2
    from server.block_server import BlockServer
    from server.config import ServerConfig

    stop = threading.Event()
    started = threading.Event()

    def on_signal(*_) -> None:
        stop.set()
        if not started.is_set():
            # still loading blocks or waiting for the orchestrator's assignment (a standing-by
            # server): unwind out of BlockServer's constructor, which shuts down what it started
            raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    if args.blocks is None and args.num_blocks is None:  # the default: an orchestrator decides
        args.blocks = "auto"
    start, end = (None, None) if args.blocks in ("auto", None) else args.blocks
    try:
        allowed_peers = load_allowed_peers(args.allowed_peers)
        if args.memory_budget == "auto":
            from server.memory_budget import auto_memory_budget

            args.memory_budget = auto_memory_budget(args.device)
            print(
                f"launch-server: --memory-budget auto: {args.memory_budget / 2**30:.2f} GiB on {args.device}",
                flush=True,
            )
        server = BlockServer(
            ServerConfig(
                model=args.model,
                start=start,
                end=end,
                initial_peers=args.initial_peers,
                memory_budget_bytes=args.memory_budget,
                max_length_tokens=args.max_length,
                dtype=args.dtype,
                quant=args.quant,
                device=args.device,
                adapters=args.adapters,
                host_maddrs=args.host_maddrs,
                identity_path=args.identity_path,
                name=args.name,
                policy=args.policy,
                policy_args=policy_args,
                max_batch_tokens=args.max_batch_tokens,
                batch_gather=args.batch_gather,
                prefill_tokens_while_decoding=args.prefill_tokens_while_decoding or None,
                session_idle_timeout_s=args.session_idle_timeout or None,
                admission_timeout_s=args.admission_timeout,
                admission_queue=args.admission_queue,
                service_log=args.service_log,
                prefix_sharing=args.prefix_sharing,
                prefix_cache_max_bytes=args.prefix_cache_max,
                prefix_cache_min_bytes=args.prefix_cache_min,
                max_step_tokens=args.max_step_tokens,
                announce_period_s=args.announce_period,
                record_ttl_s=3 * args.announce_period,
                num_threads=args.num_threads,
                orchestrator_wait_s=args.orchestrator_wait,
                allowed_peers=allowed_peers,
                emulate_slowdown=args.emulate_slowdown,
                test_corrupt=args.test_corrupt,
                test_corrupt_seed=args.test_corrupt_seed,
                cuda_graphs=not args.no_cuda_graphs,
                announce_maddrs=args.announce_maddrs or [],
                use_relay=not args.no_relay,
                relay_service=not args.no_relay_service,
                num_blocks=args.num_blocks,
                direct_port=args.direct_port,
                balance_quality=args.balance_quality,
                rebalance_period_s=args.rebalance_period,
            )
        )
    except PetalsChainError as e:
        print(f"launch-server: {e}", file=sys.stderr)
        return 2
    started.set()
    info = server.info()
    print(
        f"serving {info.model} blocks [{info.start}, {info.end}) as {info.peer_id} "
        f"(s_m={info.block_bytes} B, s_c={info.kv_bytes_per_block} B at {info.max_length_tokens} tokens, "
        f"t_I={info.prefill_s_per_token * 1e3:.3f} ms, t_O={info.decode_s_per_token * 1e3:.3f} ms, "
        f"free slots={info.free_kv_slots})",
        flush=True,
    )
    from petals_chain.process.signals import wait_handling_signals

    wait_handling_signals(stop)
    server.shutdown()
    print("server stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
