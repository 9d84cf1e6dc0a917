"""Random and mutated RPC messages for the fuzzer (tests/test_fuzz_rpc.py and scripts/fuzz_rpc.py).

One generator, driven by a `random.Random`, so hypothesis (a seed per example) and the long
script (one seeded stream) send the same kinds of messages. Each message is built from a valid one
of the RPC, then broken in one of many ways: garbage or truncated metadata, random msgpack, a
field removed / of the wrong type / out of range / NaN / huge, tensors with NaNs, wrong dtypes,
lying headers (huge or negative dimensions, truncated buffers), too many tensors, a lying parts count.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

import torch
from hivemind.proto import runtime_pb2

from petals_chain.errors import PetalsChainError
from petals_chain.wire import codec as wire
from petals_chain.wire import parts as wire_parts

WEIRD_VALUES: list[Any] = [
    None,
    True,
    -1,
    0,
    2**31,
    2**63 - 1,
    -(2**63),
    1e308,
    -1e308,
    math.nan,
    math.inf,
    "",
    "x" * 10_000,
    b"\x00\xff",
    [],
    [1, [2, [3]]],
    {"a": {"b": None}},
    3.5,
    -0.0,
]


@dataclass
class Fuzzed:
    """One message group to send (usually one protobuf message) and what kind of breakage it has."""

    kind: str
    messages: list[runtime_pb2.ExpertRequest] = field(default_factory=list)
    rpc: str = ""

    @property
    def incomplete(self) -> bool:
        """The group announces more messages than it has: a stream waits for the rest (until the
        next group's first message, which then gets the error for this one)."""
        try:
            parts = wire.unpack(self.messages[0].metadata).get(wire_parts.PARTS_KEY)
        except Exception:
            return False
        return (
            isinstance(parts, int)
            and not isinstance(parts, bool)
            and len(self.messages) < parts <= wire_parts.MAX_PARTS_PER_GROUP
        )


def valid_meta(rpc: str, session_id: str, rng: random.Random) -> dict[str, Any]:
    if rpc == "open":
        return {"type": "open", "session_id": session_id, "max_length": rng.choice([8, 16, 64])}
    if rpc == "step":
        return {"type": "step", "session_id": session_id, "step_id": rng.randrange(1000)}
    if rpc == "close":
        return {"type": "close", "session_id": session_id}
    if rpc == "forward":
        return {"type": "forward"}
    if rpc == "info":
        return {"type": "info"}
    if rpc == "acquire":
        return {
            "type": "acquire",
            "session_id": session_id,
            "max_length": 16,
            "timeout_s": 0.5,
            "poll_s": 0.2,
            "exclude": [],
        }
    if rpc == "release":
        return {"type": "release", "session_id": session_id, "input_tokens": 3, "output_tokens": 2}
    if rpc == "heartbeat":
        return {"type": "heartbeat", "session_ids": [session_id]}
    if rpc == "assignment":
        return {"type": "assignment"}
    raise ValueError(rpc)


def valid_tensors(rpc: str, hidden: int, rng: random.Random) -> tuple[torch.Tensor, ...]:
    if rpc == "step":
        return (torch.randn(rng.randint(1, 3), hidden),)
    if rpc == "forward":
        return (torch.randn(1, rng.randint(1, 4), hidden),)
    return ()


def _weird(rng: random.Random) -> Any:
    return rng.choice(WEIRD_VALUES)


def _random_tree(rng: random.Random, depth: int = 0) -> Any:
    choice = rng.randrange(6 if depth < 3 else 3)
    if choice == 0:
        return _weird(rng)
    if choice == 1:
        return rng.randint(-(2**40), 2**40)
    if choice == 2:
        return "".join(rng.choice("abc_typesion") for _ in range(rng.randint(0, 12)))
    if choice == 3:
        return [_random_tree(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {str(_random_tree(rng, 3)): _random_tree(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def _tensor_proto(rng: random.Random, hidden: int) -> runtime_pb2.Tensor:
    """A tensor part whose header or buffer lies."""
    kind = rng.randrange(6)
    if kind == 0:  # huge dimensions, tiny buffer
        return runtime_pb2.Tensor(buffer=b"\x00" * 16, size=[2**31 - 1, 2**31 - 1], dtype="float32")
    if kind == 1:  # truncated buffer
        return runtime_pb2.Tensor(buffer=b"123", size=[7, hidden], dtype="float32")
    if kind == 2:  # unknown dtype
        return runtime_pb2.Tensor(buffer=b"\x00" * 8, size=[2], dtype=rng.choice(["complex64", "", "float3", "int8"]))
    if kind == 3:  # empty tensor
        return runtime_pb2.Tensor(buffer=b"", size=[0, hidden], dtype="float32")
    if kind == 4:  # many dimensions
        return runtime_pb2.Tensor(buffer=b"\x00" * 4, size=[1] * 40, dtype="float32")
    return runtime_pb2.Tensor(
        buffer=bytes(rng.randrange(256) for _ in range(rng.randint(0, 64))),
        size=[rng.randint(0, 9) for _ in range(rng.randint(0, 4))],
        dtype="float32",
    )


def fuzz(rpc: str, rng: random.Random, *, hidden: int, session_id: str) -> Fuzzed:
    """One broken message group for `rpc` (see module doc)."""
    fuzzed = _fuzz(rpc, rng, hidden=hidden, session_id=session_id)
    fuzzed.rpc = rpc
    return fuzzed


def _fuzz(rpc: str, rng: random.Random, *, hidden: int, session_id: str) -> Fuzzed:
    meta = valid_meta(rpc, session_id, rng)
    tensors = valid_tensors(rpc, hidden, rng)
    kind = rng.choice(
        [
            "garbage",
            "random_msgpack",
            "drop_field",
            "weird_field",
            "extra_fields",
            "nan_tensor",
            "wrong_dtype",
            "wrong_width",
            "lying_tensor",
            "too_many_tensors",
            "lying_parts",
            "unknown_type",
            "truncated_meta",
        ]
    )
    if kind == "garbage":
        blob = bytes(rng.randrange(256) for _ in range(rng.randint(0, 300)))
        return Fuzzed(kind, [runtime_pb2.ExpertRequest(metadata=blob)])
    if kind == "random_msgpack":
        tree = _random_tree(rng)
        try:
            packed = wire.pack(tree)
        except Exception:  # NaN keys and the like: msgpack takes them, but be safe
            packed = b"\xc0"
        return Fuzzed(kind, [runtime_pb2.ExpertRequest(metadata=packed)])
    if kind == "truncated_meta":
        packed = wire.pack(meta)
        return Fuzzed(kind, [runtime_pb2.ExpertRequest(metadata=packed[: rng.randrange(max(1, len(packed)))])])
    if kind == "drop_field" and len(meta) > 1:
        meta.pop(rng.choice([k for k in meta if k != "type"] or ["type"]))
    elif kind in ("weird_field", "drop_field"):
        meta[rng.choice(list(meta))] = _weird(rng)
    elif kind == "extra_fields":
        meta.update({"parts": _weird(rng), "entry_block": _weird(rng), "zzz": _random_tree(rng)})
    elif kind == "unknown_type":
        meta["type"] = rng.choice(["dance", "", "OPEN", "step ", "info\x00"])
    elif kind == "lying_parts":
        meta[wire_parts.PARTS_KEY] = rng.choice([0, -1, 10**9, "2", 1.5, None])
    if kind == "nan_tensor" and tensors:
        t = tensors[0].clone()
        t.view(-1)[rng.randrange(t.numel())] = rng.choice([math.nan, math.inf, -math.inf])
        tensors = (t,)
    elif kind == "wrong_dtype" and tensors:
        tensors = (tensors[0].to(rng.choice([torch.float64, torch.int64, torch.bfloat16, torch.float16])),)
    elif kind == "wrong_width":
        tensors = (torch.randn(1, rng.choice([1, hidden - 1, hidden + 1, 3 * hidden])),)
    elif kind == "too_many_tensors":
        tensors = tuple(torch.randn(1, hidden) for _ in range(rng.randint(2, 5)))
    if kind == "lying_tensor":
        return Fuzzed(kind, [runtime_pb2.ExpertRequest(metadata=wire.pack(meta), tensors=[_tensor_proto(rng, hidden)])])
    try:
        messages = wire_parts.to_messages(meta, tensors)
    except Exception:  # our own encoder refuses it (e.g. a weird parts count): send the metadata raw
        messages = [runtime_pb2.ExpertRequest(metadata=wire.pack(meta))]
    return Fuzzed(kind, list(messages))


# -- sending them -------------------------------------------------------------------------------
SERVER_RPCS = ("info", "forward", "forward_stream", "inference")
ORCHESTRATOR_RPCS = ("acquire", "release", "heartbeat", "assignment")


def classify(meta: dict[str, Any]) -> str:
    """typed_error | untyped_error (a handler bug reported as a generic error) | accepted."""
    from petals_chain.errors import ERROR_TYPES

    if meta.get("type") != "error":
        return "accepted"
    return "typed_error" if meta.get("code") in ERROR_TYPES and meta.get("code") != "error" else "untyped_error"


class RpcFuzzer:
    """Sends fuzzed messages to a live server and orchestrator through a client's p2p (`chain`: a
    RemoteChain) and counts the outcomes; `counts[kind/outcome]` and `outcomes[outcome]`."""

    def __init__(
        self,
        chain,
        server_peer: str,
        orchestrator_peer: str | None,
        hidden: int,
        rng: random.Random,
        reply_timeout_s: float = 10.0,
    ):
        from collections import Counter

        self.chain, self.server_peer, self.orchestrator_peer = chain, server_peer, orchestrator_peer
        self.hidden, self.rng, self.reply_timeout_s = hidden, rng, reply_timeout_s
        self.outcomes: Counter = Counter()
        self.by_kind: Counter = Counter()
        self.untyped: list[str] = []
        self.granted: set[str] = set()
        self.last_no_reply = ""
        self._n = 0

    def _note(self, rpc: str, kind: str, outcome: str, detail: str = "") -> None:
        self.outcomes[outcome] += 1
        self.by_kind[f"{rpc}/{kind}/{outcome}"] += 1
        if outcome == "untyped_error" and len(self.untyped) < 20:
            self.untyped.append(f"{rpc}/{kind}: {detail[:200]}")

    def run(self, rpc: str) -> str:
        """One fuzzed message against `rpc`; returns its outcome."""
        self._n += 1
        sid = f"fuzz-{self._n}"
        if rpc == "inference":
            return self._inference(sid)
        if rpc == "forward_stream":
            return self._forward_stream(sid)
        fuzzed = fuzz(rpc, self.rng, hidden=self.hidden, session_id=sid)
        if rpc in ORCHESTRATOR_RPCS:
            from hivemind.p2p import PeerID

            from petals_chain.transport.protocol import OrchestratorService

            stub = OrchestratorService.get_stub(self.chain.p2p, PeerID.from_base58(self.orchestrator_peer))
        else:
            stub = self.chain.stub(self.server_peer)
        try:
            resp = self.chain.loop.run(
                getattr(stub, f"rpc_{rpc}")(fuzzed.messages[0], timeout=self.reply_timeout_s),
                timeout_s=self.reply_timeout_s + 2,
            )
            meta = wire.unpack(resp.metadata)
        except Exception as e:
            outcome = "no_reply"
            self._note(rpc, fuzzed.kind, outcome, repr(e))
            return outcome
        if meta.get("type") == "granted":  # a mutation that still asks validly: give the slot back
            self.granted.add(str(meta.get("grant", {}).get("session_id", sid)))
        outcome = classify(meta)
        self._note(rpc, fuzzed.kind, outcome, str(meta.get("message", "")))
        return outcome

    def release_grants(self) -> None:
        from hivemind.p2p import PeerID

        from petals_chain.transport.protocol import OrchestratorService

        stub = OrchestratorService.get_stub(self.chain.p2p, PeerID.from_base58(self.orchestrator_peer))
        for sid in sorted(self.granted):
            request = wire.request({"type": "release", "session_id": sid, "input_tokens": 0, "output_tokens": 0})
            try:
                self.chain.loop.run(stub.rpc_release(request, timeout=5), timeout_s=7)
            except Exception:
                pass
        self.granted.clear()

    def _stream(self, method: str, first: list):
        """Open a stream with the messages `first` queued; returns (queue, responses)."""
        import asyncio

        async def open_stream():
            queue: asyncio.Queue = asyncio.Queue()
            for m in first:
                queue.put_nowait(m)
            return queue, await getattr(self.chain.stub(self.server_peer), method)(wire_parts.until_none(queue))

        return self.chain.loop.run(open_stream(), timeout_s=self.reply_timeout_s)

    def _reply(self, responses, timeout_s: float | None = None) -> dict[str, Any] | None:
        import asyncio

        timeout_s = timeout_s or self.reply_timeout_s

        async def one():
            return await asyncio.wait_for(wire_parts.receive_one(responses), timeout_s)

        try:
            return self.chain.loop.run(one(), timeout_s=timeout_s + 2).meta
        except StopAsyncIteration:
            return {"type": "closed"}
        except Exception as e:
            if isinstance(e, PetalsChainError):
                return {"type": "error", "code": e.code, "message": str(e)}
            self.last_no_reply = repr(e)  # what a "silent" outcome ran into (a timeout, a broken pipe)
            return None

    def _end(self, queue, responses) -> None:
        async def end():
            await queue.put(None)

        try:
            self.chain.loop.run(end(), timeout_s=2)
        except Exception:
            pass

    def _inference(self, sid: str) -> str:
        """open (valid) -> one fuzzed group -> a valid step: the fuzzed group gets its reply, and the
        stream must still serve (a typed error when the fuzz closed or broke the session); half the
        streams are then cut without a close."""
        fuzzed = fuzz(self.rng.choice(["open", "step", "step", "close"]), self.rng, hidden=self.hidden, session_id=sid)
        open_msg = wire_parts.to_messages(valid_meta("open", sid, self.rng))
        try:
            queue, responses = self._stream("rpc_inference", open_msg)
        except Exception as e:
            self._note("inference", fuzzed.kind, "no_reply", repr(e))
            return "no_reply"
        try:
            opened = self._reply(responses)
            if opened is None or opened.get("type") != "opened":
                outcome = "no_reply" if opened is None else classify(opened)
                self._note("inference", "open", outcome, str(opened))
                return outcome
            for m in fuzzed.messages:
                queue.put_nowait(m)
            if fuzzed.incomplete:  # its error comes when the next group starts: send the next one now
                for m in wire_parts.to_messages({"type": "step", "session_id": sid}, (torch.randn(1, self.hidden),)):
                    queue.put_nowait(m)
            # a well-formed close gets no reply (the server ends the session); don't wait long for one
            reply = self._reply(responses, timeout_s=2.0 if fuzzed.rpc == "close" else None)
            if reply is None and fuzzed.rpc == "close":
                reply = {"type": "closed"}
            outcome = "silent" if reply is None else classify(reply) if reply.get("type") != "closed" else "closed"
            self._note("inference", fuzzed.kind, outcome, str((reply or {}).get("message", "")))
            if outcome in ("closed", "silent"):
                return outcome
            for m in wire_parts.to_messages({"type": "step", "session_id": sid}, (torch.randn(1, self.hidden),)):
                queue.put_nowait(m)
            after = self._reply(responses)
            if after is None or classify(after) == "untyped_error":
                self._note("inference", "after_fuzz", "stream_broken", str(after))
            return outcome
        finally:
            if self.rng.random() < 0.5:
                queue.put_nowait(wire.request({"type": "close", "session_id": sid}))
            self._end(queue, responses)

    def _forward_stream(self, sid: str) -> str:
        fuzzed = fuzz("forward", self.rng, hidden=self.hidden, session_id=sid)
        try:
            queue, responses = self._stream("rpc_forward_stream", fuzzed.messages)
        except Exception as e:
            self._note("forward_stream", fuzzed.kind, "no_reply", repr(e))
            return "no_reply"
        try:
            self._end(queue, responses)  # a forward stream is one group; the end of input completes it
            reply = self._reply(responses)
            outcome = "silent" if reply is None else "closed" if reply.get("type") == "closed" else classify(reply)
            self._note("forward_stream", fuzzed.kind, outcome, str((reply or {}).get("message", "")))
            return outcome
        except Exception as e:
            self._note("forward_stream", fuzzed.kind, "no_reply", repr(e))
            return "no_reply"

    def storm(self, streams: int) -> None:
        """A reconnect storm: `streams` inference streams opened (each with a valid open) and dropped."""
        opened = []
        for i in range(streams):
            sid = f"storm-{self._n}-{i}"
            try:
                opened.append(self._stream("rpc_inference", wire_parts.to_messages(valid_meta("open", sid, self.rng))))
            except Exception:
                self.outcomes["storm_refused"] += 1
        for queue, responses in opened:
            self._end(queue, responses)
        self.outcomes["storm_streams"] += len(opened)
