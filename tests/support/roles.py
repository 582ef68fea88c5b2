"""Services used by the tests (also started as real processes via ``--role FILE:Class``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import ClassVar

from pydantic import BaseModel, Field

from laminar.runtime.endpoint import endpoint, stream
from laminar.runtime.service import Service
from laminar.transport import Blob


class Pair(BaseModel):
    a: int
    b: int


class Sum(BaseModel):
    value: int


class Sleep(BaseModel):
    seconds: float = Field(ge=0)
    tag: str = ""


class Tag(BaseModel):
    tag: str


class Tags(BaseModel):
    tags: list[str]


class Upto(BaseModel):
    n: int = Field(ge=0)
    fail_at: int | None = None


class Item(BaseModel):
    i: int


class Payload(BaseModel):
    name: str
    data: Blob
    extra: list[Blob] = Field(default_factory=list)


class Digest(BaseModel):
    name: str
    sizes: list[int]
    checksum: int


class Calculator(Service):
    role: ClassVar[str] = "calculator"

    def __init__(self, ctx):  # type: ignore[no-untyped-def]
        super().__init__(ctx)
        self.started: list[str] = []
        self.cancelled: list[str] = []
        self.finished: list[str] = []
        self.notes: list[str] = []

    @endpoint
    async def add(self, req: Pair) -> Sum:
        return Sum(value=req.a + req.b)

    @endpoint
    async def sleep(self, req: Sleep) -> Tag:
        self.started.append(req.tag)
        try:
            await asyncio.sleep(req.seconds)
        except asyncio.CancelledError:
            self.cancelled.append(req.tag)
            raise
        self.finished.append(req.tag)
        return Tag(tag=req.tag)

    @endpoint
    async def fail(self, req: Tag) -> Tag:
        raise ValueError(f"refusing {req.tag!r}")

    @endpoint
    async def note(self, req: Tag) -> None:
        self.notes.append(req.tag)

    @endpoint
    async def history(self) -> Tags:
        return Tags(
            tags=[
                *(f"started:{t}" for t in self.started),
                *(f"cancelled:{t}" for t in self.cancelled),
                *(f"finished:{t}" for t in self.finished),
                *(f"note:{t}" for t in self.notes),
            ]
        )

    @stream
    async def count(self, req: Upto) -> AsyncIterator[Item]:
        for i in range(req.n):
            if req.fail_at is not None and i == req.fail_at:
                raise RuntimeError(f"stream broke at {i}")
            yield Item(i=i)

    @stream
    async def stall(self, req: Sleep) -> AsyncIterator[Item]:
        yield Item(i=0)
        await self.sleep(req)  # records started / cancelled like the sleep endpoint
        yield Item(i=1)

    @endpoint
    async def digest(self, req: Payload) -> Digest:
        blobs = [req.data, *req.extra]
        checksum = 0
        for blob in blobs:
            checksum = (checksum * 31 + sum(blob.view[::4096])) % (1 << 61)
        return Digest(name=req.name, sizes=[b.nbytes for b in blobs], checksum=checksum)

    @endpoint
    async def mirror(self, req: Payload) -> Payload:
        return req


class SlowStarter(Service):
    """A role whose start blocks its event loop, as a rollout's vLLM engine start does (vLLM
    polls its engine's handshake socket in Python): at most a minute, in short waits, under
    ``signals_end_the_start``. Says ``blocking start`` on stdout first."""

    role: ClassVar[str] = "slow-starter"

    async def on_start(self) -> None:
        import sys
        import time

        from laminar.runtime.service import signals_end_the_start

        with signals_end_the_start():
            print("blocking start", flush=True)
            for _ in range(600):
                time.sleep(0.1)  # noqa: ASYNC251 - blocking the loop is the point
        sys.exit("the start was never interrupted")
