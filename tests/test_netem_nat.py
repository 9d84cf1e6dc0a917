"""An emulated home network: a host behind a NAT router reaches the WAN (seen from there as its router's
address), while nothing on the WAN can open a connection to it; `down` removes the private namespace and
its rules with the rest. Needs root, ip, /dev/net/tun and nft or iptables (`make nat-tools`); skips saying
which is missing."""

from __future__ import annotations

import socket
import threading

import pytest

from netem.nat import masquerade_programme
from netem.state import owned_netns
from netem.system import list_netns, socket_in_netns
from tests.swarm_helpers import emulated_network


def test_masquerade_leaves_only_through_the_emulated_wan_device():
    for tool in ("nft", "iptables"):
        cmds = masquerade_programme(tool, "pc-h2", "192.168.3.0/24", "pc-t2")
        assert all(c[:4] == ["ip", "netns", "exec", "pc-h2"] for c in cmds)  # only inside the router namespace
        rule = cmds[-1]
        assert "192.168.3.0/24" in rule and "pc-t2" in rule
        assert rule[rule.index("pc-t2") - 1] in ("-o", "oifname")


@pytest.fixture
def nat_net():
    with emulated_network(["a", "b", "home"], [[0, 10, 20], [10, 0, 30], [20, 30, 0]], "n", behind_nat=["home"]) as net:
        name = net.name
        yield net
    assert not owned_netns(name, list_netns()), list_netns()  # the private namespace went too


def _connect(net, src: str, addr: str, port: int) -> str:
    sock = socket_in_netns(net.netns(src), socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(3)
    try:
        sock.connect((addr, port))
        return "connected"
    except ConnectionRefusedError:
        return "refused"
    except OSError as e:
        return f"error {e.errno}"
    finally:
        sock.close()


def _listen(net, host: str) -> tuple[socket.socket, int]:
    srv = socket_in_netns(net.netns(host), socket.AF_INET, socket.SOCK_STREAM)
    srv.bind((net.address(host), 0))
    srv.listen()
    srv.settimeout(5)
    return srv, srv.getsockname()[1]


@pytest.mark.integration
def test_a_host_behind_the_nat_reaches_out_and_cannot_be_reached(nat_net):
    net = nat_net
    assert net.behind_nat("home") and not net.behind_nat("a")
    assert net.address("home").startswith("192.168.") and net.wan_address("home") == "10.213.0.3"
    assert len({net.netns("home"), net.state.netns(2)}) == 2  # processes run behind the router namespace

    srv, port = _listen(net, "a")
    seen: list[str] = []
    t = threading.Thread(target=lambda: seen.append(srv.accept()[1][0]))
    t.start()
    assert _connect(net, "home", net.address("a"), port) == "connected"
    t.join(5)
    srv.close()
    assert seen == [net.wan_address("home")]  # masqueraded onto the router's WAN address

    home_srv, home_port = _listen(net, "home")
    try:
        assert _connect(net, "b", net.wan_address("home"), home_port) == "refused"  # no port forwarding
        assert _connect(net, "b", net.address("home"), home_port).startswith("error")  # private range not routed
    finally:
        home_srv.close()
