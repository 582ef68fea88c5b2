"""verl's and TRL's reward signatures, dict results and async rewards, through the real worker pool.

Each test starts a :class:`RewardPool` on a reward file written here: the workers are the real
sandboxed processes (``laminar.roles.data.reward_worker``), so what is checked is what crosses the pipes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from laminar.reward_calls import DECLINED
from laminar.roles.data.rewards import RewardFunction, RewardItem, RewardPool, RewardResult
from laminar.runtime.errors import ConfigError

REWARDS = r'''
import asyncio, json


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's signature, and a verl-style dict result."""
    if data_source != "openai/gsm8k":
        raise ValueError(f"data_source {data_source!r}")
    correct = solution_str.strip() == ground_truth
    return {"score": float(correct), "acc": correct, "pred": solution_str, "index": extra_info["index"]}


async def compute_score_async(data_source, solution_str, ground_truth, extra_info=None):
    await asyncio.sleep(0)
    return float(solution_str == ground_truth)


def trl_reward(prompts, completions, completion_ids, trainer_state, answer, log, **kwargs):
    """TRL's batched signature: it writes down each call it gets."""
    with open(log[0], "a") as f:
        f.write(json.dumps({
            "prompts": prompts,
            "completions": completions,
            "completion_ids": completion_ids,
            "answer": answer,
            "step": trainer_state.global_step,
        }) + "\n")
    out = []
    for completion, a in zip(completions, answer):
        text = completion[0]["content"] if isinstance(completion, list) else completion
        out.append(None if a is None else float(text == str(a)))
    return out


async def trl_async(completions, **kwargs):
    await asyncio.sleep(0)
    return [float(len(c)) for c in completions]


_arrived = []
_everyone = None


async def together(record, response):
    """Ends only if every call of its batch runs at once (each waits for the others)."""
    global _everyone
    if _everyone is None:
        _everyone = asyncio.Event()
    _arrived.append(record["i"])
    if len(_arrived) == record["n"]:
        _everyone.set()
    await _everyone.wait()
    return {"score": float(record["i"]), "waited": len(_arrived)}


def laminar_reward(record, response):
    return float(response == record["answer"])


def trl_sleeps(completions, **kwargs):
    import time
    time.sleep(60)


def ambiguous(**kwargs):
    return 1.0


def one_argument(response):
    return 1.0
