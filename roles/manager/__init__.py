"""The manager role: membership, the relay chain, repack, and the admin HTTP API.

The service loads on first use of ``ManagerService`` or ``ManagerConfig``, so importing one of
its modules (the admin API's models, the OpenAPI document) does not load the whole role.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .service import ManagerConfig, ManagerService

__all__ = ["ManagerConfig", "ManagerService"]


def __getattr__(name: str) -> Any:
    if name in ("ManagerConfig", "ManagerService"):
        from . import service

        return getattr(service, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
