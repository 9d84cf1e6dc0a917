"""Typed errors shared by every side. Each message says what went wrong and how to fix it.

Errors that cross the wire carry a stable `code` so the receiving side can re-raise the same type
(see `petals_chain.wire`).
"""
from __future__ import annotations


class PetalsChainError(Exception):
    """Base class of all petals-chain errors."""

    code = "error"


class ModelNotFoundError(PetalsChainError):
    code = "model_not_found"


class UnsupportedModelError(PetalsChainError):
    code = "unsupported_model"


class InvalidRequestError(PetalsChainError, ValueError):
    """The request is malformed: wrong shape, dtype, field or order of messages."""

    code = "invalid_request"


class UnknownSessionError(InvalidRequestError):
    code = "unknown_session"


class OutOfCacheError(PetalsChainError):
    """The server cannot reserve the KV cache a session asks for within its memory budget."""

    code = "out_of_cache"


class MaxLengthExceededError(InvalidRequestError):
    code = "max_length_exceeded"


class RequestTooLargeError(InvalidRequestError):
    """A step or forward carries more tokens than the server's advertised `max_step_tokens`."""

    code = "request_too_large"


class ServerUnavailableError(PetalsChainError):
    """A server did not answer, closed the stream, or died."""

    code = "server_unavailable"


class NoChainError(PetalsChainError):
    """No chain of servers covering all blocks can be found right now."""

    code = "no_chain"


class AcquireTimeoutError(PetalsChainError):
    """The orchestrator queued the session but no chain slot freed up within the timeout."""

    code = "acquire_timeout"


class OrchestratorUnavailableError(PetalsChainError):
    """The orchestrator did not answer (it died, or is unreachable)."""

    code = "orchestrator_unavailable"


class UnknownLeaseError(InvalidRequestError):
    """The orchestrator holds no lease for this session (released, expired, or its chain vanished)."""

    code = "unknown_lease"


class SchedulerPolicyError(PetalsChainError):
    """The server's scheduling policy failed; the server failed the waiting steps and keeps serving."""

    code = "scheduler_policy_error"


class SessionClosedError(PetalsChainError):
    """The session was closed (or its stream broke) while one of its steps waited."""

    code = "session_closed"


class SessionIdleTimeoutError(PetalsChainError):
    """The server closed a session whose client sent nothing for longer than its idle timeout."""

    code = "session_idle_timeout"


class AdmissionTimeoutError(OutOfCacheError):
    """The session waited in the server's admission queue until its deadline without getting KV memory."""

    code = "admission_timeout"


class NotAllowedError(PetalsChainError):
    """The caller's peer id is not on the server's or orchestrator's --allowed-peers list."""

    code = "not_allowed"


class IdentityError(PetalsChainError):
    """A peer identity file cannot be read or written (local only, never sent over the wire)."""

    code = "identity_error"


ERROR_TYPES: dict[str, type[PetalsChainError]] = {
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
        NoChainError,
        AcquireTimeoutError,
        OrchestratorUnavailableError,
        UnknownLeaseError,
        SchedulerPolicyError,
        SessionClosedError,
        SessionIdleTimeoutError,
        AdmissionTimeoutError,
        NotAllowedError,
    )
}


def error_from_code(code: str, message: str) -> PetalsChainError:
    """Rebuild a typed error received over the wire (unknown codes become the base class)."""
    return ERROR_TYPES.get(code, PetalsChainError)(message)
