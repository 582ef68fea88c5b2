"""How a reward function is called, and what it may return: Laminar's, verl's and TRL's conventions.

The reward worker (:mod:`laminar.roles.data.reward_worker`) scores a batch of trajectories with
:class:`Scorer`: it calls each configured function by its convention (the data role chose it at
load: :mod:`laminar.reward_kinds`) and turns what came back into a reward, numeric extras, or the
reason there is neither. Standard library only: the worker imports it before any user code. The
user's guide is ``docs/rewards.md``.

Conventions (``kind``):

* ``laminar``: ``reward(record, response)``, one call per trajectory.
* ``verl``: ``compute_score(data_source=, solution_str=, ground_truth=, extra_info=)`` from the
  record's ``data_source``, ``reward_model.ground_truth`` (or a top-level ``ground_truth``) and
  ``extra_info``, by keyword as verl's reward managers pass them; one call per trajectory.
* ``trl``: ``reward_func(prompts=, completions=, completion_ids=, <every other record field as a
  list>, trainer_state=, log_extra=, log_metric=) -> list``, one call per batch, as TRL's
  GRPOTrainer makes it; ``None`` in the list means "no reward for this one".

A function gets the arguments of its convention that it declares (all of them when it takes
``**kwargs``), so a verl function without ``extra_info`` or a TRL function naming only the columns
it reads works as under its own trainer. Any function may be ``async def``: sync calls run first,
outside any event loop (a sync reward may call ``asyncio.run`` itself), then everything left to
await runs concurrently.

A result is a number (:func:`as_reward`: finite, not a bool) or a dict holding one under ``score``
(verl's key) or ``reward``; the dict's other numeric fields (bools as 0/1) are *extras*, logged
per version by the trainer; other fields (verl's ``pred`` text) are not numbers and are left out.
With several functions the reward is their weighted sum (TRL's ``reward_funcs`` and
``reward_weights``): a function that returns None for a trajectory is left out of the sum (TRL's
``nansum``), one that fails fails the trajectory; each function's own score is an extra under its
name, and its extras are under ``<name>/<field>``.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import numbers
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from .reward_kinds import accepted, signature

#: Record fields TRL does not pass as columns (its own arguments, or shadowed by them).
TRL_RESERVED = frozenset(
    {"prompt", "completion", "completion_ids"}
    | {"prompts", "completions", "trainer_state", "log_extra", "log_metric"}
)

#: The reason recorded for a trajectory every reward function declined (returned ``None`` for:
#: TRL's "not applicable"). Not a failure: the data role does not warn about it.
DECLINED = "every reward function returned None for it (no reward)"
MAX_ERROR = 2000  # characters of an error kept
MAX_EXTRAS = 16  # numeric extras kept per function and trajectory
#: What an extra's (and a function's) name may be: a metric name in every tracker.
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,63}")


def as_reward(value: Any) -> tuple[float | None, str | None]:
    """A reward function's result as a float, or why it is not one.

    Accepted: any real number (``int``, ``float``, ``fractions.Fraction``, NumPy's integer and
    floating scalars) and any 0-dimensional array with ``.item()`` (a NumPy 0-d array, a PyTorch
    scalar tensor), if finite. Refused: bools (``True``, ``numpy.bool_``), which are more often a
    forgotten comparison than a score: return ``float(correct)`` to mean 1.0 / 0.0."""
    value = _scalar(value)
    shown = repr(value)
    shown = shown if len(shown) <= 200 else shown[:200] + "..."
    if isinstance(value, bool):
        return None, f"returned {shown}, a bool, not a number (return float(...) to score it)"
    if not isinstance(value, numbers.Real):
        return None, f"returned {shown}, not a number"
    try:
        number = float(value)
    except (OverflowError, ValueError):
        number = math.inf
    if not math.isfinite(number):
        return None, f"returned {shown}, not a finite number"
    return number, None


def _scalar(value: Any) -> Any:
    """A 0-d array or tensor as its Python value; anything else as it is."""
    if not isinstance(value, (int, float)) and getattr(value, "shape", None) == ():
        item = getattr(value, "item", None)
        if callable(item):
            return item()
    return value


def _metric(value: Any) -> float | None:
    """An extra field as a number to log: finite reals and bools (an ``acc`` flag averages to
    an accuracy); None for anything else (text, lists, NaN), which is not logged."""
    value = _scalar(value)
    if not isinstance(value, numbers.Real):
        return None
    try:
        number = float(value)
    except (OverflowError, ValueError):
        return None
    return number if math.isfinite(number) else None


@dataclass(frozen=True)
class Item:
    """One trajectory to score: its dataset record, the response text, its token ids (sent for
    TRL functions only) and the weight version that generated it."""

    record: dict[str, Any]
    response: str
    ids: list[int] = field(default_factory=list)
    version: int = 0


@dataclass(frozen=True)
class Function:
    fn: Callable[..., Any]
    kind: str
    name: str
    weight: float = 1.0

    @property
    def sig(self) -> inspect.Signature | None:
        return signature(self.fn)


@dataclass(frozen=True)
class Outcome:
    """One function's word on one trajectory: a score, or the reason there is none; neither:
    it declined (returned None under TRL's convention)."""

    score: float | None = None
    error: str | None = None
    extras: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Result:
    """One trajectory's reward (the weighted sum), or why there is none, and its extras."""

    reward: float | None
    error: str | None
    extras: dict[str, float] = field(default_factory=dict)


def raised(exc: BaseException) -> str:
    return clip(f"raised {type(exc).__name__}: {exc}")


def clip(text: str, limit: int = MAX_ERROR) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def lookup(record: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """``record[key]`` (a column whose name holds a dot), or the value at a dotted path into
    nested objects (``extra_info.question``); ``default`` if there is none."""
    if key in record:
        return record[key]
    value: Any = record
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return default
        value = value[part]
    return value


def is_messages(prompt: Any) -> bool:
    """A conversational prompt (TRL's test): a list of ``{"role": ..., ...}`` messages."""
    return (
        isinstance(prompt, list)
        and bool(prompt)
        and isinstance(prompt[0], dict)
        and "role" in prompt[0]
    )


class MissingField(Exception):
    """The record lacks what the function's convention passes (its message is the reason)."""


class _Call:
    """One call of function number ``index``: for one trajectory, or for a whole batch (TRL)."""

    def __init__(self, index: int, function: Function, items: list[int]) -> None:
        self.index, self.function, self.items = index, function, items
        self.value: Any = None
        self.error: str | None = None
        self.metrics: dict[str, float] = {}  # TRL's log_metric(name, value) during the call

    def start(self, thunk: Callable[[], Any]) -> None:
        try:
            self.value = thunk()
        except MissingField as exc:
            self.error = str(exc)
        except Exception as exc:
            self.error = raised(exc)


class Scorer:
    """Calls the configured functions on a batch of items and combines what they return.

    ``warn`` gets a line once per problem that costs no reward but loses an extra (a field name
    that is no metric name, more fields than :data:`MAX_EXTRAS`)."""

    def __init__(
        self,
        functions: Sequence[Function],
        kwargs: Mapping[str, Any] | None = None,
        prompt_key: str = "prompt",
        warn: Callable[[str], None] | None = None,
    ) -> None:
        self.functions = list(functions)
        self.kwargs = dict(kwargs or {})
        self.prompt_key = prompt_key
        self._warn = warn or (lambda line: print(line, file=sys.stderr, flush=True))
        self._warned: set[tuple[str, str]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sigs = [f.sig for f in self.functions]

    def score(self, items: Sequence[Item]) -> list[Result]:
        calls: list[_Call] = []
        for index, (function, sig) in enumerate(zip(self.functions, self._sigs, strict=True)):
            if function.kind == "trl":
                call = _Call(index, function, list(range(len(items))))
                call.start(functools.partial(self._trl_call, function, sig, items, call))
                calls.append(call)
                continue
            for i, item in enumerate(items):
                call = _Call(index, function, [i])
                call.start(functools.partial(self._single, function, sig, item))
                calls.append(call)
        # Sync functions ran above, outside any event loop (one may call asyncio.run itself);
        # what they left to await runs now, all of it concurrently.
        pending = [c for c in calls if c.error is None and inspect.isawaitable(c.value)]
        if pending:
            self._await(pending)
        outcomes = [[Outcome()] * len(items) for _ in self.functions]  # [function][item]
        for call in calls:
            for i, outcome in zip(call.items, self._read(call, len(call.items)), strict=True):
                outcomes[call.index][i] = outcome
        return [self._combine([row[i] for row in outcomes]) for i in range(len(items))]

    def close(self) -> None:
        """Close the event loop async rewards ran on (if any ran)."""
        if self._loop is not None:
            self._loop.close()
            self._loop = None

    def _single(self, f: Function, sig: inspect.Signature | None, item: Item) -> Any:
        if f.kind == "laminar":
            return f.fn(item.record, item.response, **accepted(sig, self.kwargs))
        record = item.record
        extra = record.get("extra_info")
        passed = {
            "data_source": record.get("data_source"),
            "solution_str": item.response,
            "extra_info": dict(extra) if isinstance(extra, dict) else {},  # verl's default: {}
            **self.kwargs,
        }
        if "ground_truth" in accepted(sig, {"ground_truth": None}):
            passed["ground_truth"] = _ground_truth(record)
        return f.fn(**accepted(sig, passed))

    def _trl_call(
        self, function: Function, sig: inspect.Signature | None, items: Sequence[Item], call: _Call
    ) -> Any:
        return function.fn(**self._trl(sig, items, call))

    def _trl(self, sig: inspect.Signature | None, items: Sequence[Item], call: _Call) -> Any:
        records = [item.record for item in items]
        prompts = [lookup(r, self.prompt_key) for r in records]
        columns: dict[str, list[Any]] = {}
        for r in records:
            for key in r:
                if key not in TRL_RESERVED and key not in columns:
                    columns[key] = [other.get(key) for other in records]

        def log_metric(name: str, value: float) -> None:
            call.metrics[str(name)] = value

        def log_extra(column: str, values: list[Any]) -> None:
            """TRL's completions-table column: there is no such table here."""

        completions = [  # conversational prompts get message completions, as TRL makes them
            [{"role": "assistant", "content": item.response}] if is_messages(p) else item.response
            for item, p in zip(items, prompts, strict=True)
        ]
        passed = {
            **columns,
            "prompts": prompts,
            "completions": completions,
            "completion_ids": [item.ids for item in items],
            "trainer_state": SimpleNamespace(global_step=max(item.version for item in items)),
            "log_extra": log_extra,
            "log_metric": log_metric,
            **self.kwargs,
        }
        return accepted(sig, passed)

    def _await(self, pending: list[_Call]) -> None:
        async def gather() -> list[Any]:
            return await asyncio.gather(*(c.value for c in pending), return_exceptions=True)

        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        for call, value in zip(pending, self._loop.run_until_complete(gather()), strict=True):
            if isinstance(value, BaseException):
                call.value, call.error = None, raised(value)
            else:
                call.value = value

    def _read(self, call: _Call, n: int) -> list[Outcome]:
        """The call's result as one outcome per item it scored."""
        if call.error is not None:
            return [Outcome(error=call.error)] * n
        f = call.function
        if f.kind != "trl":
            return [self._outcome(f, call.value)]
        values = call.value
        if isinstance(values, (str, bytes, Mapping)) or not hasattr(values, "__len__"):
            shown = clip(repr(values), 200)
            return [Outcome(error=f"returned {shown}, not a list of one reward per completion")] * n
        try:
            values = [values[i] for i in range(len(values))]
        except (TypeError, IndexError, KeyError) as exc:
            return [Outcome(error=f"returned a {type(values).__name__} that is no list: {exc}")] * n
        if len(values) != n:
            return [Outcome(error=f"returned {len(values)} rewards for {n} completions")] * n
        logged = self._extras(f, call.metrics.items())
        out = []
        for value in values:
            o = self._outcome(f, value)
            out.append(Outcome(o.score, o.error, {**logged, **o.extras}) if logged else o)
        return out

    def _outcome(self, f: Function, value: Any) -> Outcome:
        extras: dict[str, float] = {}
        where = ""
        if isinstance(value, Mapping):
            keys = [k for k in ("score", "reward") if k in value]
            if len(keys) != 1:
                what = "both 'score' and 'reward'" if keys else "no 'score' (verl's) or 'reward'"
                return Outcome(error=f"returned a dict with {what} field")
            where = f" (its {keys[0]!r})"
            extras = self._extras(f, ((k, v) for k, v in value.items() if k != keys[0]))
            value = value[keys[0]]
        if value is None and f.kind == "trl":
            return Outcome(extras=extras)  # declined: no reward from this function
        score, error = as_reward(value)
        if error is not None:
            return Outcome(error=clip(error + where))
        return Outcome(score, None, extras)

    def _extras(self, f: Function, fields: Iterable[tuple[Any, Any]]) -> dict[str, float]:
        out: dict[str, float] = {}
        for key, value in fields:
            number = _metric(value)
            if number is None:  # text, lists, None, NaN: kept out of the numbers logged
                continue
            if not isinstance(key, str) or NAME.fullmatch(key) is None:
                self._warn_once(f, repr(key), "is not a metric name (letters, digits, _ . -)")
            elif len(out) >= MAX_EXTRAS:
                self._warn_once(f, key, f"is past the first {MAX_EXTRAS} numeric fields")
            else:
                out[key] = number
        return out

    def _warn_once(self, f: Function, key: str, why: str) -> None:
        if (f.name, key) not in self._warned and len(self._warned) < 256:
            self._warned.add((f.name, key))
            self._warn(f"reward {f.name}: extra field {clip(key, 80)} {why}: not logged")

    def _combine(self, outcomes: list[Outcome]) -> Result:
        if len(self.functions) == 1:
            (o,) = outcomes
            if o.score is None:
                return Result(None, o.error or DECLINED, {})
            return Result(self.functions[0].weight * o.score, None, o.extras)
        named = zip(self.functions, outcomes, strict=True)
        failed = [f"{f.name}: {o.error}" for f, o in named if o.error]
        if failed:
            return Result(None, clip("; ".join(failed)), {})
        total, scored, extras = 0.0, False, {}
        for f, o in zip(self.functions, outcomes, strict=True):
            if o.score is None:  # declined: left out of the sum (TRL's nansum)
                continue
            total, scored = total + f.weight * o.score, True
            extras[f.name] = o.score
            extras.update({f"{f.name}/{k}": v for k, v in o.extras.items()})
        if not scored:
            return Result(None, DECLINED, {})
        if not math.isfinite(total):
            return Result(None, f"the weighted sum of the rewards is {total}, not finite", {})
        return Result(total, None, extras)


def _ground_truth(record: Mapping[str, Any]) -> Any:
    """verl's ``reward_model.ground_truth``, or a top-level ``ground_truth`` field."""
    rm = record.get("reward_model")
    if isinstance(rm, Mapping) and "ground_truth" in rm:
        return rm["ground_truth"]
    if "ground_truth" in record:
        return record["ground_truth"]
    raise MissingField(
        "the record has neither reward_model.ground_truth (verl's layout) nor a ground_truth "
        "field for the verl reward's ground_truth"
    )
