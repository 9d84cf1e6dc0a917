"""Helpers for tests that talk to real servers: raw inference streams, HF references, a live gateway."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import urllib.request
from dataclasses import dataclass

import pytest
import torch

from petals_chain.client.remote import RemoteChain
from petals_chain.client.routing import ChainProvider, Hop
from petals_chain.errors import NoChainError, PetalsChainError, error_from_code
from petals_chain.swarm.local import stop_process
from petals_chain.wire import parts as wire_parts


class RawStream:
    """An rpc_inference stream driven message by message, for protocol-level tests."""

    def __init__(self, chain: RemoteChain, peer_id: str):
        self.chain = chain

        async def open_stream():
            self.queue = asyncio.Queue()
            return await chain.stub(peer_id).rpc_inference(wire_parts.until_none(self.queue))

        self.responses = chain.loop.run(open_stream(), timeout_s=10)

    def send_raw(self, request, timeout_s: float = 20.0) -> tuple[dict, list[torch.Tensor]]:
        async def roundtrip():
            await self.queue.put(request)
            return await asyncio.wait_for(wire_parts.receive_one(self.responses), timeout_s)

        reply = self.chain.loop.run(roundtrip(), timeout_s=timeout_s + 2)
        return reply.meta, reply.tensors

    def send(self, meta: dict, tensors: tuple[torch.Tensor, ...] = ()) -> tuple[dict, list[torch.Tensor]]:
        (request,) = wire_parts.to_messages(meta, tensors)  # small tensors: one message
        return self.send_raw(request)

    def expect_error(self, meta: dict, tensors=(), request=None) -> PetalsChainError:
        reply, _ = self.send_raw(request) if request is not None else self.send(meta, tensors)
        assert reply.get("type") == "error", f"expected an error reply, got {reply}"
        return error_from_code(reply["code"], reply["message"])

    def close(self) -> None:
        async def close():
            await self.queue.put(None)

        try:
            self.chain.loop.run(close(), timeout_s=2)
        except Exception:
            pass


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)


def wait_for(pred, timeout_s: float, what: str, period_s: float = 0.25):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(period_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def get_in_netns(netns: str, url: str, timeout_s: float = 10.0) -> bytes:
    """GET `url` from inside network namespace `netns` (services listening on emulated hosts' addresses)."""
    import http.client
    import socket

    from netem.system import socket_in_netns

    hostport, _, path = url.split("//", 1)[1].partition("/")
    addr, port = hostport.rsplit(":", 1)
    sock = socket_in_netns(netns, socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    sock.connect((addr, int(port)))
    conn = http.client.HTTPConnection(addr, int(port), timeout=timeout_s)
    conn.sock = sock
    try:
        conn.request("GET", "/" + path)
        return conn.getresponse().read()
    finally:
        conn.close()


@contextlib.contextmanager
def emulated_network(hosts: list[str], rtt_ms: list[list[float]], prefix: str, **network_kwargs):
    """A `netem.Network` named `prefix` + a random suffix. Skips the test, saying why, where this machine
    cannot emulate it (not root, no /dev/net/tun; no nft/iptables when `behind_nat` is given), and is
    removed afterwards even when the test failed."""
    import uuid

    import netem
    from netem.errors import MissingCapabilityError
    from netem.nat import nat_tool
    from netem.system import require_capabilities

    try:
        require_capabilities(tc=False, tun=True)
        if network_kwargs.get("behind_nat"):
            nat_tool()
    except MissingCapabilityError as e:
        pytest.skip(str(e))
    name = prefix + uuid.uuid4().hex[:6]
    try:
        with netem.Network(hosts, rtt_ms, name=name, **network_kwargs) as net:
            yield net
    finally:
        netem.cleanup(name)


class ListedChains(ChainProvider):
    """Offers the listed single-hop chains in order, skipping excluded peers (records what it was asked)."""

    def __init__(self, peers: list[str], num_blocks: int):
        self.peers, self.num_blocks = peers, num_blocks
        self.excludes: list[frozenset[str]] = []

    def find_chain(self, start, end, *, exclude=frozenset(), max_length=0, session_id="", adapter=None):
        self.excludes.append(exclude)
        free = [p for p in self.peers if p not in exclude]
        if not free:
            raise NoChainError(f"every listed peer is excluded ({len(self.peers)} of them)")
        return [Hop(free[0], start, end)]


LIVE_GATEWAY_KEY = "sk-live-gateway"  # the API key of conftest's shared `live_gateway`


@dataclass(frozen=True)
class LiveGateway:
    """`petals-chain api` running over a live `LocalSwarm`: `root` is its URL (…/), `key` its API key."""

    root: str
    key: str
    swarm: object  # the LocalSwarm (its servers' `lines` carry the gateway's request ids)

    @property
    def v1(self) -> str:
        return self.root + "v1"


@contextlib.contextmanager
def running_gateway(swarm, *, key: str, max_concurrent: int, start_timeout_s: float = 180):
    """Starts `petals-chain api --port 0` over `swarm` and yields a `LiveGateway` once it prints where it
    listens; on the way out it is stopped with SIGTERM, then its process group (its p2p daemon) killed."""
    cmd = ["-m", "petals_chain.cli", "api", "--initial-peers", *swarm.initial_peers]
    cmd += ["--port", "0", "--api-key", key, "--max-concurrent", str(max_concurrent)]
    proc = swarm.spawn("api", cmd)  # preloaded as the swarm's own processes are
    lines: list[str] = []
    ready = threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line.rstrip())
            if "chat page at " in line:  # its last start-up line: the OpenAI and Ollama APIs are up too
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        started = ready.wait(start_timeout_s) and proc.poll() is None
        assert started, "gateway did not start:\n" + "\n".join(lines[-30:])
        root = next(x for x in lines if "chat page at " in x).split("chat page at ")[1].strip()
        yield LiveGateway(root=root, key=key, swarm=swarm)
    finally:
        stop_process(proc)  # and its p2p daemon
