"""Typed errors shared by every side. Each message says what went wrong and how to fix it.

Errors that cross the wire carry a stable `code` so the receiving side can re-raise the same type
(see `petals_chain.wire`).
"""

from __future__ import annotations

import enum


class ErrorCode(enum.StrEnum):
    """The stable code of each error type on the wire (a StrEnum: it is sent as its string)."""

    ERROR = "error"
    MODEL_NOT_FOUND = "model_not_found"
    UNSUPPORTED_MODEL = "unsupported_model"
    INVALID_REQUEST = "invalid_request"
    UNKNOWN_SESSION = "unknown_session"
    OUT_OF_CACHE = "out_of_cache"
    MAX_LENGTH_EXCEEDED = "max_length_exceeded"
    REQUEST_TOO_LARGE = "request_too_large"
    SERVER_UNAVAILABLE = "server_unavailable"
    NO_CHAIN = "no_chain"
    ACQUIRE_TIMEOUT = "acquire_timeout"
    ORCHESTRATOR_UNAVAILABLE = "orchestrator_unavailable"
    UNKNOWN_LEASE = "unknown_lease"
    SCHEDULER_POLICY_ERROR = "scheduler_policy_error"
    SESSION_CLOSED = "session_closed"
    SESSION_IDLE_TIMEOUT = "session_idle_timeout"
    ADMISSION_TIMEOUT = "admission_timeout"
    NOT_ALLOWED = "not_allowed"
    IDENTITY_ERROR = "identity_error"
    P2P_START_ERROR = "p2p_start_error"
    UNKNOWN_ADAPTER = "unknown_adapter"
    RELAY_REFUSED = "relay_refused"
    DIRECT_REFUSED = "direct_refused"
    BAD_REPLY = "bad_reply"
    VERIFICATION_ROLLBACK = "verification_rollback"
    BAD_REPORT = "bad_report"
    SERVER_MOVING = "server_moving"


class PetalsChainError(Exception):
    """Base class of all petals-chain errors."""

    code = ErrorCode.ERROR


class ModelNotFoundError(PetalsChainError):
    code = ErrorCode.MODEL_NOT_FOUND


class UnsupportedModelError(PetalsChainError):
    code = ErrorCode.UNSUPPORTED_MODEL


class InvalidRequestError(PetalsChainError, ValueError):
    """The request is malformed: wrong shape, dtype, field or order of messages."""

    code = ErrorCode.INVALID_REQUEST


class UnknownSessionError(InvalidRequestError):
    code = ErrorCode.UNKNOWN_SESSION


class OutOfCacheError(PetalsChainError):
    """The server cannot reserve the KV cache a session asks for within its memory budget."""

    code = ErrorCode.OUT_OF_CACHE


class UnknownAdapterError(InvalidRequestError):
    """The session asked for a LoRA adapter this server (or chain) does not serve."""

    code = ErrorCode.UNKNOWN_ADAPTER


class MaxLengthExceededError(InvalidRequestError):
    code = ErrorCode.MAX_LENGTH_EXCEEDED


class RequestTooLargeError(InvalidRequestError):
    """A step or forward carries more tokens than the server's advertised `max_step_tokens`."""

    code = ErrorCode.REQUEST_TOO_LARGE


class ServerUnavailableError(PetalsChainError):
    """A server did not answer, closed the stream, or died."""

    code = ErrorCode.SERVER_UNAVAILABLE


class NoChainError(PetalsChainError):
    """No chain of servers covering all blocks can be found right now."""

    code = ErrorCode.NO_CHAIN


class AcquireTimeoutError(PetalsChainError):
    """The orchestrator queued the session but no chain slot freed up within the timeout."""

    code = ErrorCode.ACQUIRE_TIMEOUT


class TooManyWaitingError(AcquireTimeoutError):
    """The client already has the most sessions the orchestrator lets one client keep waiting (a flood of
    acquires): retry once some of them were granted. Sent as an acquire timeout (retry later)."""


class OrchestratorUnavailableError(PetalsChainError):
    """The orchestrator did not answer (it died, or is unreachable)."""

    code = ErrorCode.ORCHESTRATOR_UNAVAILABLE


class UnknownLeaseError(InvalidRequestError):
    """The orchestrator holds no lease for this session (released, expired, or its chain vanished)."""

    code = ErrorCode.UNKNOWN_LEASE


class SchedulerPolicyError(PetalsChainError):
    """The server's scheduling policy failed; the server failed the waiting steps and keeps serving."""

    code = ErrorCode.SCHEDULER_POLICY_ERROR


