"""Direct TCP streams for the per-step RPCs (`rpc_inference`, `rpc_push`), beside the p2p daemons.

Why: a step's message crosses two p2p daemons each way (the caller's and the server's p2pd), which
on loopback is 1.55 ms of the ~1.9 ms framework cost per hop (scripts/bench_hop_overhead.py). A
direct stream is one TCP connection between the two Python processes carrying the same frames as the
p2p stream (petals_chain/transport/framed_stream.py) into the same handler (`serve_framed`).

Trust. The caller's identity still comes from p2p: it asks the server over p2p (`rpc_direct`, where
libp2p authenticates its peer id and encrypts) for a ticket, 16 random bytes the server binds to that
peer id. A direct connection's first frame (`DirectHello`) names the ticket and the stream; the
server answers `DirectReady` and runs the handler with the ticket's peer id as the caller (so the
allowlist, a client's accounting and a pusher's check see the same identity as on p2p), or a typed
`DirectRefusedError` and closes. The connection itself is plain TCP: whoever can read the path can
read the hidden states and the ticket (and replay the ticket). So a server offers direct streams only
when started with `--direct-port` (off by default): for loopback, a LAN or a private network, not for
servers across the open internet.

Fallback. A server that offers none (or predates `rpc_direct`), no offered address connecting within
DIAL_TIMEOUT_S (a server behind NAT), or a refused ticket (the server restarted): the dialer opens the
p2p stream instead, and does not try that server directly again for NO_DIRECT_RETRY_S. The first
stream to each server goes over p2p too, while its offer is asked for (`DirectDialer`). Nothing of a
session depends on which transport carries it.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable

from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import runtime_pb2

from petals_chain.errors import DirectRefusedError, PetalsChainError
from petals_chain.transport.framed_stream import (
    _HEADER_BYTES,
    FramedStream,
    Handler,
    frame,
    read_frame,
    serve_framed,
)
from petals_chain.transport.protocol import BlockService
from petals_chain.wire import codec as wire
from petals_chain.wire.messages import (
    DirectHello,
    DirectOffer,
    DirectReady,
    DirectRequest,
)

logger = logging.getLogger(__name__)

HELLO_MAX_BYTES = 4096  # the hello comes before any authentication: its length is capped
HELLO_TIMEOUT_S = 10.0  # a connection that sends no hello within this is closed
DIAL_TIMEOUT_S = 3.0  # connect + hello + ready, per offered address
NO_DIRECT_RETRY_S = 60.0  # after a failed direct attempt, p2p only for this long
NO_OFFER_RETRY_S = 3600.0  # a server that offers none is asked again after this long
TICKET_BYTES = 16


async def ask_direct_offer(p2p: P2P, peer_id: str) -> DirectOffer:
    """The server's `rpc_direct` answer over p2p (its typed error raised as such)."""
    stub = BlockService.get_stub(p2p, PeerID.from_base58(peer_id))
    reply = await stub.rpc_direct(wire.request(DirectRequest()), timeout=DIAL_TIMEOUT_S)
    return wire.decode_reply(wire.unpack(reply.metadata), DirectOffer)


