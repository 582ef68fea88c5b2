"""Environments for the multi-turn tests (``laminar.tools.env``), on the test tokenizer's alphabet.

:class:`CountingEnv` answers the k-th tool call (a turn ending at ``#``) with ``=k`` and a newline,
after a latency drawn from the action's hash (long-tailed, deterministic: the replay rule), and
rewards each action 1: so a finished trajectory's reward is its number of actions, and its k-th
observation must read ``=k``, however often it moved between rollouts or the data role restarted.
"""

from __future__ import annotations

import asyncio
import zlib
from typing import Any

from laminar.tools.env import Environment, Step


class CountingEnv(Environment):
    stop = ("#",)

    async def reset(self, record: dict[str, Any]) -> None:
        self.calls = 0

    async def step(self, action: str) -> Step:
        u = (zlib.crc32(action.encode()) % 1000 + 0.5) / 1000
        await asyncio.sleep(0.05 / (1.0 - u) ** 0.5)  # 0.05 s to ~1.6 s: a long tail
        if not action.endswith("#"):  # the model's last turn
            return Step(reward=1.0, done=True)
        self.calls += 1
        return Step(observation=f"={self.calls}\n", reward=1.0)


class FailingEnv(CountingEnv):
    """Raises on its second tool call: the episode ends there, without a reward."""

    async def step(self, action: str) -> Step:
        if self.calls == 1:
            raise RuntimeError("the tool broke")
        return await super().step(action)
