"""A role that fails on purpose, for the tests of what ``laminar run`` does when a role fails
(started as a real process via ``--role FILE:Failing``)."""

from __future__ import annotations

import os
from typing import ClassVar, Literal

from pydantic import Field

from laminar.runtime.config import ServiceConfig
from laminar.runtime.service import Service


class FailingConfig(ServiceConfig):
    fail: Literal["never", "start", "ready"] = Field(
        "never", description="never; raise in on_start; or crash a task once ready"
    )
    message: str = "the device is gone"
    after_s: float = Field(0.2, ge=0, description="how long after its start a `ready` one fails")


class Failing(Service):
    """Fails as configured, with ``RuntimeError: <message> (pid N)``: the same words at every
    start but for a number, as a model or a file refused again would give."""

    role: ClassVar[str] = "failing"
    config_model = FailingConfig

    async def on_start(self) -> None:
        if self.config.fail == "start":
            raise RuntimeError(f"{self.config.message} (pid {os.getpid()})")
        if self.config.fail == "ready":
            self.spawn(self._fail_soon(), name="fail")

    async def _fail_soon(self) -> None:
        await self.ctx.clock.sleep(self.config.after_s)
        raise RuntimeError(f"{self.config.message} (pid {os.getpid()})")