class DirectListener:
    """The server's side: issues tickets (`offer`, called by its `rpc_direct` handler) and serves the
    direct connections on its event loop with the handlers given to `start`."""

    def __init__(
        self,
        p2p: P2P,
        hosts: list[str],
        *,
        bind_host: str = "0.0.0.0",
        port: int = 0,
        token: Callable[[int], str] = secrets.token_hex,
    ):
        if not hosts:
            raise ValueError("a direct listener needs at least one address to offer")
        self.p2p = p2p
        self.handlers: dict[str, tuple[Handler, type]] = {}
        self.hosts = list(hosts)
        self.bind_host = bind_host
        self.port = port
        self._token = token
        self._tickets: dict[str, str] = {}  # ticket -> peer id
        self._by_peer: dict[str, str] = {}  # peer id -> its ticket (the same one on every ask)
        self._server: asyncio.AbstractServer | None = None
        self.refused = 0  # connections refused (bad hello, unknown ticket or stream)

    async def start(self, handlers: dict[str, tuple[Handler, type]]) -> None:
        """Listen, serving `handlers` (stream name -> (handler, request type)); offers are made from now on."""
        self.handlers = dict(handlers)
        self._server = await asyncio.start_server(self._serve, self.bind_host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    def offer(self, peer_id: str) -> DirectOffer:
        """The ticket of `peer_id` (authenticated by p2p: the caller of `rpc_direct`) and where to use it;
        no offer (port 0) before `start`."""
        if self._server is None:
            return DirectOffer()
        ticket = self._by_peer.get(peer_id)
        if ticket is None:
            ticket = self._by_peer[peer_id] = self._token(TICKET_BYTES)
            self._tickets[ticket] = peer_id
        return DirectOffer(list(self.hosts), self.port, ticket)

    async def _hello(self, reader: asyncio.StreamReader) -> DirectHello:
        header = await reader.readexactly(_HEADER_BYTES)
        if header[:1] != P2P.MESSAGE_MARKER:
            raise DirectRefusedError("the first frame of a direct stream must be a hello message")
        length = int.from_bytes(header[1:], P2P.BYTEORDER)
        if length > HELLO_MAX_BYTES:
            raise DirectRefusedError(f"a hello of {length} bytes (at most {HELLO_MAX_BYTES})")
        try:
            request = runtime_pb2.ExpertRequest.FromString(await reader.readexactly(length))
        except asyncio.IncompleteReadError:
            raise
        except Exception as e:  # protobuf's DecodeError: garbage bytes
            raise DirectRefusedError(f"the hello does not parse: {e}") from None
        return wire.decode_request(request, DirectHello)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(HELLO_TIMEOUT_S):
                hello = await self._hello(reader)
            peer = self._tickets.get(hello.ticket)
            if peer is None:
                raise DirectRefusedError("unknown ticket (the server restarted?): ask rpc_direct for a new one")
            if hello.stream not in self.handlers:
                raise DirectRefusedError(
                    f"no direct stream {hello.stream[:80]!r} here; streams: {sorted(self.handlers)}"
                )
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):  # went away or said nothing
            self.refused += 1
            writer.close()
            return
        except PetalsChainError as e:  # a typed refusal (an InvalidRequestError from the hello's fields too)
            self.refused += 1
            refusal = e if isinstance(e, DirectRefusedError) else DirectRefusedError(f"bad hello: {e}")
            try:
                writer.write(frame(wire.error_response(refusal)))
                await writer.drain()
            except Exception:
                pass
            writer.close()
            return
        handler, request_type = self.handlers[hello.stream]
        writer.write(frame(wire.response(DirectReady())))
        context = P2PContext(handle_name=hello.stream, local_id=self.p2p.peer_id, remote_id=PeerID.from_base58(peer))
        await serve_framed(reader, writer, context, handler, request_type)


def offered_hosts(
    announce_maddrs: list[str], host_maddrs: list[str], visible_maddrs: list[str]
) -> tuple[str, list[str]]:
    """(the address to bind, the addresses to offer in order) for a server's direct streams: its
    announced IPv4 addresses if any, else its listen addresses, else what p2p sees of it; routable
    addresses before loopback ones, never 0.0.0.0. Pure."""

    def ip4s(maddrs):
        out = []
        for m in maddrs:
            parts = str(m).split("/")
            if len(parts) > 2 and parts[1] == "ip4" and parts[2] not in out:
                out.append(parts[2])
        return out

    listen = ip4s(host_maddrs)
    bind = "0.0.0.0" if not listen or "0.0.0.0" in listen else listen[0]
    for source in (ip4s(announce_maddrs), [h for h in listen if h != "0.0.0.0"], ip4s(visible_maddrs)):
        hosts = [h for h in source if h != "0.0.0.0"]
        if hosts:
            return bind, sorted(hosts, key=lambda h: h.startswith("127."))
    return bind, ["127.0.0.1"]


