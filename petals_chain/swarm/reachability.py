"""Reachability and libp2p relays: servers behind NATs join the swarm through relay peers.

1. **Dial-back check** (`check_reachability`, before a server starts its DHT): a throwaway p2p daemon
   (DHT client, no relay) joins the initial peers on the server's own listen addresses and asks each
   of them (`DIAL_BACK_HANDLER`, served by `petals-chain dht` and by reachable servers) to open a
   plain TCP connection back to the address the request arrived from (the requester's IP as that peer
   sees it: a NAT's public address) on the server's listen ports. A TCP dial, not a libp2p one, so the
   probe's own outbound connection is never what answers. `direct` when any peer got through,
   `relayed` when every answering peer failed, `unknown` when nobody answered (the server then runs as
   a direct peer and says so). A peer dials only the requester's own observed IPs, so the service
   cannot be used to probe third parties.
2. **Relayed join** (`relayed_dht_kwargs`): a server that is not reachable runs its DHT in client mode
   (nobody puts it in a routing table), with hivemind's `use_auto_relay` and the initial peers as
   static relays, reachability forced `private` (AutoNAT on a small swarm never concludes it on its
   own) and p2pd's relay discovery off: with discovery on, go-libp2p's autorelay waits for 4
   candidates or 3 minutes before reserving a slot; with static relays it reserves at once. It
   announces `<relay>/p2p-circuit` addresses (`ServerInfo.relay_maddrs`).
3. **Dialing a relayed server** (`RelayRoutes`): p2pd drops circuit addresses built on private relay
   IPs from what it advertises, so other peers cannot learn them by identify/DHT; clients and the
   orchestrator read them from the server's record and connect through them explicitly before
   opening streams. libp2p then reuses that connection, or any direct one the NATed server opened.
4. **A relayed server's RTT** (`relayed_rtt_s`): what a client's traffic pays is client -> relay ->
   server. The orchestrator cannot probe that path reliably: the NATed server's own traffic to it
   (DHT requests every few seconds) opens direct connections, and an orchestrator dial on its listen
   port can even pass the NAT on the conntrack entry such a connection left behind; either way libp2p
   prefers the direct connection, which no client has. So a relayed server measures its RTT to each
   relay (DHT pings, `ServerInfo.relay_rtt_s`), the orchestrator its own to the relay, and the sum,
   over the best relay, is the server's RTT.

Every public peer (the bootstrap DHT peer, reachable servers) runs p2pd's relay service, unless told
not to (`--no-relay-service`: p2pd's `-relayService=0`). hivemind's `P2P.create` takes neither that
flag nor `-relayDiscovery`; `p2pd_flags` adds them to the daemon's command line while a DHT starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from dataclasses import dataclass
from typing import Iterable, Iterator

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon import Multiaddr
from hivemind.proto import runtime_pb2

from petals_chain.errors import InvalidRequestError, PetalsChainError
from petals_chain.transport.protocol import call_unary
from petals_chain.wire import codec as wire
from petals_chain.wire.record import WireRecord
from petals_chain.wire.records import Reachability

logger = logging.getLogger(__name__)

DIAL_BACK_HANDLER = "petals_chain.dial_back"
DIAL_BACK_TIMEOUT_S = 3.0  # one TCP connect back to the requester
MAX_DIAL_PORTS = 4
MAX_DIAL_IPS = 4
_P2P_CODE, _P2P_CIRCUIT_CODE = b"\xa5\x03", b"\xa2\x02"  # multicodec varints of /p2p and /p2p-circuit


class UnreachableError(PetalsChainError):
    """A server that no peer can reach and that may not (or cannot) join through a relay."""


@dataclass
class DialBackRequest(WireRecord):
    ports: tuple[int, ...]  # the requester's TCP listen ports

    def check(self) -> None:
        if not 0 < len(self.ports) <= MAX_DIAL_PORTS or not all(0 < p < 65536 for p in self.ports):
            raise InvalidRequestError(f"ports: 1..{MAX_DIAL_PORTS} TCP ports in 1..65535, got {list(self.ports)[:8]}")


@dataclass
class DialBackReply(WireRecord):
    reachable: bool
    dialed: tuple[str, ...]  # "ip:port ok|refused|timeout|..." per attempt, for the requester's log


# -- p2pd's command line ---------------------------------------------------------------------------
@contextlib.contextmanager
def p2pd_flags(*, relay_service: bool = True) -> Iterator[None]:
    """While active, p2p daemons started by this process (a DHT's is started in the child it forks
    here, which keeps the patched function) get `-relayService=0` when `relay_service` is False, and
    `-relayDiscovery=0` whenever static relays (`trustedRelays`) are given (see the module doc)."""
    original = P2P.__dict__["_make_process_args"]

    def make_args(*args, **kwargs):
        if kwargs.get("trustedRelays"):
            kwargs["relayDiscovery"] = False
        if not relay_service:
            kwargs["relayService"] = False
        return original.__func__(*args, **kwargs)

    P2P._make_process_args = staticmethod(make_args)
    try:
        yield
    finally:
        P2P._make_process_args = original


def relayed_dht_kwargs(relays: list[str]) -> dict:
    """hivemind DHT arguments of a server that joins through `relays` (full multiaddrs with /p2p/)."""
    return dict(client_mode=True, use_auto_relay=True, force_reachability="private", trusted_relays=list(relays))


def relay_peer_id(maddr: str) -> str | None:
    """The relay's peer id in `<relay maddr>/p2p/<id>[/p2p-circuit]`, None without one."""
    parts = maddr.rstrip("/").split("/")
    ids = [parts[i + 1] for i, x in enumerate(parts[:-1]) if x == "p2p"]
    return ids[0] if ids else None