class SessionClosedError(PetalsChainError):
    """The session was closed (or its stream broke) while one of its steps waited."""

    code = ErrorCode.SESSION_CLOSED


class SessionIdleTimeoutError(PetalsChainError):
    """The server closed a session whose client sent nothing for longer than its idle timeout."""

    code = ErrorCode.SESSION_IDLE_TIMEOUT


class AdmissionTimeoutError(OutOfCacheError):
    """The session waited in the server's admission queue until its deadline without getting KV memory."""

    code = ErrorCode.ADMISSION_TIMEOUT


class NotAllowedError(PetalsChainError):
    """The caller's peer id is not on the server's or orchestrator's --allowed-peers list."""

    code = ErrorCode.NOT_ALLOWED


class RelayRefusedError(PetalsChainError):
    """A server refused a step pushed by another server (server-to-server relay): no such session
    here, the pusher is not the previous hop the client named, or the step id was already taken.
    Harmless: the client's own copy of the step still arrives and runs."""

    code = ErrorCode.RELAY_REFUSED


class DirectRefusedError(PetalsChainError):
    """A server refused a direct stream (petals_chain/transport/direct_stream.py): the ticket is not one it issued
    (it restarted), the stream name is unknown, or the hello was malformed. The client asks for a
    new ticket or uses the p2p stream instead; nothing is lost."""

    code = ErrorCode.DIRECT_REFUSED


class IdentityError(PetalsChainError):
    """A peer identity file cannot be read or written (local only, never sent over the wire)."""

    code = ErrorCode.IDENTITY_ERROR


class P2PStartError(PetalsChainError):
    """The peer-to-peer daemon did not start: a bad listen address, or no initial peer answered
    (local only: raised by `process_signals.start_dht` in place of hivemind's multi-line P2PDaemonError)."""

    code = ErrorCode.P2P_START_ERROR


class ServerMovingError(ServerUnavailableError):
    """The server closed this session to load other blocks: the orchestrator's re-plan moved it once its
    drain deadline passed (`--drain-timeout` with `--force-replan`). The server is healthy: the client
    fails the session over to another chain (replaying it, as when a server leaves) without banning it."""

    code = ErrorCode.SERVER_MOVING


class BadReplyError(ServerUnavailableError):
    """A server's reply was impossible (NaN/Inf, a wrong shape or dtype, norms far outside what its
    blocks produce) or it was caught returning wrong hidden states (petals_chain/client/verification.py):
    the client fails over around it, as around a dead server."""

    code = ErrorCode.BAD_REPLY


class VerificationRollback(PetalsChainError):
    """A spot check found that a server returned wrong hidden states from position `trusted_position`
    on: what the session generated after it is untrusted. `DistributedModelForCausalLM.generate`
    handles it (rolls the session back there, fails over around the server and generates again); a
    caller stepping a session itself must roll back to `trusted_position` and step again from there."""

    code = ErrorCode.VERIFICATION_ROLLBACK

    def __init__(self, message: str = "", trusted_position: int = 0):
        super().__init__(message)
        self.trusted_position = trusted_position


class BadReportError(InvalidRequestError):
    """The orchestrator refused a verification report: a bad signature, digests that do not match its
    tensors, or evidence its own third opinion contradicts."""

    code = ErrorCode.BAD_REPORT


ERROR_TYPES: dict[ErrorCode, type[PetalsChainError]] = {
    cls.code: cls
    for cls in (
        PetalsChainError,
        ModelNotFoundError,
        UnsupportedModelError,
        InvalidRequestError,
        UnknownSessionError,
        OutOfCacheError,
        MaxLengthExceededError,
        RequestTooLargeError,
        ServerUnavailableError,
        ServerMovingError,
        NoChainError,
        AcquireTimeoutError,
        OrchestratorUnavailableError,
        UnknownLeaseError,
        SchedulerPolicyError,
        SessionClosedError,
        SessionIdleTimeoutError,
        AdmissionTimeoutError,
        NotAllowedError,
        UnknownAdapterError,
        RelayRefusedError,
        DirectRefusedError,
        BadReplyError,
        VerificationRollback,
        BadReportError,
    )
}


def error_from_code(code: str, message: str) -> PetalsChainError:
    """Rebuild a typed error received over the wire (unknown codes become the base class)."""
    return ERROR_TYPES.get(code, PetalsChainError)(message)
