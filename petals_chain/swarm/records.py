"""Where swarm records live in the DHT, and how they are written and read: the servers' records under
`servers_key(model)` and the online orchestrator's under `orchestrator_key(model)` (the records
themselves are `petals_chain/wire/records.py`)."""

from __future__ import annotations

import logging

from hivemind.dht import DHT
from hivemind.utils import get_dht_time

from petals_chain.errors import InvalidRequestError
from petals_chain.swarm.identity import SwarmIdentity
from petals_chain.wire.records import OrchestratorInfo, ServerInfo, ServerState

logger = logging.getLogger(__name__)


def servers_key(model: str) -> str:
    return f"petals-chain:{model}:servers"


def model_key(model: str) -> str:
    """Models are named by their short name (e.g. smollm2-135m) or folder name: servers and clients agree on it."""
    return model.rstrip("/").split("/")[-1].lower()


def store_record(
    dht: DHT, key: str, owner: SwarmIdentity, value: dict, ttl_s: float, *, timeout_s: float = 10.0
) -> bool:
    """Store `value` under `key` and `owner`'s subkey, signed by `owner` (swarm_identity), expiring after `ttl_s`.

    Bounded by `timeout_s`: if the DHT process died the caller must not block forever.
    """
    future = dht.store(
        key, subkey=owner.owner_subkey, value=value, expiration_time=get_dht_time() + ttl_s, return_future=True
    )
    return bool(future.result(timeout=timeout_s))


def announce_server(dht: DHT, info: ServerInfo, owner: SwarmIdentity, ttl_s: float, *, timeout_s: float = 10.0) -> bool:
    """Store `info` under the model's servers key, in `owner`'s signed subkey."""
    return store_record(dht, servers_key(info.model), owner, info.to_wire(), ttl_s, timeout_s=timeout_s)


def fetch_servers(
    dht: DHT,
    model: str,
    *,
    states: tuple[ServerState, ...] = (ServerState.ONLINE,),
    allowed: frozenset[str] | None = None,
) -> list[ServerInfo]:
    """All unexpired ServerInfo records of `model` (malformed records are skipped with a warning);
    with `allowed` (a private swarm's members), only those of allowed peers."""
    found = dht.get(servers_key(model), latest=True)
    if found is None or not isinstance(found.value, dict):
        return []
    infos = []
    for entry in found.value.values():
        try:
            info = ServerInfo.from_wire(entry.value)
        except InvalidRequestError as e:  # the validators refuse these; a peer without them may hold one
            logger.warning("ignoring malformed server record: %s", e)
            continue
        if info.state in states and (allowed is None or info.peer_id in allowed):
            infos.append(info)
    return sorted(infos, key=lambda i: (i.start, i.peer_id))


def orchestrator_key(model: str) -> str:
    return f"petals-chain:{model}:orchestrator"


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
