"""The block server's RPC surface, shared by server (which implements it) and client (which
gets a stub from it). hivemind names handlers after this class, so both sides use this one class.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import (  # hivemind detects streams by typing.AsyncIterator, not collections.abc
    AsyncIterator,
    TypeVar,
)

from hivemind.p2p import P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2

from petals_chain.errors import NotAllowedError
from petals_chain.transport.framed_stream import add_framed_handler
from petals_chain.transport.membership import check_allowed
from petals_chain.wire import codec as wire
from petals_chain.wire import parts as wire_parts
from petals_chain.wire import records as wire_records


class _MembersOnly(ServicerBase):
    """With an allowlist (`--allowed-peers`), a caller not on it gets a typed `NotAllowedError` reply
    and nothing else: its request never reaches the implementation."""

    def __init__(self, impl, allowed_peers: frozenset[str] | None = None):
        self.impl = impl
        self.allowed_peers = allowed_peers

    def _refusal(self, context: P2PContext) -> runtime_pb2.ExpertResponse | None:
        try:
            check_allowed(self.allowed_peers, str(context.remote_id))
        except NotAllowedError as e:
            return wire.error_response(e)
        return None

    @classmethod
    def get_stub(cls, p2p, peer: PeerID, *, namespace: str | None = None) -> "ShieldedStub":
        """hivemind's stub, with every unary call (`stub.rpc_info(request, timeout=5.0)`) made through
        `call_unary`, so no caller can cancel one (see there)."""
        stub = super().get_stub(p2p, peer, namespace=namespace)
        return ShieldedStub(
            stub, frozenset(h.method_name for h in cls._rpc_handlers if not (h.stream_input or h.stream_output))
        )


class BlockService(_MembersOnly):
    """Delegates each RPC to `impl` (the server's `BlockServicer`)."""

    # the per-step streams: served with one socket write per message (petals_chain/transport/framed_stream.py,
    # same bytes as hivemind's streams, so hivemind's stubs call them as before)
    FRAMED_STREAMS = ("rpc_inference", "rpc_push")

    @classmethod
    def handle_name(cls, method: str) -> str:
        """The p2p protocol name of `method` (what hivemind's stubs of this class call)."""
        return cls._get_handle_name(None, method)

    async def add_p2p_handlers(self, p2p, wrapper=None, *, namespace=None, balanced: bool = False) -> None:
        """hivemind's handlers, then the per-step streams replaced by framed streams (the p2p daemon
        refuses a second handler of a name: removed first; the server is not announced yet)."""
        await super().add_p2p_handlers(p2p, wrapper, namespace=namespace, balanced=balanced)
        if wrapper is None and namespace is None and not balanced:
            for method in self.FRAMED_STREAMS:
                await p2p.remove_binary_stream_handler(self.handle_name(method))
                await add_framed_handler(p2p, self.handle_name(method), getattr(self, method))

    async def _members_stream(self, handler, requests, context: P2PContext):
        """A stream RPC: a caller not on the allowlist gets the refusal, and its input is drained."""
        refusal = self._refusal(context)
        if refusal is not None:
            yield refusal
            await wire_parts.drain(requests)
            return
        async for response in handler(requests, context):
            yield response

    async def rpc_info(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        return self._refusal(context) or await self.impl.info(request, context)

    async def rpc_direct(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        """A ticket for the direct streams (petals_chain/transport/direct_stream.py), bound to the caller's peer id."""
        return self._refusal(context) or await self.impl.direct(request, context)

    async def rpc_forward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        return self._refusal(context) or await self.impl.forward(request, context)

    async def rpc_forward_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        async for response in self._members_stream(self.impl.forward_stream, requests, context):
            yield response

    async def rpc_inference(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        async for response in self._members_stream(self.impl.inference, requests, context):
            yield response

    async def rpc_push(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Server-to-server relay: another server pushes a session's steps here (server/relay.py)."""
        async for response in self._members_stream(self.impl.push, requests, context):
            yield response


class OrchestratorService(_MembersOnly):
    """The online orchestrator's RPC surface (implemented in orchestrator.service.rpc; the client
    and the servers get stubs from this class without importing `orchestrator`)."""

    async def rpc_acquire(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        return self._refusal(context) or await self.impl.acquire(request, context)

    async def rpc_release(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        return self._refusal(context) or await self.impl.release(request, context)

    async def rpc_heartbeat(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> runtime_pb2.ExpertResponse:
        return self._refusal(context) or await self.impl.heartbeat(request, context)

    async def rpc_assignment(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> runtime_pb2.ExpertResponse:
        return self._refusal(context) or await self.impl.assignment(request, context)

    async def rpc_report(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        return self._refusal(context) or await self.impl.report(request, context)


# Why here, at import: hivemind's ServicerBase collects a class's handlers lazily on the first
# get_stub and is not thread-safe about it (it sets `_rpc_handlers` to [] before filling it and
# builds `_stub_type` last), so a second thread's first get_stub could find `_stub_type` still None
# ("'NoneType' object is not callable"; the soak test lost a session to it). Importing a module
# runs under the import lock, so collecting here happens once, before any thread asks for a stub.
for _service in (BlockService, OrchestratorService):
    _service._collect_rpc_handlers()
del _service


T = TypeVar("T")


async def call_unary(call: Awaitable[T], timeout_s: float) -> T:
    """`call` (a unary call made without a timeout of its own) within `timeout_s` (None: no limit),
    raising TimeoutError after it, without ever cancelling the call itself: every unary RPC of this
    process goes through here (the services' stubs, `ShieldedStub`, call it for each unary method).

    Why: hivemind 1.1.12's daemon client reads the replies of all unary calls of a process on one task
    (`ControlClient._read_from_persistent_conn`), which sets the result of each call's future. A call
    cancelled (by `asyncio.wait_for`, a stub's `timeout=`, or a cancelled caller) in the same loop
    iteration as its reply arrives has a cancelled future there, its `set_result` raises
    InvalidStateError, and that ends the reading task: from then on no unary reply of the process is
    read (every call times out, incoming unary requests go unanswered) while requests still go out.
    A load generator's client lost every orchestrator reply so in a Table 1 run (its acquires were
    granted and the grants never arrived; tests/test_unary_calls.py pins the hazard). So the call is
    shielded: whoever stops waiting for it leaves it to end by itself (the daemon answers or fails
    every call), and its result is dropped then."""
    task = asyncio.ensure_future(call)
    try:
        return await asyncio.wait_for(asyncio.shield(task), timeout_s)
    except BaseException:
        if not task.done():
            task.add_done_callback(_drop_result)
        raise


def _drop_result(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: a late failure of a call nobody waits for is not logged as unhandled


class ShieldedStub:
    """A hivemind stub whose unary methods take `timeout=` through `call_unary`; its stream methods
    are hivemind's own (their streams are sockets of their own, not the shared reply reader)."""

    def __init__(self, stub, unary_methods: frozenset[str]):
        self._stub, self._unary_methods = stub, unary_methods

    def __getattr__(self, name: str):
        method = getattr(self._stub, name)
        if name not in self._unary_methods:
            return method

        def call(request, timeout: float | None = None):
            return call_unary(method(request), timeout)

        return call


def ping_block_server_s(loop, p2p, peer_id: str, *, timeout_s: float = 3.0) -> float | None:
    """Round trip of one `rpc_info` to a block server on `loop` (a BackgroundLoop), in seconds;
    None when it does not answer within `timeout_s`. Clients route with it, the orchestrator
    measures RTTs (tau_c) with it."""
    stub = BlockService.get_stub(p2p, PeerID.from_base58(peer_id))
    start = time.perf_counter()
    try:
        loop.run(stub.rpc_info(wire.request(wire_records.InfoRequest()), timeout=timeout_s), timeout_s=timeout_s + 1)
    except Exception:
        return None
    return time.perf_counter() - start


def fetch_service_records(loop, p2p, peer_id: str, since_seq: int, *, timeout_s: float = 3.0):
    """The batches a block server ran after `since_seq` (`wire_records.BatchService`, oldest first) from its
    rpc_info; None when it does not answer. The orchestrator's calibrated model reads them."""
    stub = BlockService.get_stub(p2p, PeerID.from_base58(peer_id))
    try:
        resp = loop.run(
            stub.rpc_info(wire.request(wire_records.InfoRequest(service_since_seq=since_seq)), timeout=timeout_s),
            timeout_s=timeout_s + 1,
        )
        return wire.decode_reply(wire.unpack(resp.metadata), wire_records.InfoReply).service or []
    except Exception:
        return None
