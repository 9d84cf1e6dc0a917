"""Verification reports: clients' signed evidence of servers returning wrong hidden states.

A client whose spot check convicted a server (petals_chain/client/verification.py) sends
`rpc_report` a `VerificationReport` with the evidence as tensors: the span's inputs up to the first
wrong row, the accused's row and the reference row. The orchestrator

1. checks the report itself: the signature is the caller's (the key's libp2p peer id is the
   authenticated caller's, `SwarmIdentity`), the digests name the tensors sent, the shapes fit;
   a bad one is refused with a typed `BadReportError`;
2. checks the evidence against its own third opinion: it runs the inputs through servers holding
   the span other than the accused (and, where it can, other than the reporter's agreeing servers),
   and counts the report only if that recomputation agrees with the reference row and disagrees with
   the accused's row (`hidden_compare`, the client's bounds); a report its third opinion contradicts
   is refused (`BadReportError`), one it cannot check (no other server) is kept but not counted;
3. counts reports per accused server by distinct reporting peer, so no one client, however many
   reports it sends, gets a server excluded: after `exclude_after` distinct reporters the
   orchestrator stops planning the server (`excluded`: its record is dropped from planning as a
   server that left, and it never registers again while this orchestrator runs).

What this cannot do: the orchestrator cannot prove the accused sent the row a report says it did
(servers do not sign replies), so a reporter can frame a server that computes correctly only
together with `exclude_after - 1` other peers; in an open swarm peer ids are free (Sybil), so k
distinct reporters mean k independent clients only where membership is controlled (`--allowed-peers`).
"""

from __future__ import annotations

import base64
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch

from petals_chain.algorithms.hidden_compare import digest, first_mismatch, tolerance_for
from petals_chain.errors import BadReportError, PetalsChainError
from petals_chain.wire.messages import ReportReply, Verdict, VerificationReport

MAX_THIRD_OPINIONS = 4  # servers the orchestrator asks about one report, at most
# forward(peer_id, entry_block, hidden [rows, hidden]) -> the server's output rows (a stateless rpc_forward)
Forward = Callable[[str, int, torch.Tensor], Awaitable[torch.Tensor]]


@dataclass
class AccusedServer:
    reporters: set[str] = field(default_factory=set)  # peers whose checked reports count
    reports: int = 0  # every report received about it, counted or not
    unverified: int = 0  # reports no third server could check
    excluded: bool = False
    last: str = ""


def span_path(
    servers: list[tuple[str, int, int]], start: int, end: int, exclude: set[str]
) -> list[tuple[str, int]] | None:
    """(peer, entry block) hops that compute exactly blocks [start, end) with servers (peer, start, end)
    outside `exclude` (each hop runs from its entry to its server's end, which must stay within the
    span), fewest hops first; None if there is none. Pure."""
    frontier: dict[int, list[tuple[str, int]]] = {start: []}
    for _ in range(end - start):
        grown: dict[int, list[tuple[str, int]]] = {}
        for b, path in frontier.items():
            if b == end:
                return path
            for peer, s, e in servers:
                if peer in exclude or not s <= b < e or e > end:
                    continue
                if e not in frontier and e not in grown:
                    grown[e] = [*path, (peer, b)]
        if end in grown:
            return grown[end]
        if not grown:
            return None
        frontier = grown
    return frontier.get(end)


