"""The online orchestrator's DHT record: `OrchestratorInfo`, announced under `orchestrator_key(model)`,
so servers and clients of the same model find it with no extra flag. (The messages of its RPCs,
`Assignment` and `ChainGrant` among them, are in `messages.py`.)
"""
from __future__ import annotations

from dataclasses import dataclass

from hivemind.dht import DHT

from petals_chain.dht_records import store_record
from petals_chain.errors import InvalidRequestError
from petals_chain.swarm_identity import SwarmIdentity
from petals_chain.wire import PROTOCOL_VERSION
from petals_chain.wire_record import WireRecord


def orchestrator_key(model: str) -> str:
    return f"petals-chain:{model}:orchestrator"


@dataclass
class OrchestratorInfo(WireRecord):
    peer_id: str
    model: str
    policy: str
    plan_version: int = 0
    http_port: int = 0
    version: str = PROTOCOL_VERSION


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
