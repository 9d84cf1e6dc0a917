"""The `kernel` backend: veth pairs to a bridge, `tc` htb classes per destination with netem leaves.

Layout (nothing is created in the host's own namespace): a switch namespace NAME-sw holds the
bridge NAME-br and one veth end NAME-v<i> per host; the other end NAME-e<i> lives in host
namespace NAME-h<i> with the host's address. On NAME-e<i>'s egress, an htb root with one parent
class at the host's link rate and one child class per destination j (u32 match on j's address),
each with a `netem delay RTT[i][j]/2 [jitter] [loss]` leaf: every direction of every pair carries
its own one-way delay, as in the paper's §4.2.1. `programme()` is pure (unit-tested); `apply()`
runs it.
"""

from __future__ import annotations

from netem.state import (
    NetworkState,
    bridge_dev,
    switch_netns,
    veth_host_dev,
    veth_switch_dev,
)
from netem.system import run

UNLIMITED_RATE = "100gbit"  # htb needs a rate; without --bandwidth the link is this fast
NETEM_LIMIT_PACKETS = 100000  # netem's queue must hold a bandwidth-delay product of packets


def _rate(bit_s: float | None) -> str:
    return UNLIMITED_RATE if not bit_s else f"{int(round(bit_s))}bit"


def _ms(x: float) -> str:
    return f"{x:.3f}ms"


def tc_programme(state: NetworkState, i: int) -> list[list[str]]:
    """The tc commands (argv lists, run inside host i's namespace) shaping host i's egress."""
    ns, dev = state.netns(i), veth_host_dev(state.name, i)
    n = len(state.hosts)
    tc = ["ip", "netns", "exec", ns, "tc"]
    rate = _rate(state.bandwidth_bit_s)
    child_rate = _rate(state.bandwidth_bit_s / max(1, n - 1)) if state.bandwidth_bit_s else rate
    cmds = [
        # unclassified traffic (ARP) goes to htb's direct queue, undelayed
        tc + ["qdisc", "add", "dev", dev, "root", "handle", "1:", "htb"],
        tc + ["class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", rate, "ceil", rate],
    ]
    for j in range(n):
        if j == i:
            continue
        minor = _minor(j)
        cmds += [
            tc
            + [
                "class",
                "add",
                "dev",
                dev,
                "parent",
                "1:1",
                "classid",
                f"1:{minor}",
                "htb",
                "rate",
                child_rate,
                "ceil",
                rate,
            ],
            _netem_leaf(state, i, j, "add"),
            tc
            + [
                "filter",
                "add",
                "dev",
                dev,
                "parent",
                "1:",
                "protocol",
                "ip",
                "prio",
                "1",
                "u32",
                "match",
                "ip",
                "dst",
                f"{state.addresses[j]}/32",
                "flowid",
                f"1:{minor}",
            ],
        ]
    return cmds


def _minor(j: int) -> str:
    return f"{j + 16:x}"  # tc class/handle minors are hexadecimal; 1:1 is the parent


def _netem_leaf(state: NetworkState, i: int, j: int, verb: str) -> list[str]:
    """`tc qdisc add|change` of the netem leaf delaying host i's packets to host j by RTT[i][j] / 2."""
    minor = _minor(j)
    netem = ["netem", "delay", _ms(state.rtt_ms[i][j] / 2.0)]
    if state.jitter_ms > 0:
        netem.append(_ms(state.jitter_ms))
    if state.loss > 0:
        netem += ["loss", f"{state.loss * 100:.4f}%"]
    netem += ["limit", str(NETEM_LIMIT_PACKETS)]
    return [
        "ip",
        "netns",
        "exec",
        state.netns(i),
        "tc",
        "qdisc",
        verb,
        "dev",
        veth_host_dev(state.name, i),
        "parent",
        f"1:{minor}",
        "handle",
        f"{minor}:",
        *netem,
    ]


def change_delays_programme(state: NetworkState) -> list[list[str]]:
    """`tc qdisc change` of every netem leaf to the (new) delays in `state.rtt_ms`."""
    n = len(state.hosts)
    return [_netem_leaf(state, i, j, "change") for i in range(n) for j in range(n) if i != j]


def link_programme(state: NetworkState) -> list[list[str]]:
    """The ip commands building the switch namespace, bridge and veth pairs (host namespaces exist)."""
    sw, br = switch_netns(state.name), bridge_dev(state.name)
    prefix = state.subnet.split("/")[1]
    cmds = [
        ["ip", "netns", "add", sw],
        ["ip", "-n", sw, "link", "add", br, "type", "bridge"],
        ["ip", "-n", sw, "link", "set", br, "up"],
    ]
    for i, addr in enumerate(state.addresses):
        ns, e, v = state.netns(i), veth_host_dev(state.name, i), veth_switch_dev(state.name, i)
        cmds += [
            ["ip", "link", "add", v, "netns", sw, "type", "veth", "peer", "name", e, "netns", ns],
            ["ip", "-n", sw, "link", "set", v, "master", br, "up"],
            ["ip", "-n", ns, "addr", "add", f"{addr}/{prefix}", "dev", e],
            ["ip", "-n", ns, "link", "set", e, "up"],
        ]
    return cmds


def apply(state: NetworkState) -> None:
    for cmd in link_programme(state):
        run(cmd)
    for i in range(len(state.hosts)):
        for cmd in tc_programme(state, i):
            run(cmd)


def kernel_has_netem(probe_ns: str) -> tuple[bool, str]:
    """Whether a netem qdisc can be created, tried on the loopback of a throwaway namespace we own."""
    run(["ip", "netns", "add", probe_ns])
    try:
        proc = run(
            ["ip", "netns", "exec", probe_ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
            check=False,
        )
        return proc.returncode == 0, (proc.stderr.strip() or "ok")
    finally:
        run(["ip", "netns", "del", probe_ns], check=False)
