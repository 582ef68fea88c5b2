"""Greedy episodes of a multi-turn task in one process: the recipe's evaluator for agentic tasks.

A task module with an ``ENVIRONMENT`` (a :class:`laminar.tools.env.Environment` subclass) is
evaluated the way the cluster runs it (``roles/data/episodes.py``), turn by turn: generate greedily
until EOS, a stop token of the environment or the budget; a turn that ended at a stop token is
stepped and the observation appended, and generation goes on; the last turn is stepped too; the
episode's reward is the sum of its steps' rewards up to ``done`` (at most ``MAX_TURNS`` actions).

Batched like :func:`.evaluate.greedy_responses`: each round generates the next turn of every
episode still running, in batches sorted by context length. The environment's coroutines run on
a private event loop (the trainer calls this from a worker thread; the CLI from none).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from laminar.tools.env import Environment, Step

from .attention import fast_attention
from .tokenizer import EOS, PAD, special_id

DEFAULT_MAX_TURNS = 8
#: environment steps run concurrently: a sandboxed call is a fork of the jail server
#: (laminar.tools.jail), so most of a step is the tool's own latency, which overlaps: the more
#: at once, the more of it is hidden
STEPS_AT_ONCE = 32


class EvalStopped(Exception):
    """A greedy evaluation given up half-way because its ``stop`` said so (a trainer that is
    stopping does not make its operator wait for the rest of an evaluation nobody will read)."""


@runtime_checkable
class SharedStop(Protocol):
    """A ``stop`` that ranks evaluating in step share (``roles.trainer.wire.GroupStop``): asked
    at each decoding step it may end a ``generate`` call early on its own rank; whether the
    evaluation ends is decided by all of them together (``agreed``, between ``generate`` calls,
    where every rank asks the same number of times)."""

    def __call__(self) -> bool: ...

    def agreed(self) -> bool: ...


def check_stop(stop: Callable[[], bool] | None) -> None:
    """Raise :class:`EvalStopped` if ``stop`` says so (a :class:`SharedStop`: if its ranks agree
    it does). Asked between ``generate`` calls."""
    if stop is None:
        return
    if stop.agreed() if isinstance(stop, SharedStop) else stop():
        raise EvalStopped("the evaluation was stopped")


def stopping_criteria(stop: Callable[[], bool] | None) -> Any:
    """For ``generate``: end the call at its next decoding step once ``stop`` says so (one batch
    of greedy responses can take seconds on a loaded machine); None without a ``stop``.
    The caller then raises :class:`EvalStopped` (:func:`check_stop`): the rows are cut short."""
    if stop is None:
        return None
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    asked = stop  # narrowed: the class below closes over it

    class Stop(StoppingCriteria):
        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            return torch.full((input_ids.shape[0],), asked(), device=input_ids.device)

    return StoppingCriteriaList([Stop()])


@dataclass
class Episode:
    """One record's greedy episode."""

    prompt: list[int]
    env: Environment
    budget: int  # response tokens, the environment's included
    response: list[int] = field(default_factory=list)
    reward: float = 0.0
    calls: int = 0  # turns that ended at a stop token (tool calls)
    actions: int = 0
    done: bool = False
    error: str | None = None


def greedy_episodes(
    model: Any,
    tok: Any,
    env_class: type[Environment],
    records: list[dict[str, Any]],
    budgets: list[int],
    *,
    max_turns: int = DEFAULT_MAX_TURNS,
    batch_size: int = 32,
    synced: bool = False,
    stop: Callable[[], bool] | None = None,
) -> list[Episode]:
    """Every record's greedy episode (see the module docstring), in input order. ``stop``: asked
    at every decoding step; true raises :class:`EvalStopped`."""
    loop = asyncio.new_event_loop()
    try:
        return _run(
            model, tok, env_class, records, budgets, max_turns, batch_size, synced, loop, stop
        )
    finally:
        loop.close()