'''


@pytest.fixture
def rewards(tmp_path: Path) -> str:
    path = tmp_path / "kinds_under_test.py"
    path.write_text(REWARDS)
    return str(path)


def verl_record(i: int, answer: str) -> dict[str, object]:
    return {
        "id": f"q{i}",
        "prompt": [{"role": "user", "content": f"question {i}"}],
        "data_source": "openai/gsm8k",
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"index": i, "split": "train"},
    }


async def test_verl_compute_score_with_its_dict_result(rewards: str) -> None:
    pool = RewardPool(f"{rewards}:compute_score")
    try:
        assert pool.batch_size == 1  # sync and per trajectory: one call per job, as before
        right = await pool.score(verl_record(3, "42"), "42")
        wrong = await pool.score(verl_record(4, "42"), "41")
        other = await pool.score({**verl_record(5, "1"), "data_source": "x"}, "1")
    finally:
        await pool.close()
    assert right == RewardResult(1.0, None, {"acc": 1.0, "index": 3.0})  # "pred" is text
    assert wrong == RewardResult(0.0, None, {"acc": 0.0, "index": 4.0})
    assert other == RewardResult(None, "raised ValueError: data_source 'x'")


async def test_an_async_verl_reward_is_awaited_in_the_worker(rewards: str) -> None:
    pool = RewardPool(f"{rewards}:compute_score_async", batch=8)
    try:
        assert pool.batch_size == 8
        items = [RewardItem(verl_record(i, "7"), str(5 + i)) for i in range(4)]
        results = await pool.score_batch(items)
    finally:
        await pool.close()
    assert [r.reward for r in results] == [0.0, 0.0, 1.0, 0.0]


async def test_trl_scores_a_batch_in_one_call(rewards: str, tmp_path: Path) -> None:
    log = tmp_path / "calls.jsonl"
    chat = [{"role": "user", "content": "2+2?"}]
    items = [
        RewardItem({"prompt": "1+1=", "answer": 2, "log": str(log)}, "2", [5], 3),
        RewardItem({"prompt": chat, "answer": 4, "log": str(log)}, "5", [6, 7], 4),
        RewardItem({"prompt": "x", "answer": math.nan, "log": str(log)}, "x", [8], 4),  # no JSON
        RewardItem({"prompt": "?", "answer": None, "log": str(log)}, "?", [9], 2),
    ]
    pool = RewardPool(f"{rewards}:trl_reward", batch=16)
    try:
        results = await pool.score_batch(items)
    finally:
        await pool.close()
    assert results[0] == RewardResult(1.0)
    assert results[1] == RewardResult(0.0)
    assert results[2].reward is None and results[2].error is not None
    assert results[2].error.startswith("the record cannot be sent to the reward (not JSON")
    assert results[3] == RewardResult(None, DECLINED)  # TRL's None: no reward for this one
    (call,) = [json.loads(line) for line in log.read_text().splitlines()]  # one call, 3 items
    assert call == {
        "prompts": ["1+1=", chat, "?"],
        "completions": ["2", [{"role": "assistant", "content": "5"}], "?"],
        "completion_ids": [[5], [6, 7], [9]],
        "answer": [2, 4, None],
        "step": 4,
    }


async def test_a_batch_is_cut_into_calls_of_at_most_batch(rewards: str, tmp_path: Path) -> None:
    log = tmp_path / "calls.jsonl"
    items = [RewardItem({"prompt": "p", "answer": i, "log": str(log)}, str(i)) for i in range(7)]
    pool = RewardPool(f"{rewards}:trl_reward", batch=3)
    try:
        results = await pool.score_batch(items)
    finally:
        await pool.close()
    assert [r.reward for r in results] == [1.0] * 7
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert [c["answer"] for c in calls] == [[0, 1, 2], [3, 4, 5], [6]]


async def test_async_trl_and_a_timed_out_batch(rewards: str) -> None:
    pool = RewardPool(f"{rewards}:trl_async")
    try:
        assert [r.reward for r in await pool.score_batch([RewardItem({}, "ab")] * 2)] == [2.0] * 2
    finally:
        await pool.close()
    slow = RewardPool(f"{rewards}:trl_sleeps", timeout_s=1.0)
    try:
        results = await slow.score_batch([RewardItem({}, "a"), RewardItem({}, "b")])
    finally:
        await slow.close()
    assert results == [RewardResult(None, "timed out after 1.0s (one call for a batch of 2)")] * 2


async def test_an_async_reward_runs_its_batch_concurrently(rewards: str) -> None:
    pool = RewardPool(f"{rewards}:together", batch=4, timeout_s=60.0)
    try:
        items = [RewardItem({"i": i, "n": 4}, "") for i in range(4)]
        results = await pool.score_batch(items)
    finally:
        await pool.close()
    assert results == [RewardResult(float(i), None, {"waited": 4.0}) for i in range(4)]


async def test_several_functions_give_a_weighted_sum_and_an_extra_each(rewards: str) -> None:
    functions = [
        RewardFunction(function=f"{rewards}:compute_score", weight=1.0, name="verl"),
        RewardFunction(function=f"{rewards}:laminar_reward", weight=0.5),
    ]
    pool = RewardPool(functions)
    try:
        result = await pool.score({**verl_record(2, "42"), "answer": "42"}, "42")
    finally:
        await pool.close()
    expected = {"verl": 1.0, "verl/acc": 1.0, "verl/index": 2.0, "laminar_reward": 1.0}
    assert result == RewardResult(1.5, None, expected)


def test_an_ambiguous_or_wrong_reward_fails_the_pool_at_once(rewards: str) -> None:
    with pytest.raises(ConfigError, match=r"kinds_under_test.py:ambiguous\(\*\*kwargs\).*kind"):
        RewardPool(f"{rewards}:ambiguous")
    with pytest.raises(ConfigError, match=r"one_argument\(response\) takes none of"):
        RewardPool(f"{rewards}:one_argument")
    with pytest.raises(ConfigError, match="cannot be called as a trl reward"):
        RewardPool(f"{rewards}:laminar_reward", kind="trl")
    with pytest.raises(ConfigError, match="each needs a name of its own"):
        RewardPool([RewardFunction(function=f"{rewards}:laminar_reward")] * 2)
    with pytest.raises(ConfigError, match="reward_kwargs must be JSON"):
        RewardPool(f"{rewards}:laminar_reward", kwargs={"x": object()})


async def test_a_set_kind_settles_an_ambiguous_reward(rewards: str) -> None:
    pool = RewardPool(f"{rewards}:ambiguous", kind="verl")
    try:
        assert await pool.score(verl_record(1, "x"), "x") == RewardResult(1.0)
    finally:
        await pool.close()
