"""A role that starts a process of its own and leaves it running, the way a vLLM rollout starts
its engine core: the child inherits the role's stdout and stderr (so it holds the supervisor's
pipes open after the role dies), is never stopped by the role, and sets its process title as
vLLM's engine core does (``setproctitle``, which wipes ``/proc/<pid>/environ`` unless
``SPT_NOENV`` is set). With ``stubborn`` it ignores SIGTERM as well, so only SIGKILL ends it; with
``own_group`` it leads a process group of its own, as a data role's reward worker does; with
``block_s`` the role blocks its own event loop once (``laminar.runtime.loopwatch`` must say so).
Used by ``tests/integration/test_orphans.py``.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from typing import ClassVar

from pydantic import Field

from laminar.runtime.config import ServiceConfig
from laminar.runtime.service import Service

CHILD = """
import signal, sys, time
try:
    import setproctitle  # installed with vLLM
    setproctitle.setproctitle("spawner-child")
except ImportError:
    pass
if sys.argv[1] == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("spawner child up", flush=True)
time.sleep(3600)
"""


class SpawnerConfig(ServiceConfig):
    stubborn: bool = Field(False, description="The child ignores SIGTERM.")
    own_group: bool = Field(False, description="The child leaves the role's process group.")
    block_s: float = Field(0.0, description="Once, a second after starting: block the loop.")


class SpawnerService(Service):
    role: ClassVar[str] = "spawner"
    config_model: ClassVar[type[ServiceConfig]] = SpawnerConfig

    async def on_start(self) -> None:
        mode = "stubborn" if self.config.stubborn else "plain"  # type: ignore[attr-defined]
        # stdout and stderr inherited: the supervisor's pipes
        own = self.config.own_group  # type: ignore[attr-defined]
        self.child = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            CHILD,
            mode,
            preexec_fn=(lambda: os.setpgid(0, 0)) if own else None,
        )

        if self.config.block_s:  # type: ignore[attr-defined]
            self.spawn(self.block_once(self.config.block_s), name="block")  # type: ignore[attr-defined]

    async def block_once(self, seconds: float) -> None:
        await asyncio.sleep(1.0)  # the role is ready by then: `laminar serve` watches its loop
        time.sleep(seconds)  # noqa: ASYNC251 - what an environment or reward hook must not do

    def stats(self) -> dict[str, float]:
        return {"child_pid": float(self.child.pid)}
