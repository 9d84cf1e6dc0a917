"""`petals-chain netem up|exec|status|down`: an emulated WAN that outlives the command.

`up` builds the network and returns; the userspace backend's delay hub keeps running in the
background (its pid and the topology in the state file), so `exec`, `status` and `down` work from
any shell. Uses only `netem` (DESIGN.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys

import numpy as np

from netem.cpu import parse_shares
from netem.errors import NetemError, TopologyError
from netem.network import (
    BACKENDS,
    Network,
    cleanup,
    command_in,
    cpu_report,
    hub_alive,
    measure_state_rtt_ms,
)
from netem.state import DEFAULT_NAME, read_state
from netem.topology import (
    RIPE_ATLAS_FILENAME,
    DataNotFoundError,
    Topology,
    load_topology_json,
    resolve_data_file,
    ripe_topology,
    synthetic_topology,
)

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_bandwidth_bit_s(text: str) -> float:
    """`1Gbit`, `100mbit`, `500kbit`, `1e6` (bit/s) -> bit/s; `Gbps`/`MBps`-style byte units are refused."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]?)(bit|bps)?(?:/s)?\s*", text.lower())
    if not m or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"bandwidth {text!r}: write a positive rate like 1Gbit, 100Mbit, 500kbit")
    return float(m.group(1)) * _UNITS[m.group(2)]


def load_topology(spec: str, n_hosts: int | None, seed: int, data: str | None) -> Topology:
    if spec not in ("ripe", "synthetic"):
        topo = load_topology_json(spec)
        if n_hosts is not None and n_hosts != len(topo.hosts):
            raise TopologyError(f"--hosts {n_hosts} but {spec} has {len(topo.hosts)} hosts; leave out --hosts")
        return topo
    if n_hosts is None or n_hosts < 2:
        raise TopologyError(f"--topology {spec} needs --hosts N (N >= 2)")
    rng = np.random.default_rng(seed)
    if spec == "synthetic":
        return synthetic_topology(n_hosts, rng, seed_label=str(seed))
    try:
        path = resolve_data_file(RIPE_ATLAS_FILENAME, data)
    except DataNotFoundError as e:
        raise TopologyError(f"{e}; or use --topology synthetic / a JSON file") from None
    return ripe_topology(n_hosts, rng, path, seed_label=str(seed))


def _fmt_matrix(hosts, target, measured) -> str:
    width = max(8, *(len(h) for h in hosts))
    lines = [
        "RTT ms, target / measured (row: from, column: to)",
        " " * width + "".join(h[:14].rjust(16) for h in hosts),
    ]
    for i, h in enumerate(hosts):
        cells = []
        for j in range(len(hosts)):
            m = measured[i][j]
            cells.append(("-" if i == j else f"{target[i][j]:.1f}/{'lost' if math.isnan(m) else f'{m:.1f}'}").rjust(16))
        lines.append(h.ljust(width) + "".join(cells))
    return "\n".join(lines)


def cmd_up(args) -> int:
    topo = load_topology(args.topology, args.hosts, args.seed, args.data)
    cpu = None
    if args.cpu:
        default, per = parse_shares(args.cpu)
        unknown = sorted(set(per) - set(topo.hosts))
        if unknown:
            raise NetemError(
                f"--cpu names hosts this topology does not have: {', '.join(unknown)} (hosts: {', '.join(topo.hosts)})"
            )
        cpu = {h: per.get(h, default) for h in topo.hosts if per.get(h, default) is not None}
    net = Network(
        list(topo.hosts),
        [list(r) for r in topo.rtt_ms],
        backend=args.backend,
        bandwidth_bit_s=args.bandwidth,
        jitter_ms=args.jitter_ms,
        loss=args.loss,
        name=args.name,
        seed=args.seed,
        detach=True,
        log=lambda msg: print(msg, file=sys.stderr, flush=True),
        cpu=cpu,
        behind_nat=[topo.hosts[int(h)] if h.isdigit() else h for h in args.behind_nat],
    )
    net.up()
    print(
        f"network {args.name}: {len(topo.hosts)} hosts, topology {topo.source}, backend {net.backend}"
        + (f", uplinks {args.bandwidth / 1e6:g} Mbit/s" if args.bandwidth else "")
    )
    for h in net.hosts:
        print(f"{h}\t{net.address(h)}" + (f"\tbehind NAT {net.wan_address(h)}" if net.behind_nat(h) else ""))
    if not args.no_measure:
        print(_fmt_matrix(net.hosts, net.state.rtt_ms, net.measure_rtt_ms(probes=3)))
    print(
        f"run commands inside a host: petals-chain netem exec {net.hosts[0]} -- CMD ...; "
        f"tear down: petals-chain netem down" + ("" if args.name == DEFAULT_NAME else f" --name {args.name}"),
        file=sys.stderr,
    )
    return 0


def cmd_exec(args) -> int:
    st = read_state(args.name)
    host = args.host
    if host not in st.hosts and host.isdigit():
        host = int(host)  # a host may also be named by its index
    full = command_in(st, host, args.cmd)
    os.execvp(full[0], full)  # replaces this process: exit status and signals are the command's


