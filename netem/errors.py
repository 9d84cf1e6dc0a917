"""Typed errors of the WAN emulator; every message says how to fix the problem."""

from __future__ import annotations


class NetemError(RuntimeError):
    """Base class of the emulator's errors."""


class MissingCapabilityError(NetemError):
    """Not root / no CAP_NET_ADMIN, a missing `ip`/`tc` binary, no /dev/net/tun, or no sch_netem for `kernel`."""


class TopologyError(ValueError):
    """A topology (RTT matrix, host list, JSON file) that cannot be emulated."""


class NetworkExistsError(NetemError):
    """A network of this name is already up (or left over from a crashed run)."""


class NetworkNotFoundError(NetemError):
    """No network of this name is up."""