async def _dht_ping(peer_id: str, timeout_s: float, _dht, node) -> float | None:
    """(runs in the DHT's process) seconds of one DHT ping round trip to `peer_id`; None: no answer."""
    t0 = time.perf_counter()
    got = await asyncio.wait_for(node.protocol.call_ping(PeerID.from_base58(peer_id)), timeout_s)
    return None if got is None else time.perf_counter() - t0


def dht_ping_s(dht, peer_id: str, timeout_s: float = 5.0) -> float | None:
    """One DHT ping round trip (s) from this process's hivemind DHT to `peer_id` (any DHT peer: a relay is
    the bootstrap `petals-chain dht` peer, which serves no rpc_info); None when it does not answer."""
    try:
        return dht.run_coroutine(functools.partial(_dht_ping, peer_id, timeout_s))
    except Exception as e:  # noqa: BLE001 - a dead relay or a DHT shutting down: no sample
        logger.debug("DHT ping of %s failed: %s", peer_id[-8:], e)
        return None


def relayed_rtt_s(to_relay_s: dict[str, float | None], relay_to_server_s: dict[str, float]) -> float | None:
    """A relayed server's RTT as a client's traffic pays it: the measurer's RTT to a relay plus the
    server's to that relay, over the relay where the sum is smallest; None when no relay has both."""
    sums = [
        a + b
        for r, a in to_relay_s.items()
        if a is not None and (b := relay_to_server_s.get(r)) is not None and a >= 0 and b >= 0
    ]
    return min(sums) if sums else None


def circuit_maddrs(relays: Iterable[str]) -> tuple[str, ...]:
    """The relayed addresses a server behind `relays` announces: `<relay>/p2p-circuit`."""
    return tuple(f"{r.rstrip('/')}/p2p-circuit" for r in relays if "/p2p/" in r)


def encode_circuit(maddr: str) -> Multiaddr:
    """`/ip4/A/tcp/P/p2p/RELAY/p2p-circuit` in the binary form p2pd parses. hivemind's multiaddr library
    writes a /p2p/ component as a CIDv1 (40 bytes), which p2pd's control API refuses ("length greater
    than remaining number of bytes"); p2pd expects the peer id's bare multihash."""
    head, _, rest = maddr.partition("/p2p/")
    relay = rest.split("/", 1)[0]
    if not relay or not rest.endswith("p2p-circuit"):
        raise ValueError(f"not a relay circuit address: {maddr!r} (expected .../p2p/RELAY_ID/p2p-circuit)")
    mh = PeerID.from_base58(relay).to_bytes()
    return Multiaddr(Multiaddr(head).to_bytes() + _P2P_CODE + bytes([len(mh)]) + mh + _P2P_CIRCUIT_CODE)


# -- the dial-back service ---------------------------------------------------------------------------
def _ip_port(maddr) -> tuple[str, int] | None:
    parts = str(maddr).split("/")
    if len(parts) >= 5 and parts[1] == "ip4" and parts[3] == "tcp":
        return parts[2], int(parts[4])
    return None


async def _dial(ip: str, port: int, timeout_s: float) -> str:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), timeout_s)
    except asyncio.TimeoutError:
        return f"{ip}:{port} timeout"
    except OSError as e:
        return f"{ip}:{port} {type(e).__name__}"
    writer.close()
    return f"{ip}:{port} ok"


async def serve_dial_back(p2p: P2P) -> None:
    """Answer other peers' dial-back requests on `p2p` (the bootstrap DHT peer, reachable servers)."""

    async def handle(request: runtime_pb2.ExpertRequest, context) -> runtime_pb2.ExpertResponse:
        try:
            req = wire.decode_request(request, DialBackRequest)
        except Exception as e:
            return wire.error_response(e)
        peers = await p2p.list_peers()
        observed = [
            ip_port
            for info in peers
            if info.peer_id == context.remote_id
            for a in info.addrs
            if (ip_port := _ip_port(a)) is not None
        ]
        ips = list(dict.fromkeys(ip for ip, _ in observed))[:MAX_DIAL_IPS]
        dialed = await asyncio.gather(*(_dial(ip, port, DIAL_BACK_TIMEOUT_S) for ip in ips for port in req.ports))
        return wire.response(DialBackReply(any(d.endswith(" ok") for d in dialed), tuple(dialed)))

    await p2p.add_protobuf_handler(DIAL_BACK_HANDLER, handle, runtime_pb2.ExpertRequest)