def _run(
    model: Any,
    tok: Any,
    env_class: type[Environment],
    records: list[dict[str, Any]],
    budgets: list[int],
    max_turns: int,
    batch_size: int,
    synced: bool,
    loop: asyncio.AbstractEventLoop,
    stop: Callable[[], bool] | None,
) -> list[Episode]:
    eos = special_id(tok, EOS)
    stops = [tok.encode(s, add_special_tokens=False).ids[0] for s in env_class.stop]

    def run(coro: Coroutine[Any, Any, Any]) -> Any:
        return loop.run_until_complete(coro)

    episodes = []
    for record, budget in zip(records, budgets, strict=True):
        env = env_class()
        run(env.reset(record))
        episodes.append(Episode(tok.encode(record["prompt"]).ids, env, budget))
    limit = int(model.config.max_position_embeddings)
    while running := [e for e in episodes if not e.done]:
        turns = _next_turns(model, tok, running, eos, stops, limit, batch_size, synced, stop)
        actions = []
        for episode, (tokens, _) in zip(running, turns, strict=True):
            episode.response += tokens
            episode.actions += 1
            actions.append(tok.decode(tokens))
        steps = run(_steps(running, actions))  # concurrently: a tool call may take a while
        for episode, (_, ended_at_stop), step in zip(running, turns, steps, strict=True):
            last = not ended_at_stop or episode.actions >= max_turns
            if step is None or step.done or last:
                episode.done = True
                continue
            episode.calls += 1
            observation = tok.encode(step.observation, add_special_tokens=False).ids
            episode.response += observation
            if len(episode.response) >= episode.budget or not observation:
                episode.done = True
    return episodes


async def _steps(episodes: list[Episode], actions: list[str]) -> list[Step | None]:
    slots = asyncio.Semaphore(STEPS_AT_ONCE)

    async def one(episode: Episode, action: str) -> Step | None:
        async with slots:
            try:
                step = await episode.env.step(action)
            except Exception as exc:  # the episode ends without a reward, as in the data role
                episode.error = f"environment step raised {type(exc).__name__}: {exc}"
                episode.reward = 0.0
                return None
        episode.reward += float(step.reward)
        return step

    return list(await asyncio.gather(*(one(e, a) for e, a in zip(episodes, actions, strict=True))))


def left_padded(rows: list[list[int]], pad: int) -> tuple[Any, Any]:
    """``input_ids`` and ``attention_mask`` of ``rows``, padded on the left (for ``generate``)."""
    import torch

    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    return ids, mask


def _next_turns(
    model: Any,
    tok: Any,
    episodes: list[Episode],
    eos: int,
    stops: list[int],
    limit: int,
    batch_size: int,
    synced: bool,
    stop: Callable[[], bool] | None = None,
) -> list[tuple[list[int], bool]]:
    """Each episode's next model turn: ``(tokens, ended at a stop token)``; EOS is dropped.
    ``stop``: see :func:`stopping_criteria`."""
    import torch

    pad = special_id(tok, PAD)
    contexts = [e.prompt + e.response for e in episodes]
    order = sorted(range(len(episodes)), key=lambda i: len(contexts[i]))
    out: list[tuple[list[int], bool]] = [([], False)] * len(episodes)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        ids, mask = left_padded([contexts[i] for i in idx], pad)
        width = ids.shape[1]
        room = max(episodes[i].budget - len(episodes[i].response) for i in idx)
        new = max(1, min(room, limit - width))
        with torch.inference_mode(), fast_attention(model):
            gen = model.generate(
                input_ids=ids.to(model.device),
                attention_mask=mask.to(model.device),
                max_new_tokens=new,
                do_sample=False,
                eos_token_id=[eos, *stops],
                pad_token_id=pad,
                synced_gpus=synced,
                stopping_criteria=stopping_criteria(stop),
            )
        check_stop(stop)
        for row, i in enumerate(idx):
            tokens = gen[row, width:].tolist()[: episodes[i].budget - len(episodes[i].response)]
            cut = next((k for k, t in enumerate(tokens) if t == eos or t in stops), None)
            if cut is None:
                out[i] = ([t for t in tokens if t != pad], False)
            elif tokens[cut] == eos:
                out[i] = (tokens[:cut], False)
            else:
                out[i] = (tokens[: cut + 1], True)
    return out
