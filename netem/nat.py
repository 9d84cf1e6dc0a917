"""Emulated home networks: a host that sits behind a NAT router.

A host listed in `Network(..., behind_nat=[...])` keeps its WAN namespace NAME-h<i> (its emulated
WAN address, its RTTs to the other hosts), but that namespace becomes the host's *router*: the
processes of the host run in a private namespace NAME-n<i> behind it, joined by a veth pair
(NAME-x<i> in the router, NAME-y<i> in the private namespace) on the private subnet
192.168.<i+1>.0/24 (router .1, host .2). The router forwards and masquerades what the host sends
(source NAT onto the router's WAN address, *only* out of the emulated WAN device: the hub's TUN or
the kernel backend's veth), and, like a home router without port forwarding, accepts nothing that
was not asked for: a connection from the WAN to the router's address is refused, and the private
subnet is not routed on the WAN at all. Both namespaces are the network's own, so the NAT never
touches the machine's real interfaces and leaves with `down` (the rules live in the router
namespace and vanish with it).

The masquerade rule is installed with `nft` or `iptables`, whichever is present (the distribution's
packages: `make nat-tools` installs nftables on Debian/Ubuntu); `nat_tool()` says which, or raises
`MissingCapabilityError` with the install hint.
"""

from __future__ import annotations

import shutil

from netem.errors import MissingCapabilityError
from netem.state import NetworkState, nat_addresses, nat_netns, tun_dev, veth_host_dev
from netem.system import run


def nat_tool() -> str:
    """`nft` or `iptables` (the first found on PATH), else MissingCapabilityError saying how to get one."""
    for tool in ("nft", "iptables"):
        if shutil.which(tool):
            return tool
    raise MissingCapabilityError(
        "an emulated NAT needs `nft` or `iptables` (Debian/Ubuntu, as root: "
        "`make nat-tools`, i.e. apt-get install nftables)"
    )


def wan_device(state: NetworkState, i: int) -> str:
    """The router's emulated WAN interface: the only one the masquerade may leave through."""
    return tun_dev(state.name, i) if state.backend == "userspace" else veth_host_dev(state.name, i)


def masquerade_programme(tool: str, router_ns: str, subnet: str, wan_dev: str) -> list[list[str]]:
    """The commands (argv lists) installing source NAT of `subnet` out of `wan_dev` inside `router_ns`."""
    ex = ["ip", "netns", "exec", router_ns]
    if tool == "nft":
        return [
            ex + ["nft", "add", "table", "ip", "pcnat"],
            ex
            + [
                "nft",
                "add",
                "chain",
                "ip",
                "pcnat",
                "post",
                "{ type nat hook postrouting priority 100 ; policy accept ; }",
            ],
            ex + ["nft", "add", "rule", "ip", "pcnat", "post", "ip", "saddr", subnet, "oifname", wan_dev, "masquerade"],
        ]
    return [ex + ["iptables", "-t", "nat", "-A", "POSTROUTING", "-s", subnet, "-o", wan_dev, "-j", "MASQUERADE"]]


def apply_nat(state: NetworkState, i: int, tool: str) -> None:
    """Put host i behind a NAT router (see the module docstring). Its WAN namespace must exist."""
    router_ns, host_ns = state.netns(i), nat_netns(state.name, i)
    (router_ip, host_ip), prefix = nat_addresses(i), "24"
    inside, outside = f"{state.name}-y{i}", f"{state.name}-x{i}"
    run(["ip", "netns", "add", host_ns])
    run(["ip", "-n", host_ns, "link", "set", "lo", "up"])
    for key in ("all", "default"):
        run(["ip", "netns", "exec", host_ns, "sysctl", "-q", "-w", f"net.ipv6.conf.{key}.disable_ipv6=1"])
    # created in the router namespace and moved: nothing appears in the machine's own namespace
    run(["ip", "-n", router_ns, "link", "add", outside, "type", "veth", "peer", "name", inside, "netns", host_ns])
    run(["ip", "-n", router_ns, "addr", "add", f"{router_ip}/{prefix}", "dev", outside])
    run(["ip", "-n", router_ns, "link", "set", outside, "up"])
    run(["ip", "-n", host_ns, "addr", "add", f"{host_ip}/{prefix}", "dev", inside])
    run(["ip", "-n", host_ns, "link", "set", inside, "up"])
    run(["ip", "-n", host_ns, "route", "add", "default", "via", router_ip])
    run(["ip", "netns", "exec", router_ns, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
    for cmd in masquerade_programme(tool, router_ns, f"{router_ip.rsplit('.', 1)[0]}.0/{prefix}", wan_device(state, i)):
        run(cmd)