@dataclass(frozen=True)
class ReachabilityCheck:
    reachability: Reachability
    detail: str  # what each asked peer saw, for the log


async def check_reachability(
    initial_peers: list[str],
    host_maddrs: list[str],
    announce_maddrs: list[str] | None = None,
    *,
    timeout_s: float = 10.0,
) -> ReachabilityCheck:
    """Ask the initial peers to dial this host back (see the module doc). Needs the listen ports: with
    `/tcp/0` the probe gets its own port, which says the same for a NAT without port forwarding."""
    probe = await P2P.create(
        initial_peers=initial_peers,
        host_maddrs=host_maddrs,
        announce_maddrs=announce_maddrs,
        dht_mode="client",
        use_relay=False,
        auto_nat=False,
        nat_port_map=False,
    )
    try:
        ports = tuple(
            dict.fromkeys(
                p for a in await probe.get_visible_maddrs(latest=True) if (p := (_ip_port(a) or (None, None))[1])
            )
        )[:MAX_DIAL_PORTS]
        answers: list[str] = []
        reachable = 0
        for maddr in initial_peers:
            peer = maddr.rsplit("/p2p/", 1)[-1]
            try:
                resp = await call_unary(
                    probe.call_protobuf_handler(
                        PeerID.from_base58(peer),
                        DIAL_BACK_HANDLER,
                        wire.request(DialBackRequest(ports)),
                        runtime_pb2.ExpertResponse,
                    ),
                    timeout_s,
                )
                reply = wire.decode_reply(wire.unpack(resp.metadata), DialBackReply)
            except Exception as e:
                answers.append(f"{peer[-8:]}: no answer ({type(e).__name__})")
                continue
            reachable += reply.reachable
            answers.append(f"{peer[-8:]}: {', '.join(reply.dialed) or 'no address to dial'}")
        asked = sum(1 for a in answers if "no answer" not in a)
        verdict = Reachability.UNKNOWN if not asked else Reachability.DIRECT if reachable else Reachability.RELAYED
        return ReachabilityCheck(verdict, "; ".join(answers) or "no initial peers to ask")
    finally:
        await probe.shutdown()


# -- dialing relayed servers --------------------------------------------------------------------------
class RelayRoutes:
    """Relayed servers' circuit addresses (from their ServerInfo records), and connecting through them.
    Owned by one client or orchestrator; call `update` with the records it fetched."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.routes: dict[str, tuple[str, ...]] = {}
        self.server_to_relay_s: dict[str, dict[str, float]] = {}  # relayed peer -> its RTT to each relay
        self.known: set[str] = set()  # every peer whose record was seen (relayed or not)
        self._dialed_s: dict[str, float] = {}

    def update(self, infos) -> None:
        for info in infos:
            self.known.add(info.peer_id)
            if info.reachability == Reachability.RELAYED and info.relay_maddrs:
                self.routes[info.peer_id] = tuple(info.relay_maddrs)
                self.server_to_relay_s[info.peer_id] = dict(info.relay_rtt_s)
            else:
                self.routes.pop(info.peer_id, None)
                self.server_to_relay_s.pop(info.peer_id, None)

    def relayed(self, peer_id: str) -> bool:
        return peer_id in self.routes

    async def connect(
        self,
        p2p: P2P,
        peer_id: str,
        *,
        min_interval_s: float = 0.0,
        timeout_s: float = 10.0,
        via_relay_only: bool = False,
    ) -> bool:
        """Connect to a relayed peer through its relays (a no-op for others, and when connected already:
        p2pd returns at once). False, logged, when no relay got through. `via_relay_only`: first drop any
        connection the NATed peer opened to us itself (libp2p prefers a direct one), so what follows runs
        over the relay as a client's traffic would: the orchestrator measures tau_c that way."""
        maddrs = self.routes.get(peer_id)
        now = self.clock()
        if not maddrs or now - self._dialed_s.get(peer_id, -1e18) < min_interval_s:
            return True
        self._dialed_s[peer_id] = now
        try:
            if via_relay_only:
                await asyncio.wait_for(p2p._client.disconnect(PeerID.from_base58(peer_id)), timeout_s)
            # hivemind's P2P has no public connect(); its daemon client's connect adds the addresses to
            # the peerstore and dials them
            await asyncio.wait_for(
                p2p._client.connect(PeerID.from_base58(peer_id), [encode_circuit(m) for m in maddrs]), timeout_s
            )
            return True
        except Exception as e:
            logger.warning("connecting to relayed server %s through %s failed: %s", peer_id[-8:], ", ".join(maddrs), e)
            return False
