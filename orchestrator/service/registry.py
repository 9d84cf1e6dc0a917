"""Server records (DHT announcements + the orchestrator's RTT measurements) -> the planner's
`Cluster`. Pure: the service feeds records in, gets a Cluster and the peer id of each index.

Units: memory, s_m and s_c in bytes (the model's unit-free `memory`/`block_size`/`cache_size`
accept any single unit); times in seconds. Server names in the Cluster are peer ids (unique); display names
live in the records.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from orchestrator.model import SERVER_COMPUTE, BlockInterval, Cluster, Server, Service
from orchestrator.session_times import SessionShape, tau_c_relay_s, tau_c_s, tau_p_s
from petals_chain.algorithms.service_fit import ServiceFit
from petals_chain.wire.records import ServerInfo

logger = logging.getLogger(__name__)


@dataclass
class ServerRecord:
    info: ServerInfo  # the latest announcement
    rtt_s: float | None = None  # median RTT measured by the orchestrator (None: not measured yet / unreachable)
    last_seen_s: float = 0.0
    fit: ServiceFit | None = None  # the calibrated model from live service (None: the announced t_I, t_O)
    hop_cost_s: float | None = None  # measured per-hop framework cost per step beyond the RTT
    # measured time to move one prompt token's hidden states to the server and back, beyond the RTT
    transfer_s_per_token: float | None = None
    # no fit of its own yet: a fitted twin's fit scaled by their profiles (calibration.scaled_profile_fit)
    scaled_fit: ServiceFit | None = None

    @property
    def model_fit(self) -> ServiceFit | None:
        """What the planner uses: the server's own fit, else its scaled profile, else None (the
        announced profile and the flags)."""
        return self.fit if self.fit is not None else self.scaled_fit

    @property
    def peer_id(self) -> str:
        return self.info.peer_id


@dataclass(frozen=True)
class Overheads:
    per_block_s: float = 0.0  # t_o of footnote 11
    per_step_s: float = 0.0  # added to the RTT on every step in tau_c


RELAYS = ("server", "client")


def batch_overhead_s(record: ServerRecord, shape: SessionShape, compute: str) -> float | None:
    """Server.batch_overhead_s of one server: steps x its fitted t_o (the part of each step a batch pays
    once), or None for the paper's parallel model (see SERVER_COMPUTE)."""
    if compute not in SERVER_COMPUTE:
        raise ValueError(f"server compute must be one of {', '.join(SERVER_COMPUTE)}, got {compute!r}")
    f = record.model_fit
    if compute == "parallel" or (compute == "auto" and f is None):
        return None
    return shape.steps * (f.t_o_s if f is not None else 0.0)


def peer_rtt_s(a: ServerRecord, b: ServerRecord) -> float | None:
    """RTT between two servers as they report it (`ServerInfo.peer_rtt_s`, measured by the servers
    themselves: server/peer_rtts.py); the larger of the two reports when both have one."""
    reports = [x for r, o in ((a, b), (b, a)) if (x := r.info.peer_rtt_s.get(o.peer_id)) is not None and x >= 0]
    return max(reports) if reports else None