def cmd_status(args) -> int:
    st = read_state(args.name)
    n = len(st.hosts)
    if st.backend == "userspace" and not hub_alive(st.hub_pid, st.name):
        # the TUN devices (and with them the addresses) died with the hub: nothing to measure
        print(
            f"petals-chain netem status: the delay hub of {st.name} is not running (crashed?): no packet crosses "
            f"the network; `petals-chain netem down --name {st.name}` and `up` again",
            file=sys.stderr,
        )
        measured, rc = [[0.0 if i == j else math.nan for j in range(n)] for i in range(n)], 1
    else:
        measured, rc = measure_state_rtt_ms(st, probes=args.probes), 0
    if args.json:
        clean = [[None if math.isnan(x) else x for x in row] for row in measured]
        print(
            json.dumps(
                {
                    "backend": st.backend,
                    "name": st.name,
                    "cpu": cpu_report(st),
                    "hosts": [
                        {"name": h, "address": a, "netns": st.netns(i)}
                        for i, (h, a) in enumerate(zip(st.hosts, st.addresses))
                    ],
                    "bandwidth_bit_s": st.bandwidth_bit_s,
                    "rtt_ms": {"target": st.rtt_ms, "measured": clean},
                }
            )
        )
        return rc
    print(f"network {st.name}: backend {st.backend}, hub pid {st.hub_pid or '-'}")
    for i, (h, a) in enumerate(zip(st.hosts, st.addresses)):
        print(f"{h}\t{a}\tnetns {st.netns(i)}")
    print(_fmt_matrix(st.hosts, st.rtt_ms, measured))
    return rc


def cmd_down(args) -> int:
    removed = cleanup(None if args.all else args.name)
    print("removed: " + (", ".join(removed) if removed else "nothing (no network of that name was up)"))
    return 0


class _OneLineParser(argparse.ArgumentParser):
    """argparse errors as one line (the project's CLI rule; netem imports nothing of petals_chain, whose
    `cli_args.CliParser` does the same for the other commands)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _OneLineParser(
        prog="petals-chain netem", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="action", required=True)
    up = sub.add_parser("up", help="create the hosts (namespaces) and links, print each host's address")
    up.add_argument("--hosts", type=int, default=None, help="number of hosts (ripe, synthetic)")
    up.add_argument(
        "--topology",
        default="ripe",
        help="ripe (RIPE Atlas EU anchors, default), synthetic, or FILE.json "
        '({"hosts": [...], "rtt_ms": [[...], ...]}, symmetric, zero diagonal)',
    )
    up.add_argument("--seed", type=int, default=0, help="which anchors/points are drawn; also the jitter/loss RNG")
    up.add_argument(
        "--data", default=None, help="RIPE Atlas CSV or its folder (default $PETALS_CHAIN_DATA, ../shared/data)"
    )
    up.add_argument(
        "--backend",
        choices=BACKENDS,
        default="auto",
        help="kernel (tc netem), userspace (TUN + delay hub), auto: kernel when sch_netem exists",
    )
    up.add_argument("--bandwidth", type=parse_bandwidth_bit_s, default=None, help="each host's uplink, e.g. 1Gbit")
    up.add_argument(
        "--jitter-ms",
        type=float,
        default=0.0,
        help="each packet's one-way delay varies uniformly by up to +- this, ms (default 0)",
    )
    up.add_argument("--loss", type=float, default=0.0, help="packet loss probability per direction, in [0, 1)")
    up.add_argument("--no-measure", action="store_true", help="skip the RTT measurement after setup")
    up.add_argument(
        "--behind-nat",
        nargs="+",
        default=[],
        metavar="HOST",
        help="hosts (names or indices) that sit behind an emulated home NAT: they reach every host, "
        "nobody can connect to them (needs nft or iptables: make nat-tools)",
    )
    up.add_argument(
        "--cpu",
        default=None,
        metavar="SHARES",
        help="a CPU share (cores) per host: 0.25 for every host, or HOST=0.5,HOST2=0.25 (*=0.1 for the "
        "rest); cgroup v2 cpu.max or v1 cfs quota, cores pinned where there are enough",
    )
    ex = sub.add_parser("exec", help="run a command inside a host: exec [--name NAME] HOST -- CMD ...")
    ex.add_argument("host", help="host name (or index)")
    ex.add_argument("cmd", nargs="*", help="the command, after `--`")
    stp = sub.add_parser("status", help="hosts, target RTTs and a fresh measurement")
    stp.add_argument("--json", action="store_true", help="print one JSON object (schema: README) instead of a table")
    stp.add_argument("--probes", type=int, default=5, help="UDP probes per host pair for the measured RTTs (default 5)")
    dn = sub.add_parser("down", help="remove everything (also what a crashed run left)")
    dn.add_argument("--all", action="store_true", help="every network recorded in the state folder")
    for sp in (up, ex, stp, dn):
        sp.add_argument(
            "--name", default=DEFAULT_NAME, help=f"network name, prefix of everything created (default {DEFAULT_NAME})"
        )
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if argv[:1] == ["exec"] and "--" in argv:  # everything after `--` is the command, options included
        k = argv.index("--")
        argv, command = argv[:k], argv[k + 1 :]
    args = build_parser().parse_args(argv)
    if args.action == "exec":
        args.cmd = args.cmd + command
    if args.action == "exec" and not args.cmd:
        print("petals-chain netem exec: give a command: exec HOST -- CMD ...", file=sys.stderr)
        return 2
    try:
        return {"up": cmd_up, "exec": cmd_exec, "status": cmd_status, "down": cmd_down}[args.action](args)
    except (NetemError, TopologyError) as e:
        print(f"petals-chain netem {args.action}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
