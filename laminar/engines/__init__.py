"""Generation engines: one interface (:class:`Engine`), one factory (:func:`create_engine`).

Backends:

* ``vllm`` — vLLM's async engine in this process, token ids in and out (``vllm_engine``).
* ``sim`` — no model: response lengths from a distribution, step times from a cost model, under
  the injectable clock (``sim``). For emulated and simulated clusters.

The config is a discriminated union on ``backend``, so a role's YAML picks the backend and gets
that backend's settings validated. Backends import lazily: choosing ``sim`` never imports vLLM.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from laminar.runtime.clock import Clock

from .base import (
    Engine,
    EngineError,
    EngineOutput,
    EngineRequest,
    EngineStats,
    InflightSequence,
    KvState,
)
from .configs import SimEngineConfig, VllmEngineConfig

EngineConfig = Annotated[VllmEngineConfig | SimEngineConfig, Field(discriminator="backend")]

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineOutput",
    "EngineRequest",
    "EngineStats",
    "InflightSequence",
    "KvState",
    "SimEngineConfig",
    "VllmEngineConfig",
    "create_engine",
]


def create_engine(
    config: VllmEngineConfig | SimEngineConfig, *, clock: Clock | None = None
) -> Engine:
    """The engine a config names (not started: ``await engine.start()``)."""
    if isinstance(config, VllmEngineConfig):
        from .vllm_engine import VllmEngine

        return VllmEngine(config)
    if isinstance(config, SimEngineConfig):
        from .sim import SimEngine

        return SimEngine(config, clock=clock)
    raise TypeError(f"no engine backend for {type(config).__name__}")
