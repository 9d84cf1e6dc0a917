"""WAN emulation on one Linux host: one network namespace per emulated host, pairwise RTTs, bandwidth.

`netem.Network` (a context manager) is the API; `netem.cleanup()` removes leftovers; topology loaders
live in `netem.topology`. This package imports nothing of the other project packages (DESIGN.md).
"""

from netem.errors import (
    MissingCapabilityError,
    NetemError,
    NetworkExistsError,
    NetworkNotFoundError,
    TopologyError,
)
from netem.network import BACKENDS, Network, cleanup, command_in, hub_alive

__all__ = [
    "BACKENDS",
    "MissingCapabilityError",
    "NetemError",
    "Network",
    "NetworkExistsError",
    "NetworkNotFoundError",
    "TopologyError",
    "cleanup",
    "command_in",
    "hub_alive",
]
