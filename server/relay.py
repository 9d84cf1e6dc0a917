"""Server-to-server relay of hidden states (PETALS' rpc_push; the paper's tau_c,ij, footnote 4).

A session opened with `Open.relay_from = P` takes steps pushed by peer P (its previous hop) for its
session id, besides its client's own copies; a step carries `push_route`, the peers after this hop,
and the server pushes its output to the first of them with the rest of the route. Each step runs
once: its id claims it, whichever copy (pushed or the client's) comes first; the other is dropped
(a late push gets a typed `RelayRefusedError`, a late client copy is skipped without a reply).

Who owns what:
- `RelayIndex` (one per servicer, on the event loop): (session id, previous peer) -> the session's
  `RelayInbox`; an entry is held by the session's reservation and released with it.
- `RelayInbox`: what one stream's handler consumes (`next`): its client's messages and the steps
  pushed to it, in arrival order; `last_step_id` is the dedup claim. Until its session takes pushes
  the handler reads its client's messages inline (no task between the socket and the step: on this
  VM a task hand-off per message costs ~0.1 ms of a hop's ~1.1 ms); from `take_pushes` on, a pump task
  moves them into the queue the pushes go to, so whichever comes first is run first.
- `RelayLinks` (one per session, sender side): one long-lived `rpc_push` stream to each next peer
  (opened at the first push, so a push costs one one-way trip, not a stream setup), closed with the
  session.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import torch

from petals_chain.errors import RelayRefusedError
from petals_chain.transport.framed_stream import FramedStream
from petals_chain.transport.protocol import BlockService
from petals_chain.wire import codec as wire
from petals_chain.wire import parts as wire_parts
from petals_chain.wire.messages import Push

logger = logging.getLogger(__name__)

# items of a RelayInbox: (kind, payload)
CLIENT, PUSHED, END, FAILED, EVICTED = "client", "pushed", "end", "failed", "evicted"


class RelayInbox:
    """One stream's messages: its client's (`client`: the stream's assembled message groups) and, once
    its session takes pushes, the pushed steps. The handler's task is the only reader (`next`)."""

    def __init__(self, client: AsyncIterator | None = None, idle_timeout_s: float | None = None):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.last_step_id = 0  # the newest step id claimed (run or queued to run) by this session
        self._client = client
        self._pump: asyncio.Task | None = None
        # the idle timeout: one watch timer per stream, not a timer per message (`_watch_idle`)
        self.idle_timeout_s = idle_timeout_s
        self._waiting_since: float | None = None  # loop time `next` began waiting (None: not waiting)
        self._reader: asyncio.Task | None = None
        self._idle_timer: asyncio.TimerHandle | None = None
        self._idle_fired = False
        self._evicted: Exception | None = None  # the server closes this stream (a forced move): why
        self._evict_fired = False  # `evict` cancelled the reader's wait

    def claim(self, step_id: int | None) -> bool:
        """True when `step_id` is new here (and now taken); steps without an id always run."""
        if step_id is None:
            return True
        if step_id <= self.last_step_id:
            return False
        self.last_step_id = step_id
        return True

    async def next(self) -> tuple[str, object]:
        """The next (kind, payload): CLIENT with a message group (or the typed error of a bad one),
        PUSHED with (push, tensor), END when the client ended the stream, FAILED with the transport's
        error, EVICTED with the error to send once `evict` was called (at once, or ending the wait it
        interrupted). Read inline from the client's stream until `take_pushes`. Raises TimeoutError
        when nothing came for `idle_timeout_s`."""
        if self._evicted is not None:
            return EVICTED, self._evicted
        loop = asyncio.get_running_loop()
        self._waiting_since = loop.time()
        self._reader = asyncio.current_task()
        if self.idle_timeout_s is not None and self._idle_timer is None:
            self._idle_timer = loop.call_later(self.idle_timeout_s, self._watch_idle)
        try:
            if self._pump is not None or self._client is None:
                return await self.queue.get()
            try:
                return CLIENT, await anext(self._client)
            except StopAsyncIteration:
                return END, None
            except Exception as e:  # the transport broke (a cancel is no Exception): the handler ends the stream
                return FAILED, e
        except asyncio.CancelledError:
            ours = int(self._idle_fired) + int(self._evict_fired)
            if not ours:
                raise  # cancelled from outside
            self._idle_fired = self._evict_fired = False
            for _ in range(ours):
                self._reader.uncancel()  # our own cancels, turned into what they stand for
            if self._evicted is not None:
                return EVICTED, self._evicted
            raise TimeoutError(f"nothing arrived for {self.idle_timeout_s} s") from None
        finally:
            self._waiting_since = None

    def evict(self, error: Exception) -> None:
        """The server closes this stream (on the loop): the reader's wait, if it waits now, ends with
        (EVICTED, `error`), and so does every later `next` (a step running now finishes and is answered
        first). Idempotent."""
        if self._evicted is not None:
            return
        self._evicted = error
        if self._waiting_since is not None and self._reader is not None and not self._reader.done():
            self._evict_fired = True
            self._reader.cancel()

    def _watch_idle(self) -> None:
        """The idle timer: fires at the earliest moment the reader could have waited `idle_timeout_s`;
        cancels its wait when it has, else looks again when it could have. Why not `asyncio.timeout`
        around each wait: that is a timer armed and cancelled per message, on the decode step's path."""
        loop = asyncio.get_running_loop()
        since = self._waiting_since
        due = self.idle_timeout_s if since is None else since + self.idle_timeout_s - loop.time()
        if since is not None and due <= 0:
            self._idle_timer = None
            self._idle_fired = True
            self._reader.cancel()
            return
        self._idle_timer = loop.call_later(due, self._watch_idle)

    def take_pushes(self) -> None:
        """Pushed steps may arrive from now on: the client's messages go through the queue too (a
        pump task), so the handler waits for whichever comes first. Called by the handler's task
        between its reads (never while `next` reads inline). Idempotent."""
        if self._pump is None and self._client is not None:
            self._pump = asyncio.create_task(pump(self._client, self))

    def close(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None


class RelayIndex:
    def __init__(self):
        self._by_key: dict[tuple[str, str], RelayInbox] = {}
        self.pushes_taken = 0  # reported in rpc_info (extra.relay): tests and benchmarks check the path
        self.pushes_refused = 0
        self.copies_skipped = 0  # clients' copies of steps a push had claimed (each one a message for nothing)

    def view(self) -> dict:
        return {
            "pushes_taken": self.pushes_taken,
            "pushes_refused": self.pushes_refused,
            "copies_skipped": self.copies_skipped,
            "sessions_taking_pushes": len(self._by_key),
        }

    def register(self, session_id: str, from_peer: str, inbox: RelayInbox) -> Callable[[], None]:
        """Take pushes from `from_peer` for `session_id` into `inbox`; returns the undo."""
        key = (session_id, from_peer)
        if self._by_key.get(key) not in (None, inbox):
            raise RelayRefusedError(
                f"session {session_id[:8]} already takes pushes from {from_peer[-8:]} on this "
                "server; open it with a fresh session id"
            )
        self._by_key[key] = inbox

        def unregister():
            if self._by_key.get(key) is inbox:
                del self._by_key[key]

        return unregister

    def deliver(self, push: Push, tensor: torch.Tensor, from_peer: str) -> None:
        """Queue a pushed step for its session, or refuse it (typed)."""
        inbox = self._by_key.get((push.session_id, from_peer))
        if inbox is None:
            self.pushes_refused += 1
            raise RelayRefusedError(
                f"no session {push.session_id[:8]} here takes pushes from peer {from_peer[-8:]} (closed, never opened "
                "with relay_from naming that peer, or its previous hop changed); the client relays this step itself"
            )
        if not inbox.claim(push.step_id):
            self.pushes_refused += 1
            raise RelayRefusedError(
                f"step {push.step_id} of session {push.session_id[:8]} already ran or is queued "
                "here (the client's copy came first)"
            )
        self.pushes_taken += 1
        inbox.queue.put_nowait((PUSHED, (push, tensor)))


async def pump(messages: AsyncIterator, inbox: RelayInbox) -> None:
    """Move a stream's client message groups into its inbox, then END (or FAILED)."""
    try:
        async for message in messages:
            inbox.queue.put_nowait((CLIENT, message))
        inbox.queue.put_nowait((END, None))
    except asyncio.CancelledError:
        raise
    except BaseException as e:  # the transport broke: the handler ends the stream as it would have
        inbox.queue.put_nowait((FAILED, e))


class RelayLinks:
    """The push streams of one session to its next hops (sender side, on the event loop)."""

    def __init__(self, dialer, session_id: str):
        self.dialer = dialer  # a DirectDialer: direct streams where the next hop offers them, else p2p
        self.session_id = session_id
        self._links: dict[str, tuple[FramedStream, asyncio.Task]] = {}
        self._tail: asyncio.Task | None = None  # pushes of one session go out in step order

    def push_soon(self, route: list[str], step_id: int, out: torch.Tensor, start_position: int | None = None) -> None:
        """Push `out` to route[0], after the pushes before it; a failed push is only logged: the
        client's copy of the step still arrives. Written at once when the link is open, nothing is
        queued before it and the socket takes it without waiting (a decode step, usually): the push is
        on the chain's critical path and the client's reply is not, so it goes first. Otherwise (the
        first push dials its link, or a large one waits for the socket) in the background while the
        handler replies to its client."""
        link = self._links.get(route[0])
        if link is not None and (self._tail is None or self._tail.done()):
            try:
                if link[0].send_nowait(*self._messages(route, step_id, out, start_position)):
                    return
            except Exception as e:  # as a failed background push: logged, the client's copy runs
                logger.debug("push of step %d to %s failed: %s", step_id, route[0][-8:], e)
                return
        before = self._tail

        async def run():
            if before is not None:
                await asyncio.wait([before])
            try:
                await self.push(route, step_id, out, start_position)
            except Exception as e:
                logger.debug("push of step %d to %s failed: %s", step_id, route[0][-8:], e)

        self._tail = asyncio.create_task(run())

    async def push(self, route: list[str], step_id: int, out: torch.Tensor, start_position: int | None = None) -> None:
        """Send `out` as step `step_id` (its KV rollback `start_position`, if any) to route[0] with the
        rest of the route (a refusal is read by `_read_refusals`, never awaited here)."""
        peer = route[0]
        link = self._links.get(peer)
        if link is None:
            channel = await self.dialer.open(peer, BlockService.handle_name("rpc_push"))
            link = self._links[peer] = (channel, asyncio.create_task(self._read_refusals(peer, channel)))
        await link[0].send(*self._messages(route, step_id, out, start_position))

    def _messages(self, route: list[str], step_id: int, out: torch.Tensor, start_position: int | None) -> list:
        """A push as one raw frame (no protobuf: it is encoded and decoded on the critical path), or
        protobuf parts when the tensor does not fit one frame (a long prompt's step). Every server
        reads both on rpc_push (`serve_framed` + `wire_parts.Assembler`)."""
        meta = Push(self.session_id, step_id, list(route[1:]), start_position).to_wire()
        raw = wire_parts.encode_raw(meta, out)
        return [raw] if raw is not None else wire_parts.to_messages(meta, (out,))

    async def _read_refusals(self, peer: str, responses: FramedStream) -> None:
        """The next hop answers only the pushes it refuses (typed errors); each is harmless: the
        client's copy of that step runs instead."""
        try:
            async for response in responses:
                meta = wire.unpack(response.metadata)
                logger.debug("push to %s refused: %s", peer[-8:], meta.get("message"))
        except Exception as e:
            logger.debug("push stream to %s ended: %s", peer[-8:], e)
        self._links.pop(peer, None)

    def close(self) -> None:
        if self._tail is not None:
            self._tail.cancel()
        for channel, reader in self._links.values():
            channel.end()
            reader.cancel()
        self._links.clear()