class DirectDialer:
    """The caller's side, on one event loop: `open(peer, name)` gives a FramedStream, direct where the
    server offers it and it connects, else over p2p.

    Why the offer is asked in the background: asking first would add a round trip to the first stream
    to every server, also to the (default) servers that offer none. So the first stream to a server goes
    over p2p while its `rpc_direct` answer is fetched beside it; later streams use the answer (a server
    offering none is not asked again for NO_OFFER_RETRY_S)."""

    def __init__(
        self,
        p2p: P2P,
        ask_offer: Callable[[str], object] | None = None,
        *,
        enabled: bool = True,
        clock: Callable[[], float] = time.monotonic,
        open_p2p: Callable[..., object] | None = None,
    ):
        self._open_p2p = open_p2p or (lambda peer_id, name: FramedStream.open(p2p, peer_id, name))
        # async (peer id) -> DirectOffer; raises when the server cannot say
        self._ask_offer = ask_offer or (lambda peer_id: ask_direct_offer(p2p, peer_id))
        self.enabled = enabled
        self.clock = clock
        self._offers: dict[str, DirectOffer] = {}
        self._p2p_until: dict[str, float] = {}  # peer -> p2p only until then
        self._asking: dict[str, asyncio.Task] = {}  # peer -> its rpc_direct call in flight
        self.direct_opened = 0
        self.p2p_opened = 0

    def _p2p_only(self, peer_id: str, why: str, for_s: float = NO_DIRECT_RETRY_S) -> None:
        logger.debug("direct streams to %s: %s; using p2p for %.0f s", peer_id[-8:], why, for_s)
        self._offers.pop(peer_id, None)
        self._p2p_until[peer_id] = self.clock() + for_s

    async def _ask(self, peer_id: str) -> None:
        try:
            offer = await asyncio.wait_for(self._ask_offer(peer_id), DIAL_TIMEOUT_S)
        except Exception as e:  # an older server, a refusal, no answer: p2p serves anyway
            self._p2p_only(peer_id, f"no offer ({type(e).__name__}: {e})")
            return
        finally:
            self._asking.pop(peer_id, None)
        if offer.port:
            self._offers[peer_id] = offer
        else:
            self._p2p_only(peer_id, "the server offers none", NO_OFFER_RETRY_S)

    def _offer(self, peer_id: str) -> DirectOffer | None:
        """The known offer of `peer_id`, or None (and then its offer is asked for, unless it is known to
        have none or is being asked already)."""
        if not self.enabled:
            return None
        offer = self._offers.get(peer_id)
        if offer is None and self.clock() >= self._p2p_until.get(peer_id, -1.0) and peer_id not in self._asking:
            self._asking[peer_id] = asyncio.create_task(self._ask(peer_id))
        return offer

    async def asked(self) -> None:
        """Wait for the offers being asked for (tests; a caller never needs to)."""
        while self._asking:
            await asyncio.gather(*self._asking.values(), return_exceptions=True)

    async def _dial(self, host: str, offer: DirectOffer, name: str) -> FramedStream:
        reader, writer = await asyncio.open_connection(host, offer.port)
        try:
            writer.write(frame(wire.request(DirectHello(offer.ticket, name))))
            marker, body = await read_frame(reader)
            if marker != P2P.MESSAGE_MARKER:
                raise DirectRefusedError(f"unexpected frame marker {marker!r}")
            wire.decode_reply(wire.unpack(runtime_pb2.ExpertResponse.FromString(body).metadata), DirectReady)
        except BaseException:
            writer.close()
            raise
        return FramedStream(reader, writer, name)

    async def open(self, peer_id: str, name: str) -> FramedStream:
        """A stream `name` (a p2p handle name) to `peer_id`: direct if offered and reachable, else p2p."""
        offer = self._offer(peer_id)
        if offer is not None:
            errors = []
            for host in offer.hosts:
                try:
                    stream = await asyncio.wait_for(self._dial(host, offer, name), DIAL_TIMEOUT_S)
                except (OSError, asyncio.IncompleteReadError, TimeoutError, PetalsChainError) as e:
                    errors.append(f"{host}: {type(e).__name__}: {e}")
                    continue
                self.direct_opened += 1
                return stream
            self._p2p_only(peer_id, "; ".join(errors))
        stream = await self._open_p2p(peer_id, name)
        self.p2p_opened += 1
        return stream
