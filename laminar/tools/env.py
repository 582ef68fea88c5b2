"""The environment contract of a multi-turn task, and the pure bookkeeping of an episode's turns.

A task is either single-turn (a prompt and ``reward(record, response)``) or an *episode*: the
model and an environment take turns. The task names an :class:`Environment` subclass
(``data.env.spec``); the data role makes one instance per episode, when its first model turn ends
(so a queued sample costs no environment), and calls::

    await env.reset(record)          # the episode's record (its prompt, text or chat messages,
                                     # is at data.prompt_key)
    step = await env.step(action)    # the model's turn as text -> Step(observation, reward, done)

A model turn ends where the model writes one of the environment's ``stop`` strings (a tool call,
say; each must be one token of the model's tokenizer) or where generation ends (EOS, the token
budget, the context). Every model turn is an action: the ones that end at a stop string are
stepped as soon as they end, and the observation's tokens are appended to the response (read as
context, never trained on: ``Trajectory.env_spans``); the last one is stepped when the trajectory
completes. With a chat template in use, those tokens are the template's next turn (the rest of
the assistant's turn, the observation as a user or tool message, the generation prompt), and a
stop string may be the template's end-of-turn token; without one, the observation's text as it is
(``docs/data.md``). The episode's reward is the sum of its steps' rewards up to the step that said
``done`` (the episode also ends after ``max_turns`` actions).

Why the environment runs in the data role, not in the rollout: the episode's state must outlive
the rollout generating it (a rollout killed mid-episode hands its trajectory to another, on the
same weights version, from the tokens the data role has), and the data role already holds the
records and the tokenizer. A rollout's engine never waits: while an episode waits for its step,
the engine decodes the others.

Two rules an environment must keep, because of that durability:

* **Replayable**: ``reset`` and ``step`` are deterministic functions of the record and the actions
  so far. The data role may lose an episode's live object (it restarted) and rebuild it by
  replaying the episode's earlier actions; the observations already in the response are kept.
* **Async and bounded**: ``step`` runs on the data role's event loop under ``step_timeout_s``;
  blocking work belongs in a subprocess (untrusted code: :func:`laminar.tools.sandbox.run_python`)
  or a thread. A step that raises or times out ends the episode, with the reason recorded as the
  trajectory's reward error (it gets no reward); nothing else is affected.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from laminar.plugins import load_object
from laminar.runtime.errors import ConfigError

Span = tuple[int, int]


@dataclass(frozen=True, slots=True)
class Step:
    """What the environment answers to one action."""

    observation: str = ""  # appended to the response (context for the model's next turn)
    reward: float = 0.0  # added to the episode's reward
    done: bool = False  # the episode is over (the observation is then discarded)


class Environment(abc.ABC):
    """One episode's environment (a new instance per episode); see the module docstring."""

    #: Strings that end a model turn (tool calls). Each must be a single token.
    stop: ClassVar[tuple[str, ...]] = ()

    async def reset(self, record: dict[str, Any]) -> None:  # noqa: B027 - optional hook
        """Start an episode on ``record`` (the prompt is already the model's context)."""

    @abc.abstractmethod
    async def step(self, action: str) -> Step:
        """The model's turn ``action`` (its text, the stop string included unless it is a
        special token, such as a chat template's end of turn)."""


def load_environment(spec: str) -> type[Environment]:
    """The :class:`Environment` subclass named ``module:Class`` or ``path.py:Class``."""
    cls = load_object(spec, what="environment")
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ConfigError(f"environment {spec!r} is not a laminar.tools.env.Environment subclass")
    if isinstance(cls.stop, str) or not all(isinstance(s, str) and s for s in cls.stop):
        raise ConfigError(f"environment {spec!r}: stop must be a tuple of non-empty strings")
    return cls


def model_spans(length: int, env_spans: Sequence[Span]) -> list[Span]:
    """The model's turns of a response of ``length`` tokens: the gaps between the environment's
    spans (an empty gap, an observation right after the prompt, is not a turn)."""
    out, at = [], 0
    for start, end in env_spans:
        if start > at:
            out.append((at, start))
        at = end
    if length > at:
        out.append((at, length))
    return out


def awaits_step(tokens: Sequence[int], env_spans: Sequence[Span], stop_ids: frozenset[int]) -> bool:
    """Whether a response ends with a model turn that stopped at a stop token and has no
    observation yet (a resumed episode whose step is still owed)."""
    if not tokens or tokens[-1] not in stop_ids:
        return False
    return not env_spans or env_spans[-1][1] < len(tokens)


def add_span(env_spans: list[Span], start: int, end: int) -> None:
    """Record the environment's tokens ``[start, end)``, merged with an adjacent last span."""
    if end <= start:
        return
    if env_spans and env_spans[-1][1] == start:
        env_spans[-1] = (env_spans[-1][0], end)
    else:
        env_spans.append((start, end))


def spans_within(env_spans: Sequence[Span], start: int, end: int) -> list[Span]:
    """The parts of ``env_spans`` inside ``[start, end)`` (a report chunk's share of them)."""
    return [(max(a, start), min(b, end)) for a, b in env_spans if a < end and b > start]