class ServerReports:
    """The reports about servers and who is excluded (thread-safe: RPC handlers on the loop write,
    the control loop and the status page read)."""

    def __init__(self, exclude_after: int = 3):
        if exclude_after < 1:
            raise ValueError(f"exclude_after must be >= 1, got {exclude_after}")
        self.exclude_after = exclude_after
        self._lock = threading.Lock()
        self._accused: dict[str, AccusedServer] = {}
        self.refused = 0  # reports refused with a typed error

    def excluded(self) -> set[str]:
        with self._lock:
            return {p for p, a in self._accused.items() if a.excluded}

    def view(self) -> dict:
        with self._lock:
            return {
                "exclude_after": self.exclude_after,
                "refused": self.refused,
                "servers": {
                    p: {
                        "reporters": sorted(a.reporters),
                        "reports": a.reports,
                        "unverified": a.unverified,
                        "excluded": a.excluded,
                        "last": a.last,
                    }
                    for p, a in self._accused.items()
                },
            }

    @staticmethod
    def check_report(
        report: VerificationReport,
        tensors: list[torch.Tensor],
        caller: str,
        model: str,
        peer_id_of_key: Callable[[bytes], str],
        verify_signature: Callable[[bytes, bytes, bytes], bool],
    ) -> None:
        """Raises `BadReportError` unless the report is well-formed, signed by `caller` and its digests name
        its tensors."""

        def bad(why: str) -> BadReportError:
            return BadReportError(f"verification report refused: {why}")

        if report.model != model:
            raise bad(f"it is about model {report.model!r}, this orchestrator plans {model!r}")
        if report.accused == caller:
            raise bad("a peer cannot report itself")
        try:
            key, signature = (
                base64.b64decode(report.reporter_key, validate=True),
                base64.b64decode(report.signature, validate=True),
            )
        except ValueError:
            raise bad("reporter_key and signature must be base64") from None
        try:
            signer = peer_id_of_key(key)
        except Exception:
            raise bad("reporter_key is not an RSA public key in OpenSSH form") from None
        if signer != caller:
            raise bad(f"it is signed by {signer}, not by the caller {caller}")
        if not verify_signature(key, report.signed_bytes(), signature):
            raise bad("its signature does not verify")
        if len(tensors) != 3:
            raise bad(f"it must carry 3 tensors (inputs, accused row, reference row), got {len(tensors)}")
        inputs, accused, reference = tensors
        if inputs.dim() != 2 or inputs.shape[0] != report.position + 1:
            raise bad(
                f"its inputs must be [position + 1, hidden] = [{report.position + 1}, hidden], got {list(inputs.shape)}"
            )
        if accused.shape != (1, inputs.shape[1]) or reference.shape != (1, inputs.shape[1]):
            raise bad("its accused and reference rows must be [1, hidden]")
        for name, t in (("input_digest", inputs), ("accused_digest", accused), ("reference_digest", reference)):
            if digest(t) != getattr(report, name):
                raise bad(f"{name} does not name the tensor it carries")

    async def add(
        self,
        report: VerificationReport,
        tensors: list[torch.Tensor],
        caller: str,
        servers: list[tuple[str, int, int]],
        forward: Forward,
    ) -> ReportReply:
        """Check the evidence with a third opinion and count the report (see the module docstring)."""
        inputs, accused_row, reference_row = tensors
        accused = report.accused
        with self._lock:
            entry = self._accused.setdefault(accused, AccusedServer())
            entry.reports += 1
        # third opinions: servers independent of the report first (not the accused, the reporter, or those it
        # names as agreeing), then the agreeing ones; the first that agrees with one side decides, one that
        # agrees with neither (itself wrong) is passed over
        tried: set[str] = set()
        verdict, decider, failures = None, None, []
        for independent in (True, False):
            while verdict is None and len(tried) < MAX_THIRD_OPINIONS:
                exclude = {accused, *tried} | ({caller, *report.agreeing} if independent else set())
                path = span_path(servers, report.start, report.end, exclude)
                if path is None:
                    break
                tried.update(peer for peer, _ in path)
                x = inputs
                try:
                    for peer, entry_block in path:
                        x = await forward(peer, entry_block, x)
                except PetalsChainError as e:
                    failures.append(str(e))
                    continue
                third = x[report.position : report.position + 1]
                tolerance = tolerance_for(inputs.dtype, third.dtype)
                if first_mismatch(reference_row, third, tolerance) is None:
                    verdict, decider = True, path[0][0]
                elif first_mismatch(accused_row, third, tolerance) is None:
                    verdict, decider = False, path[0][0]
        if verdict is None:
            with self._lock:
                entry.unverified += 1
                entry.last = (
                    f"unverified report by {caller[-8:]}: no other server of [{report.start}, {report.end}) "
                    f"confirmed either side{'; ' + failures[-1] if failures else ''}"
                )
                return ReportReply(False, len(entry.reporters), entry.excluded, entry.last)
        if not verdict:
            with self._lock:
                self.refused += 1
                entry.last = f"report by {caller[-8:]} contradicted by the third opinion of {decider[-8:]}"
            raise BadReportError(
                f"verification report refused: the orchestrator's third opinion ({decider}) "
                "computes the accused's row, not the reference: the accused was right"
            )
        with self._lock:
            entry.reporters.add(caller)
            entry.last = f"{report.verdict} at position {report.position} reported by {caller[-8:]}"
            if len(entry.reporters) >= self.exclude_after:
                entry.excluded = True
            return ReportReply(True, len(entry.reporters), entry.excluded)


__all__ = ["ServerReports", "span_path", "Verdict"]
