"""A role in twenty lines: typed endpoints, an owned background task, heartbeat stats.

Start it alone with ``laminar serve --role examples/hello/echo.py:EchoService --join ADDR``, or
with the whole example: ``laminar run examples/hello/config.yaml``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import ClassVar

from pydantic import BaseModel, Field

from laminar.runtime.config import ServiceConfig
from laminar.runtime.endpoint import endpoint, stream
from laminar.runtime.service import Service


class EchoConfig(ServiceConfig):
    tick_s: float = Field(1.0, gt=0, description="How often the background counter ticks.")


class Text(BaseModel):
    text: str


class Count(BaseModel):
    upto: int = Field(3, ge=0, le=10_000)


class Number(BaseModel):
    n: int


class EchoService(Service):
    role: ClassVar[str] = "echo"
    config_model: ClassVar[type[ServiceConfig]] = EchoConfig

    async def on_start(self) -> None:
        self.ticks = 0
        self.spawn(self._tick(), name="tick")  # owned: cancelled at stop, fatal if it raises

    async def _tick(self) -> None:
        while True:
            await self.ctx.clock.sleep(self.config.tick_s)  # type: ignore[attr-defined]
            self.ticks += 1

    def stats(self) -> dict[str, float]:
        return {"ticks": self.ticks}  # reaches the manager with every heartbeat

    @endpoint
    async def echo(self, req: Text) -> Text:
        return Text(text=req.text)

    @stream
    async def count(self, req: Count) -> AsyncIterator[Number]:
        for n in range(req.upto):
            yield Number(n=n)
