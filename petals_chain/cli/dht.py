"""`petals-chain dht`: start a bootstrap DHT peer, print its full multiaddrs, serve until Ctrl-C/SIGTERM."""

from __future__ import annotations

import signal
import sys
import threading

from petals_chain.cli.args import CliParser, identity_path, listen_maddr, peer_maddr


def main(argv: list[str]) -> int:
    p = CliParser(prog="petals-chain dht", description=__doc__)
    p.add_argument(
        "--host-maddrs",
        nargs="*",
        default=["/ip4/127.0.0.1/tcp/0"],
        type=listen_maddr,
        help="multiaddrs to listen on (default /ip4/127.0.0.1/tcp/0; use /ip4/0.0.0.0/tcp/PORT to accept remote peers)",
    )
    p.add_argument(
        "--initial-peers",
        nargs="*",
        default=[],
        type=peer_maddr,
        help="join an existing DHT instead of starting a new one",
    )
    p.add_argument(
        "--identity-path",
        default=None,
        type=identity_path,
        help="file with a private key, for a stable peer id across restarts",
    )
    p.add_argument(
        "--no-relay-service",
        action="store_true",
        help="do not relay for servers behind NATs (by default this peer relays and answers their "
        "dial-back reachability checks)",
    )
    args = p.parse_args(argv)
    from petals_chain.process.loop import BackgroundLoop
    from petals_chain.process.signals import start_dht, wait_handling_signals
    from petals_chain.swarm.identity import SwarmIdentity
    from petals_chain.swarm.reachability import p2pd_flags, serve_dial_back

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    identity = SwarmIdentity.load_or_create(args.identity_path)
    with p2pd_flags(relay_service=not args.no_relay_service):
        dht = start_dht(initial_peers=args.initial_peers, host_maddrs=args.host_maddrs, **identity.dht_kwargs())
    loop = BackgroundLoop("dht-p2p")
    loop.run(serve_dial_back(loop.run(dht.replicate_p2p(), timeout_s=30)), timeout_s=30)
    for maddr in dht.get_visible_maddrs():
        print(maddr, flush=True)
    print("DHT peer running; pass the address above as --initial-peers. Ctrl-C stops it.", file=sys.stderr, flush=True)
    wait_handling_signals(stop)
    dht.shutdown()
    loop.stop()
    return 0
