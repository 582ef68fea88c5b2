"""The episode bookkeeping (``laminar.tools.env``) and the data role's episode host
(``roles/data/episodes.py``): idempotent steps, replay after a restart, bounds, rewards."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from laminar.roles.data.config import DataConfig, EnvConfig
from laminar.roles.data.episodes import Episodes
from laminar.runtime.clock import RealClock
from laminar.runtime.errors import ConfigError
from laminar.tools.env import (
    Environment,
    Step,
    add_span,
    awaits_step,
    load_environment,
    model_spans,
    spans_within,
)

from ..support.task import write_tokenizer


class QuickEnv(Environment):
    """Answers the k-th call ``=k`` at once; counts every step made (across instances)."""

    stop = ("#",)
    made = 0

    async def reset(self, record: dict[str, Any]) -> None:
        self.calls = 0

    async def step(self, action: str) -> Step:
        QuickEnv.made += 1
        if not action.endswith("#"):
            return Step(reward=0.5, done=True)
        self.calls += 1
        return Step(observation=f"={self.calls}", reward=1.0)


class SlowEnv(QuickEnv):
    async def step(self, action: str) -> Step:
        await asyncio.sleep(5)
        return Step(observation="=")


class MuteEnv(QuickEnv):
    async def step(self, action: str) -> Step:
        return Step()


class WordyEnv(QuickEnv):
    stop = ("##",)


def test_spans_hand_cases() -> None:
    assert model_spans(10, []) == [(0, 10)]
    assert model_spans(10, [(3, 5), (7, 8)]) == [(0, 3), (5, 7), (8, 10)]
    assert model_spans(8, [(3, 5), (7, 8)]) == [(0, 3), (5, 7)]
    assert model_spans(5, [(0, 2)]) == [(2, 5)]  # an observation first is no model turn
    stops = frozenset({9})
    assert awaits_step([1, 9], [], stops)
    assert not awaits_step([1, 2], [], stops)
    assert awaits_step([1, 9, 4, 5, 9], [(2, 3)], stops)  # a second call, not yet answered
    assert not awaits_step([1, 9, 9], [(2, 3)], stops)  # the observation ends with a stop id
    spans: list[tuple[int, int]] = [(0, 2)]
    add_span(spans, 2, 4)
    add_span(spans, 6, 7)
    add_span(spans, 7, 7)
    assert spans == [(0, 4), (6, 7)]
    assert spans_within([(0, 4), (6, 9)], 3, 7) == [(3, 4), (6, 7)]


def _host(tmp: Path, env: str = "QuickEnv", **config: Any) -> tuple[Episodes, Any]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(write_tokenizer(tmp / "tok") / "tokenizer.json"))
    cfg = EnvConfig(spec=f"tests.unit.test_episodes:{env}", **config)
    return Episodes(cfg, tok, CollectorRegistry(), RealClock()), tok


def _ids(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False).ids)


async def test_a_step_is_made_once_and_an_episode_is_replayed_after_a_restart(
    tmp_path: Path,
) -> None:
    host, tok = _host(tmp_path)
    record = {"id": "p0"}
    tokens = _ids(tok, "12#")
    QuickEnv.made = 0
    first = await host.step("p0/0", record, tokens, [])
    again = await asyncio.gather(*(host.step("p0/0", record, tokens, []) for _ in range(3)))
    assert QuickEnv.made == 1 and all(a == first for a in again)
    assert tok.decode(first.observation_token_ids) == "=1" and not first.done
    # turn 2, asked of a host that never saw the episode (a restarted data role): turn 1 is
    # replayed, so the answer counts on from it
    tokens += first.observation_token_ids
    spans = [(3, 5)]
    tokens += _ids(tok, "3#")
    fresh, _ = _host(tmp_path)
    second = await fresh.step("p0/0", record, tokens, spans)
    assert tok.decode(second.observation_token_ids) == "=2"
    assert fresh.replays == 1
    # the last turn ends without a stop: stepped when scored; 1 + 1 + 0.5
    tokens += second.observation_token_ids + _ids(tok, "#4")
    spans.append((7, 9))
    assert await fresh.final_reward("p0/0", record, tokens, spans) == (2.5, None)
    assert fresh.stats()["env_live"] == 0


async def test_max_turns_ends_the_episode(tmp_path: Path) -> None:
    host, tok = _host(tmp_path, max_turns=2)
    tokens = _ids(tok, "1#")
    reply = await host.step("a", {}, tokens, [])
    tokens += reply.observation_token_ids + _ids(tok, "2#")
    reply = await host.step("a", {}, tokens, [(2, 4)])
    assert reply.done and reply.error is None and not reply.observation_token_ids
    assert await host.final_reward("a", {}, tokens, [(2, 4)]) == (2.0, None)


@pytest.mark.parametrize(
    ("env", "why"),
    [("SlowEnv", "timed out after 0.2s"), ("MuteEnv", "empty observation")],
)
async def test_a_failing_step_ends_its_episode_with_the_reason(
    tmp_path: Path, env: str, why: str
) -> None:
    host, tok = _host(tmp_path, env, step_timeout_s=0.2)
    tokens = _ids(tok, "1#")
    reply = await host.step("a", {}, tokens, [])
    assert reply.done and why in (reply.error or "")
    reward, error = await host.final_reward("a", {}, tokens, [])
    assert reward is None and why in (error or "")


def test_bad_environments_and_configs_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"not a laminar\.tools\.env\.Environment"):
        load_environment("tests.unit.test_episodes:test_spans_hand_cases")
    with pytest.raises(ConfigError, match="2 tokens"):
        _host(tmp_path, "WordyEnv")
    base = {"prompts": "p.jsonl", "tokenizer": "t"}
    with pytest.raises(ValidationError, match=r"exactly one of data\.reward"):
        DataConfig(**base)
    with pytest.raises(ValidationError, match=r"exactly one of data\.reward"):
        DataConfig(**base, reward="m:f", env={"spec": "m:C"})
    assert DataConfig(**base, env={"spec": "m:C"}).env is not None
