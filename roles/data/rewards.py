"""Reward functions as plug-ins, run in worker processes with a hard timeout and cut-down rights.

A task's reward is a function named as ``module:function`` (importable) or
``path/to/file.py:function``, in one of three conventions: Laminar's ``reward(record, response)``,
verl's ``compute_score(data_source, solution_str, ground_truth, extra_info)`` or TRL's batched
``reward_func(completions, **columns) -> list``; several may be combined with weights. The pool
loads each one here first, so a missing or unusable function fails the role's start with a clear
error, and settles its convention (:mod:`laminar.reward_kinds`: ``auto`` reads the parameters);
the workers are told the kind (:mod:`laminar.reward_calls` calls it). A batched function (TRL's,
or any ``async def``) gets up to ``batch`` trajectories per call; the others one. The user's
guide is ``docs/rewards.md``.

The workers are separate processes with cut-down rights (:mod:`.reward_workers`): a reward
that raises, hangs, forks or leaks costs its trajectory's reward and a worker, never the role.
Outcomes are values, never exceptions: :class:`RewardResult` has either a reward or the reason
there is none ("raised ValueError: ...", "timed out after 5.0s", "returned 'abc', not a number",
"worker died (exit -9)"), and the numeric extras of a dict result. The data role records them
beside the trajectory. Rewards may be NumPy (or 0-d tensor) scalars; bools are refused (see
:func:`laminar.reward_calls.as_reward`). A record that is not JSON fails its trajectory alone;
the rest of its batch is scored.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field

from laminar.plugins import load_object
from laminar.reward_calls import NAME
from laminar.reward_kinds import detect_kind, is_async
from laminar.runtime.config import Strict
from laminar.runtime.errors import ConfigError
from laminar.runtime.executor import LOOP_DEFAULT, Executor

from .reward_workers import (
    RewardResult,
    RewardSandbox,
    RewardWorker,
    WorkerFailed,
    exit_text,
)

__all__ = [
    "RewardFunction",
    "RewardItem",
    "RewardKind",
    "RewardPool",
    "RewardResult",
    "RewardSandbox",
    "load_function",
]

RewardKind = Literal["auto", "laminar", "verl", "trl"]


class RewardFunction(Strict):
    """One of several reward functions: the reward is their weighted sum."""

    function: str = Field(description="module:function or file.py:function.")
    weight: Annotated[float, Field(allow_inf_nan=False)] = Field(
        1.0, description="Its weight in the sum (TRL's reward_weights)."
    )
    kind: RewardKind | None = Field(
        None, description="Its convention (see data.reward_kind); null: data.reward_kind."
    )
    name: Annotated[str, Field(pattern=f"^{NAME.pattern}$")] | None = Field(
        None,
        description="What its score is logged as (`reward/<name>`, its extras "
        "`reward/<name>/<field>`); null: the function's name. Unique.",
    )


@dataclass(frozen=True, slots=True)
class RewardItem:
    """One trajectory to score: its record, the response text, its token ids (TRL's
    ``completion_ids``) and the version that generated it (TRL's ``trainer_state.global_step``)."""

    record: Mapping[str, Any]
    response: str
    token_ids: Sequence[int] = ()
    version: int = 0


def load_function(spec: str) -> Callable[..., Any]:
    """Resolve ``module:function`` or ``path.py:function`` (relative to the working directory)."""
    fn = load_object(spec, what="reward")
    if not callable(fn):
        raise ConfigError(f"reward {spec!r} is not a function")
    return fn


class RewardPool:
    """Workers scoring trajectories with the reward function(s) named by ``spec``: one
    ``module:function`` (its convention ``kind``, ``auto``: from its parameters), or several
    :class:`RewardFunction` whose weighted sum is the reward. ``batch``: the most trajectories
    per call of a batched function (TRL's, or ``async def``); ``kwargs``: passed to every call
    (verl's ``reward_kwargs``); ``prompt_key``: the record field TRL's ``prompts`` come from."""

    def __init__(
        self,
        spec: str | Sequence[RewardFunction],
        *,
        kind: RewardKind = "auto",
        batch: int = 16,
        kwargs: Mapping[str, Any] | None = None,
        prompt_key: str = "prompt",
        workers: int = 1,
        timeout_s: float = 10.0,
        sandbox: RewardSandbox | None = None,
        token_env: str = "LAMINAR_TOKEN",
        executor: Executor = LOOP_DEFAULT,
    ) -> None:
        functions = [RewardFunction(function=spec)] if isinstance(spec, str) else list(spec)
        kwargs = dict(kwargs or {})
        try:
            json.dumps(kwargs, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"data.reward_kwargs must be JSON values: {exc}") from None
        self.functions = [self._settle(f, kind, kwargs) for f in functions]  # fail fast, here
        names = [f["name"] for f in self.functions]
        if len(set(names)) != len(names):
            raise ConfigError(
                f"reward functions {names}: each needs a name of its own (set `name`): their "
                "scores are logged under it"
            )
        batched = any(f["kind"] == "trl" or f["async"] for f in self.functions)
        self.batch_size = batch if batched else 1
        self._ids = any(f["kind"] == "trl" for f in self.functions)  # TRL's completion_ids
        self._scoring = {
            "functions": [
                {k: f[k] for k in ("spec", "kind", "name", "weight")} for f in self.functions
            ],
            "kwargs": kwargs,
            "prompt_key": prompt_key,
        }
        self.timeout_s = timeout_s
        self.sandbox = sandbox or RewardSandbox()
        self.token_env = token_env
        self.executor = executor  # where ended workers are reaped (the data role's, or the loop's)
        self._idle: asyncio.Queue[RewardWorker] = asyncio.Queue()
        self._all: set[RewardWorker] = set()
        self._ending: set[asyncio.Future[int | None]] = set()  # workers being finished
        self._closed = False
        for _ in range(workers):
            self._add_worker()

    @staticmethod
    def _settle(f: RewardFunction, kind: str, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """Load ``f`` here (a missing or unusable function fails the start, naming it) and
        settle its convention and name."""
        fn = load_function(f.function)
        name = f.name or f.function.rpartition(":")[2]
        if NAME.fullmatch(name) is None:
            raise ConfigError(f"reward {f.function}: {name!r} is not a metric name; set `name`")
        return {
            "spec": f.function,
            "kind": detect_kind(fn, f.function, f.kind or kind, kwargs),
            "name": name,
            "weight": f.weight,
            "async": is_async(fn),
        }

    def _add_worker(self) -> None:
        if self._closed:  # a call that ends after close() replaces nothing
            return
        worker = RewardWorker(self._scoring, self.sandbox, self.token_env, self.executor)
        self._all.add(worker)
        self._idle.put_nowait(worker)

    def _retire(self, worker: RewardWorker, died: bool = False) -> asyncio.Future[int | None]:
        """Replace ``worker`` now and end it (:meth:`RewardWorker.end`)."""
        self._all.discard(worker)
        ending = worker.end(died)
        self._ending.add(ending)
        ending.add_done_callback(self._ending.discard)
        self._add_worker()
        return ending

    async def score(self, record: Mapping[str, Any], response: str) -> RewardResult:
        (result,) = await self.score_batch([RewardItem(record, response)])
        return result

    async def score_batch(self, items: Sequence[RewardItem]) -> list[RewardResult]:
        """A result per item, in order: calls of at most :attr:`batch_size` items each; an item
        whose record is not JSON gets its reason without holding up the others."""
        results: list[RewardResult | None] = [None] * len(items)
        sendable: list[tuple[int, bytes]] = []
        for i, item in enumerate(items):
            job = {
                "record": item.record,
                "response": item.response,
                "ids": list(item.token_ids) if self._ids else [],
                "version": item.version,
            }
            try:
                sendable.append((i, json.dumps(job, allow_nan=False).encode()))
            except (TypeError, ValueError) as exc:
                why = f"the record cannot be sent to the reward (not JSON: {exc})"
                results[i] = RewardResult(None, why)
        for start in range(0, len(sendable), self.batch_size):
            chunk = sendable[start : start + self.batch_size]
            got = await self._call([line for _, line in chunk])
            for (i, _), result in zip(chunk, got, strict=True):
                results[i] = result
        done = [r for r in results if r is not None]
        assert len(done) == len(items)  # every item sent or refused, each chunk answered whole
        return done

    async def _call(self, lines: list[bytes]) -> list[RewardResult]:
        """One job of ``lines`` (JSON items) on an idle worker."""
        n = len(lines)
        payload = b'{"items": [' + b", ".join(lines) + b"]}\n"
        worker = await self._idle.get()
        try:
            await worker.start()
            async with asyncio.timeout(self.timeout_s):
                results, cpu = await worker.call(payload, n)
        except TimeoutError:
            await self._retire(worker)  # returns once nothing of it is left
            batch = f" (one call for a batch of {n})" if n > 1 else ""
            return [RewardResult(None, f"timed out after {self.timeout_s}s{batch}")] * n
        except WorkerFailed as exc:
            code = await self._retire(worker, died=exc.died)
            return [RewardResult(None, exit_text(code) if exc.died else str(exc))] * n
        except BaseException:  # cancelled: the job may still run, this worker is not reusable
            self._retire(worker)
            raise
        limit = self.sandbox.cpu_s
        if limit is not None and cpu >= limit / 2:  # so the next call has at least half of it
            self._retire(worker)
        else:
            self._idle.put_nowait(worker)
        return results

    async def close(self) -> None:
        self._closed = True
        workers, self._all = list(self._all), set()
        ends = [w.end() for w in workers]  # stateless: nothing to finish first
        await asyncio.gather(*ends, *self._ending, return_exceptions=True)