def server_params(
    record: ServerRecord,
    shape: SessionShape,
    overheads: Overheads,
    relay: str = "client",
    others: list[ServerRecord] = (),
) -> tuple[float, float]:
    """(tau_c_s, tau_p_s) of one server. `relay="client"`: the client relays every hop, tau_c =
    steps x RTT from the orchestrator (standing in for the clients). `relay="server"`: footnote 4,
    tau_c = max over the possible predecessors (the client, `others` with a reported RTT) of
    steps x RTT_ij / 2.

    With a calibrated fit (`record.model_fit`: its own, else its profile scaled by the fitted
    servers'): t_I, t_O fitted from live service, and the fitted per-step t_o plus the measured
    per-hop cost join the RTT in every step of tau_c (they are paid once per step and server,
    whatever its blocks); the fitted t_B (per block and step, whatever the rows) joins tau_p once
    per step (a session alone pays it in full); the per-block t_o flag then no longer applies. Without
    one: the announced start-up profile and the flags. Either way, once clients reported long
    prompts, the measured transfer per prompt token (`transfer_s_per_token`) times the mean input
    joins tau_c once per session (the paper's Fig. 10: prefill communication grows with the input).

    t_B is not planned as shared by a batch (no `Server.batch_block_overhead_s`): a batch reads each
    block's weights once, but on a pipelined server its sessions' steps arrive out of phase (each
    waits for the hop before), so batches mostly hold one or two sessions and each pays t_B. Measured
    (a Table 1 quick run, docs/results.md): planning t_B as shared made batching look free, c* went to
    11 (3-hop chains of 11 and 8 blocks), and the mean response doubled (48.4 s against 24.9-26.1 s
    in the runs before)."""
    if record.rtt_s is None:
        raise ValueError(f"server {record.peer_id} has no RTT measurement yet")
    if relay not in RELAYS:
        raise ValueError(f"relay must be one of {', '.join(RELAYS)}, got {relay!r}")
    i, f = record.info, record.model_fit
    per_step_s = overheads.per_step_s + (record.hop_cost_s or 0.0) + (f.t_o_s if f is not None else 0.0)
    # the prompt's hidden states: measured there and back (a client round trip); with server relay a
    # hop's critical path receives them once (one leg, as the RTT is halved)
    prompt_rt_s = shape.mean_input_tokens * (record.transfer_s_per_token or 0.0)
    if relay == "server":
        rtts = [record.rtt_s, *(r for o in others if o is not record and (r := peer_rtt_s(record, o)) is not None)]
        tau_c = tau_c_relay_s(rtts, shape, per_step_s, prompt_rt_s / 2)
    else:
        tau_c = tau_c_s(record.rtt_s, shape, per_step_s, prompt_rt_s)
    if f is None:
        return tau_c, tau_p_s(i.prefill_s_per_token, i.decode_s_per_token, shape, overheads.per_block_s)
    t_I = i.prefill_s_per_token if f.t_I_s is None else f.t_I_s
    return tau_c, tau_p_s(t_I, f.t_O_s, shape, 0.0) + shape.steps * f.t_B_s


def lost_servers(
    last_seen_s: dict[str, float], present: set[str], offline: set[str], now_s: float, grace_s: float
) -> list[str]:
    """The known servers to drop: those that announced OFFLINE (a clean shutdown), and those whose record
    has been missing from the DHT for `grace_s` or more. Pure.

    Why a grace: a server's record lives `record_ttl_s` (6 s) and is renewed every 2 s; a server whose
    host is CPU-starved (its quota spent by a batch) or a DHT read that times out can miss one read.
    Dropping at the first miss ended the chains of live servers with sessions on them (Table 1 runs in
    docs/results.md: six servers "left" for one read each, re-registered 1-2 s later, and their sessions
    failed over). A server that really died is found sooner by its clients, which fail over without
    waiting for the orchestrator."""
    if grace_s < 0:
        raise ValueError(f"grace_s must be >= 0, got {grace_s}")
    return [p for p, seen in last_seen_s.items() if p in offline or (p not in present and now_s - seen >= grace_s)]


def rtt_partners(records: list[ServerRecord]) -> dict[str, list[ServerRecord]]:
    """Per server, the others that can give it a pair RTT (`peer_rtt_s`: one of the two reports the other).
    Only those change `server_params`' relay term, so passing them instead of every server gives the same
    tau^c in O(J x reports) instead of O(J^2) (a server probes at most 8 peers: server/peer_rtts.py)."""
    by_id = {r.peer_id: r for r in records}
    partners: dict[str, set[str]] = {}
    for r in records:
        for o in r.info.peer_rtt_s:
            if o in by_id and o != r.peer_id:
                partners.setdefault(r.peer_id, set()).add(o)
                partners.setdefault(o, set()).add(r.peer_id)
    return {p: [by_id[o] for o in sorted(v)] for p, v in partners.items()}


