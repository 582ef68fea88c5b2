"""The manager role: membership, the relay chain, repack, and the admin HTTP API."""

from .service import ManagerConfig, ManagerService

__all__ = ["ManagerConfig", "ManagerService"]
