"""`petals-chain identity new PATH | show PATH`: make a peer identity file, or print its peer id.

A peer's identity is an RSA private key in libp2p's format (what hivemind's p2p daemon reads). Pass
it as `--identity-path` to `launch-server`, `petals-chain orchestrator` or `petals-chain dht` to keep
the same peer id across restarts; the same key signs the peer's DHT records.
"""

from __future__ import annotations

import argparse
import os
import sys

from petals_chain.cli.args import CliParser, identity_path


def main(argv: list[str]) -> int:
    p = CliParser(
        prog="petals-chain identity", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="action", required=True)
    new = sub.add_parser("new", help="write a new identity to PATH (refuses to overwrite) and print its peer id")
    new.add_argument("path", type=identity_path, help="where to write it (the folder must exist)")
    show = sub.add_parser("show", help="print the peer id of the identity in PATH")
    show.add_argument("path", help="an identity file")
    args = p.parse_args(argv)
    if args.action == "new" and os.path.exists(args.path):
        print(
            f"petals-chain identity: {args.path} exists; `petals-chain identity show {args.path}` prints its "
            "peer id (remove the file first to replace it)",
            file=sys.stderr,
        )
        return 2
    if args.action == "show" and not os.path.isfile(args.path):
        print(
            f"petals-chain identity: no file {args.path}; make one with `petals-chain identity new {args.path}`",
            file=sys.stderr,
        )
        return 2
    from petals_chain.errors import (
        IdentityError,  # after the checks: hivemind takes seconds to import
    )
    from petals_chain.swarm.identity import SwarmIdentity

    try:
        print(SwarmIdentity.load_or_create(args.path).peer_id)
    except IdentityError as e:
        print(f"petals-chain identity: {e}", file=sys.stderr)
        return 2
    return 0