def build_cluster(
    records: list[ServerRecord],
    num_blocks: int,
    shape: SessionShape,
    arrival_rate_per_s: float,
    rho_bar: float,
    overheads: Overheads = Overheads(),
    relay: str = "client",
    compute: str = "parallel",
    kv_plan_tokens: int | None = None,
) -> tuple[Cluster, list[str]]:
    """Cluster over the measured servers (sorted by peer id, so the same inputs give the same
    cluster), and the peer id of each server index. Records without an RTT are left out.
    `compute`: how the servers' compute serves concurrent sessions (SERVER_COMPUTE).
    `kv_plan_tokens`: the session length s_c is reserved for (None: each server's --max-length, what
    its `kv_bytes_per_block` is quoted at). A server reserves a session's KV at the session's own
    max_length, so sessions shorter than the servers' limit let more of them share the memory the
    planner's cache reservation counts in sessions of s_c."""
    usable = sorted((r for r in records if r.rtt_s is not None), key=lambda r: r.peer_id)
    if not usable:
        raise ValueError("no measured server to plan with")
    if kv_plan_tokens is not None and kv_plan_tokens < 1:
        raise ValueError(f"kv_plan_tokens must be >= 1, got {kv_plan_tokens}")
    s_m = max(r.info.block_bytes for r in usable)
    # KV grows linearly with the tokens a session may hold (static caches of max_length rows)
    kv = [
        r.info.kv_bytes_per_block
        if kv_plan_tokens is None
        else r.info.kv_bytes_per_block * min(kv_plan_tokens, r.info.max_length_tokens) / r.info.max_length_tokens
        for r in usable
    ]
    s_c = max(kv)
    if any(r.info.block_bytes != s_m for r in usable) or any(x != s_c for x in kv):
        logger.warning("servers report different s_m / s_c (dtype or max_length differ); planning with the largest")
    partners = rtt_partners(usable)
    servers = []
    for r in usable:
        tau_c, tau_p = server_params(r, shape, overheads, relay, partners.get(r.peer_id, []))
        servers.append(
            Server(
                name=r.peer_id,
                memory=float(r.info.memory_budget_bytes),
                tau_c_s=tau_c,
                tau_p_s=tau_p,
                rtt_s=r.rtt_s,
                batch_overhead_s=batch_overhead_s(r, shape, compute),
            )
        )
    cluster = Cluster(
        service=Service(num_blocks=num_blocks, block_size=float(s_m), cache_size=float(s_c)),
        servers=tuple(servers),
        arrival_rate_per_s=arrival_rate_per_s,
        rho_bar=rho_bar,
    )
    return cluster, [r.peer_id for r in usable]


def cluster_to_dict(cluster: Cluster) -> dict:
    """The cluster in `petals-chain plan --cluster` input form (docs/orchestrator.md)."""
    s = cluster.service
    return {
        "blocks": s.num_blocks,
        "block_size": s.block_size,
        "cache_size": s.cache_size,
        "arrival_rate": cluster.arrival_rate_per_s,
        "rho_bar": cluster.rho_bar,
        "servers": [
            {
                "name": sv.name,
                "memory": sv.memory,
                "tau_c": sv.tau_c_s,
                "tau_p": sv.tau_p_s,
                **({"rtt": sv.rtt_s} if sv.rtt_s is not None else {}),
                **({"batch_overhead": sv.batch_overhead_s} if sv.batch_overhead_s is not None else {}),
                **(
                    {"batch_block_overhead": sv.batch_block_overhead_s} if sv.batch_block_overhead_s is not None else {}
                ),
            }
            for sv in cluster.servers
        ],
    }


@dataclass(frozen=True)
class HeldRange:
    """What a server holds now: `fixed` = started with --blocks START:END (never moved);
    `busy` = it holds live sessions (moved only by a forced re-plan)."""

    start: int
    end: int
    fixed: bool = False
    busy: bool = False


def keep_held_ranges(
    ranges: list[BlockInterval | None], peers: list[str], held: dict[str, HeldRange], *, force: bool = False
) -> tuple[list[BlockInterval | None], list[str]]:
    """Overlay on a fresh placement the ranges that must not move: fixed servers always, busy
    servers unless `force`. Returns the placement to install and the peers kept (pinned) where the
    fresh plan wanted something else. Pure."""
    out = list(ranges)
    pinned = []
    for j, p in enumerate(peers):
        h = held.get(p)
        if h is None or not (h.fixed or (h.busy and not force)):
            continue
        if out[j] is None or (out[j].start, out[j].end) != (h.start, h.end):
            out[j] = BlockInterval(h.start, h.end)
            pinned.append(p)
    return out, pinned
