"""Experience-buffer policies: which trajectories the trainer gets, and which are dropped.

Both are small pluggable objects that see :class:`BufferEntry` rows (metadata, no tokens) and
return trajectory ids; the data role applies their choice durably. Name a built-in (``fifo``,
``newest``; ``none``, ``max_size``) or your own class as ``module:Class`` / ``file.py:Class``
(constructed with the ``options`` mapping of the config as keyword arguments).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from laminar.errors import ConfigError
from laminar.plugins import load_object

from .store import BufferEntry


class Sampler(Protocol):
    def select(self, ready: Sequence[BufferEntry], n: int, trainer_version: int) -> list[str]:
        """Pick up to ``n`` of ``ready`` (oldest first) for the trainer's next batch."""
        ...


class EvictionPolicy(Protocol):
    def evict(self, ready: Sequence[BufferEntry], trainer_version: int) -> list[str]:
        """Ids to drop from ``ready`` now (they will never be trained on)."""
        ...


class FifoSampler:
    """Oldest first: each trajectory is consumed in the order it finished."""

    def select(self, ready: Sequence[BufferEntry], n: int, trainer_version: int) -> list[str]:
        return [e.trajectory_id for e in ready[:n]]


class NewestSampler:
    """Newest first (freshest policy versions); older ones wait or get evicted."""

    def select(self, ready: Sequence[BufferEntry], n: int, trainer_version: int) -> list[str]:
        return [e.trajectory_id for e in sorted(ready, key=lambda e: -e.seq)[:n]]


class KeepAll:
    def evict(self, ready: Sequence[BufferEntry], trainer_version: int) -> list[str]:
        return []


class MaxSize:
    """Keep at most ``max_size`` waiting trajectories; drop the oldest beyond that."""

    def __init__(self, max_size: int = 4096) -> None:
        if max_size < 1:
            raise ConfigError(f"max_size eviction needs max_size >= 1, got {max_size}")
        self.max_size = max_size

    def evict(self, ready: Sequence[BufferEntry], trainer_version: int) -> list[str]:
        excess = len(ready) - self.max_size
        return [e.trajectory_id for e in ready[:excess]] if excess > 0 else []


SAMPLERS: dict[str, type] = {"fifo": FifoSampler, "newest": NewestSampler}
EVICTIONS: dict[str, type] = {"none": KeepAll, "max_size": MaxSize}


def make_policy(kind: str, builtins: dict[str, type], options: dict[str, Any]) -> Any:
    cls = builtins.get(kind) or load_object(kind, what="buffer policy")
    try:
        return cls(**options)
    except TypeError as exc:
        raise ConfigError(f"cannot construct {kind} with options {options}: {exc}") from None
