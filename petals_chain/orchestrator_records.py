"""Records exchanged with the online orchestrator (msgpack metadata, validated at the boundary).

- `OrchestratorInfo`: what the orchestrator announces in the DHT under `orchestrator_key(model)`,
  so servers and clients of the same model find it with no extra flag.
- `Assignment`: the block range the orchestrator assigned to a server (rpc_assignment).
- `ChainGrant`: the chain a session may run on (rpc_acquire), with its lease.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from hivemind.dht import DHT


from petals_chain.dht_records import store_record
from petals_chain.errors import InvalidRequestError
from petals_chain.swarm_identity import SwarmIdentity
from petals_chain.wire import PROTOCOL_VERSION, field_of

ASSIGNMENT_STATUSES = ("pending", "assigned", "unused")


def orchestrator_key(model: str) -> str:
    return f"petals-chain:{model}:orchestrator"


@dataclass
class OrchestratorInfo:
    peer_id: str
    model: str
    policy: str
    plan_version: int = 0
    http_port: int = 0
    version: str = PROTOCOL_VERSION

    def to_wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, data: Any) -> "OrchestratorInfo":
        if not isinstance(data, dict):
            raise InvalidRequestError(f"OrchestratorInfo must be a map, got {type(data).__name__}")
        return cls(peer_id=field_of(data, "peer_id", str), model=field_of(data, "model", str),
                   policy=field_of(data, "policy", str), plan_version=field_of(data, "plan_version", int, default=0),
                   http_port=field_of(data, "http_port", int, default=0),
                   version=field_of(data, "version", str, default=PROTOCOL_VERSION))


def announce_orchestrator(dht: DHT, info: OrchestratorInfo, owner: SwarmIdentity, ttl_s: float) -> bool:
    return store_record(dht, orchestrator_key(info.model), owner, info.to_wire(), ttl_s)


def find_orchestrator(dht: DHT, model: str, allowed: frozenset[str] | None = None) -> OrchestratorInfo | None:
    """The live orchestrator of `model` (the most recently announced one if several), or None; with
    `allowed`, only an orchestrator whose peer id is on that list."""
    found = dht.get(orchestrator_key(model), latest=True)
    if found is None or not isinstance(found.value, dict):
        return None
    best = None
    for entry in found.value.values():
        try:
            info = OrchestratorInfo.from_wire(entry.value)
        except InvalidRequestError:
            continue
        if allowed is not None and info.peer_id not in allowed:
            continue
        if best is None or entry.expiration_time > best[0]:
            best = (entry.expiration_time, info)
    return None if best is None else best[1]


@dataclass
class Assignment:
    """`pending`: no plan covers this server yet (ask again); `assigned`: load [start, end);
    `unused`: the plan leaves this server without blocks (ask again later)."""

    status: str
    plan_version: int
    start: int = 0
    end: int = 0

    def to_wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, data: Any) -> "Assignment":
        if not isinstance(data, dict):
            raise InvalidRequestError(f"Assignment must be a map, got {type(data).__name__}")
        a = cls(status=field_of(data, "status", str), plan_version=field_of(data, "plan_version", int),
                start=field_of(data, "start", int, default=0), end=field_of(data, "end", int, default=0))
        if a.status not in ASSIGNMENT_STATUSES:
            raise InvalidRequestError(f"unknown assignment status {a.status!r}")
        if a.status == "assigned" and not 0 <= a.start < a.end:
            raise InvalidRequestError(f"bad assigned range [{a.start}, {a.end})")
        return a


@dataclass
class GrantHop:
    peer_id: str
    start: int
    end: int
    name: str = ""


@dataclass
class ChainGrant:
    session_id: str
    chain_id: int
    plan_version: int
    hops: list[GrantHop]
    service_time_s: float
    lease_ttl_s: float
    wait_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, data: Any) -> "ChainGrant":
        if not isinstance(data, dict):
            raise InvalidRequestError(f"ChainGrant must be a map, got {type(data).__name__}")
        hops_raw = field_of(data, "hops", list)
        hops = []
        for h in hops_raw:
            if not isinstance(h, dict):
                raise InvalidRequestError("every hop of a ChainGrant must be a map")
            hop = GrantHop(field_of(h, "peer_id", str), field_of(h, "start", int), field_of(h, "end", int),
                           field_of(h, "name", str, default=""))
            if not 0 <= hop.start < hop.end:
                raise InvalidRequestError(f"bad hop range [{hop.start}, {hop.end})")
            hops.append(hop)
        if not hops:
            raise InvalidRequestError("a ChainGrant needs at least one hop")
        for a, b in zip(hops, hops[1:]):
            if a.end != b.start:
                raise InvalidRequestError(f"hops must be contiguous: [{a.start}, {a.end}) then [{b.start}, {b.end})")
        return cls(session_id=field_of(data, "session_id", str), chain_id=field_of(data, "chain_id", int),
                   plan_version=field_of(data, "plan_version", int), hops=hops,
                   service_time_s=field_of(data, "service_time_s", float), lease_ttl_s=field_of(data, "lease_ttl_s", float),
                   wait_s=field_of(data, "wait_s", float, default=0.0), extra=field_of(data, "extra", dict, default={}))
