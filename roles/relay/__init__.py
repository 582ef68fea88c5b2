"""The relay role: newest weight versions in host shared memory, one relay per rollout machine.

The contract (:mod:`.api`) loads with the package; the service loads on first use of
``RelayService`` or ``RelayConfig``, so rollouts and the manager that only talk to relays do not
load the weight transfer code with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .api import LatestRequest, RelayApi, RelayStats, RelayStatus, SharedVersion, VersionState

if TYPE_CHECKING:
    from .service import RelayConfig, RelayService, default_weights_scheme

__all__ = [
    "LatestRequest",
    "RelayApi",
    "RelayConfig",
    "RelayService",
    "RelayStats",
    "RelayStatus",
    "SharedVersion",
    "VersionState",
    "default_weights_scheme",
]


def __getattr__(name: str) -> Any:
    if name in ("RelayConfig", "RelayService", "default_weights_scheme"):
        from . import service

        return getattr(service, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
