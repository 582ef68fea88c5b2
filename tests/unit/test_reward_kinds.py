"""Reward conventions without processes: which kind a signature is, and how each kind is called.

Laminar's ``reward(record, response)``, verl's ``compute_score(data_source, solution_str,
ground_truth, extra_info)`` and TRL's batched ``reward_func(completions, **kwargs)``: the data
role tells them apart by their parameters (:mod:`laminar.reward_kinds`) and the worker calls them
(:class:`laminar.reward_calls.Scorer`, run here in this process; through the real worker
processes in the pool tests beside this file).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from laminar.reward_calls import DECLINED, MAX_EXTRAS, Function, Item, Result, Scorer
from laminar.reward_kinds import detect_kind, is_async
from laminar.roles.data.reward_worker import MAX_REPLY_BYTES, encode_reply
from laminar.runtime.errors import ConfigError

# -- which convention --------------------------------------------------------------------------


def laminar_reward(record: dict[str, Any], response: str) -> float:
    return 1.0


def laminar_with_kwargs(record: dict[str, Any], response: str, **kwargs: Any) -> float:
    return 1.0


def verl_compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict[str, Any] | None = None,
) -> float:
    return 1.0


def verl_default_compute_score(  # verl.utils.reward_score.default_compute_score's parameters
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict[str, Any] | None = None,
    sandbox_fusion_url: str | None = None,
    concurrent_semaphore: Any = None,
    memory_limit_mb: int | None = None,
    **kwargs: Any,
) -> float:
    return 1.0


def verl_without_extra_info(data_source: str, solution_str: str, ground_truth: str) -> float:
    return 1.0


def trl_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    return [1.0] * len(completions)


def trl_with_prompts(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    return [1.0] * len(completions)


def trl_with_column(completions: list[Any], solution: list[str], **kwargs: Any) -> list[float]:
    return [1.0] * len(completions)


async def async_laminar(record: dict[str, Any], response: str) -> float:
    return 1.0


async def async_verl(
    data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None
) -> float:
    return 1.0


async def async_trl(completions: list[Any], **kwargs: Any) -> list[float]:
    return [1.0] * len(completions)


class AsyncJudge:
    async def __call__(self, record: dict[str, Any], response: str) -> float:
        return 1.0


@pytest.mark.parametrize(
    ("fn", "kind"),
    [
        (laminar_reward, "laminar"),
        (laminar_with_kwargs, "laminar"),
        (verl_compute_score, "verl"),
        (verl_default_compute_score, "verl"),
        (verl_without_extra_info, "verl"),
        (trl_reward, "trl"),
        (trl_with_prompts, "trl"),
        (trl_with_column, "trl"),
        (async_laminar, "laminar"),
        (async_verl, "verl"),
        (async_trl, "trl"),
        (AsyncJudge(), "laminar"),
        (lambda record, response: 1.0, "laminar"),
    ],
)
def test_auto_tells_each_convention_by_its_parameters(fn: Callable[..., Any], kind: str) -> None:
    assert detect_kind(fn, "m:f") == kind


def test_async_rewards_are_told_apart_from_sync_ones() -> None:
    assert [is_async(f) for f in (async_laminar, async_verl, async_trl, AsyncJudge())] == [True] * 4
    assert [is_async(f) for f in (laminar_reward, verl_compute_score, trl_reward)] == [False] * 3


def both(completions: list[Any], solution_str: str) -> list[float]:
    return []


def only_kwargs(**kwargs: Any) -> float:
    return 1.0


def only_args(*args: Any) -> float:
    return 1.0


@pytest.mark.parametrize("fn", [both, only_kwargs, only_args])
def test_an_ambiguous_signature_names_the_function_and_the_setting(fn: Callable[..., Any]) -> None:
    with pytest.raises(ConfigError, match=r"reward tasks\.py:f\(.*ambiguous.*data\.reward_kind"):
        detect_kind(fn, "tasks.py:f")


def one_argument(response: str) -> float:
    return 1.0


def three_arguments(record: dict[str, Any], response: str, answer: str) -> float:
    return 1.0


@pytest.mark.parametrize("fn", [one_argument, three_arguments])
def test_a_signature_no_convention_fits_is_refused(fn: Callable[..., Any]) -> None:
    with pytest.raises(ConfigError, match=r"tasks\.py:f\(.*none of the reward conventions"):
        detect_kind(fn, "tasks.py:f")


@pytest.mark.parametrize(
    ("fn", "kind", "why"),
    [
        (verl_compute_score, "laminar", "it must take \\(record, response\\)"),
        (laminar_reward, "verl", "verl passes data_source"),
        (laminar_reward, "trl", "TRL passes completions"),
        (trl_with_column, "verl", "verl passes data_source"),
    ],
)
def test_a_kind_that_is_set_is_checked_against_the_parameters(
    fn: Callable[..., Any], kind: str, why: str
) -> None:
    with pytest.raises(ConfigError, match=f"cannot be called as a {kind} reward: {why}"):
        detect_kind(fn, "m:f", kind)


def test_a_kind_that_is_set_settles_an_ambiguous_signature() -> None:
    assert detect_kind(only_kwargs, "m:f", "trl") == "trl"
    assert detect_kind(only_kwargs, "m:f", "verl") == "verl"
    assert detect_kind(only_args, "m:f", "laminar") == "laminar"
    assert detect_kind(max, "builtins:max", "laminar") == "laminar"  # no signature to check


def test_reward_kwargs_must_be_taken_by_a_laminar_reward() -> None:
    def needs_scale(record: dict[str, Any], response: str, scale: float) -> float:
        return scale

    with pytest.raises(ConfigError, match="scale"):
        detect_kind(needs_scale, "m:f")  # auto: laminar, and then scale is missing
    assert detect_kind(needs_scale, "m:f", "laminar", {"scale": 2.0}) == "laminar"


# -- how each convention is called -------------------------------------------------------------


def score(fn: Callable[..., Any], kind: str, items: list[Item], **kw: Any) -> list[Result]:
    scorer = Scorer([Function(fn, kind, "f")], **kw)
    try:
        return scorer.score(items)
    finally:
        scorer.close()


def item(record: dict[str, Any], response: str = "42", ids: list[int] | None = None) -> Item:
    return Item(record, response, ids or [], 3)


def test_verl_gets_the_records_verl_fields_by_keyword() -> None:
    seen: list[dict[str, Any]] = []

    def compute_score(
        data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None
    ) -> float:
        seen.append(
            dict(
                data_source=data_source,
                solution_str=solution_str,
                ground_truth=ground_truth,
                extra_info=extra_info,
            )
        )
        return float(solution_str == ground_truth)

    record = {
        "prompt": [{"role": "user", "content": "6*7?"}],
        "data_source": "openai/gsm8k",
        "reward_model": {"ground_truth": "42", "style": "rule"},
        "extra_info": {"index": 7, "split": "train"},
    }
    assert score(compute_score, "verl", [item(record)]) == [Result(1.0, None, {})]
    assert seen == [
        {
            "data_source": "openai/gsm8k",
            "solution_str": "42",
            "ground_truth": "42",
            "extra_info": {"index": 7, "split": "train"},
        }
    ]
    seen.clear()
    plain = {"id": "q", "ground_truth": "41"}  # no verl layout: a top-level ground_truth
    assert score(compute_score, "verl", [item(plain)]) == [Result(0.0, None, {})]
    assert seen[0]["data_source"] is None and seen[0]["extra_info"] == {}


def test_verl_without_a_ground_truth_says_which_fields_it_looked_for() -> None:
    (result,) = score(verl_compute_score, "verl", [item({"id": "q"})])
    assert result.reward is None
    assert result.error is not None and "reward_model.ground_truth" in result.error


def test_a_dict_result_keeps_its_numeric_fields_as_extras() -> None:
    def compute_score(**kwargs: Any) -> Any:
        return {
            "score": 1.0,
            "acc": True,  # bools are numbers here: their mean is an accuracy
            "pred": "42",  # text: not logged
            "length": 2,
            "nan": math.nan,  # not finite: not logged
            "nested": {"a": 1},
        }

    record = {"reward_model": {"ground_truth": "42"}}
    (result,) = score(compute_score, "verl", [item(record)])
    assert result == Result(1.0, None, {"acc": 1.0, "length": 2.0})


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ({"reward": 0.5, "x": 1}, None),
        ({"score": 0.5, "reward": 0.5}, "returned a dict with both 'score' and 'reward' field"),
        ({"acc": 1.0}, "returned a dict with no 'score' (verl's) or 'reward' field"),
        ({"score": "high"}, "returned 'high', not a number (its 'score')"),
        ({"score": True}, "a bool, not a number"),
        ({"score": None}, "returned None, not a number (its 'score')"),
    ],
)
def test_a_dict_needs_exactly_one_score(value: dict[str, Any], error: str | None) -> None:
    (result,) = score(lambda record, response: value, "laminar", [item({})])
    if error is None:
        assert result == Result(0.5, None, {"x": 1.0})
    else:
        assert result.reward is None and result.error is not None and error in result.error


def test_extras_beyond_the_limit_or_badly_named_are_left_out_with_one_warning() -> None:
    warned: list[str] = []
    many = {f"m{i}": i for i in range(MAX_EXTRAS + 3)}

    def reward(record: dict[str, Any], response: str) -> Any:
        return {"score": 1.0, **many, "bad name!": 1}

    scorer = Scorer([Function(reward, "laminar", "f")], warn=warned.append)
    first, second = scorer.score([item({}), item({})])
    assert first.extras == {f"m{i}": float(i) for i in range(MAX_EXTRAS)}
    assert second == first
    assert len(warned) == 4  # m16, m17, m18, 'bad name!': each once, not once per trajectory
    assert any("'bad name!'" in line and "not a metric name" in line for line in warned)


def test_trl_gets_one_call_per_batch_with_columns_as_lists() -> None:
    calls: list[dict[str, Any]] = []

    def reward_func(completions: list[Any], **kwargs: Any) -> list[float | None]:
        calls.append({"completions": completions, **kwargs})
        return [
            None if a is None else float(c == str(a))
            for c, a in zip(completions, kwargs["answer"], strict=True)
        ]

    items = [
        Item({"prompt": "6*7=", "answer": 42}, "42", [5, 6], 2),
        Item({"prompt": "1+1=", "answer": 3, "level": 1}, "2", [7], 4),
        Item({"prompt": "?", "answer": None}, "x", [8], 1),
    ]
    results = score(reward_func, "trl", items)
    assert results == [Result(1.0, None, {}), Result(0.0, None, {}), Result(None, DECLINED, {})]
    (call,) = calls
    assert call["prompts"] == ["6*7=", "1+1=", "?"]
    assert call["completions"] == ["42", "2", "x"]  # standard prompts: text completions
    assert call["completion_ids"] == [[5, 6], [7], [8]]
    assert call["answer"] == [42, 3, None]
    assert call["level"] == [None, 1, None]  # a field some records lack
    assert "prompt" not in call  # TRL's own arguments, not columns
    assert call["trainer_state"].global_step == 4
    call["log_extra"]("column", [1, 2, 3])  # accepted, like TRL's, and without effect


def test_trl_conversational_prompts_get_message_completions() -> None:
    seen: list[Any] = []

    def reward_func(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
        seen.extend(completions)
        return [float(len(c[0]["content"])) for c in completions]

    messages = [{"role": "user", "content": "hi"}]
    results = score(reward_func, "trl", [item({"prompt": messages}, "hello")])
    assert seen == [[{"role": "assistant", "content": "hello"}]]
    assert results == [Result(5.0, None, {})]


def test_trl_prompts_come_from_the_configured_key_even_dotted() -> None:
    got: list[Any] = []

    def reward_func(prompts: list[Any], completions: list[Any]) -> list[float]:
        got.extend(prompts)
        return [1.0] * len(completions)

    items = [item({"extra_info": {"question": "q1"}}), item({"extra_info": {"question": "q2"}})]
    score(reward_func, "trl", items, prompt_key="extra_info.question")
    assert got == ["q1", "q2"]


def test_a_function_without_kwargs_gets_only_what_it_declares() -> None:
    def reward_func(completions: list[str], answer: list[int]) -> list[float]:
        return [float(c == str(a)) for c, a in zip(completions, answer, strict=True)]

    def compute_score(solution_str: str, ground_truth: str) -> float:
        return float(solution_str == ground_truth)

    record = {"answer": 42, "reward_model": {"ground_truth": "42"}, "extra": 1}
    assert score(reward_func, "trl", [item(record)]) == [Result(1.0, None, {})]
    assert score(compute_score, "verl", [item(record)]) == [Result(1.0, None, {})]


def test_reward_kwargs_reach_every_convention() -> None:
    def laminar(record: dict[str, Any], response: str, scale: float = 1.0) -> float:
        return scale

    def verl(solution_str: str, ground_truth: str, scale: float = 1.0) -> float:
        return scale

    def trl(completions: list[str], scale: float = 1.0, **kwargs: Any) -> list[float]:
        return [scale] * len(completions)

    record = {"reward_model": {"ground_truth": "1"}}
    for fn, kind in ((laminar, "laminar"), (verl, "verl"), (trl, "trl")):
        assert score(fn, kind, [item(record)], kwargs={"scale": 3.0}) == [Result(3.0, None, {})]


@pytest.mark.parametrize(
    ("returned", "error"),
    [
        (0.5, "returned 0.5, not a list of one reward per completion"),
        ({"score": 1.0}, "not a list of one reward per completion"),
        ([1.0], "returned 1 rewards for 2 completions"),
        ([1.0, True], None),
    ],
)
def test_trl_results_must_be_one_per_completion(returned: Any, error: str | None) -> None:
    results = score(lambda completions, **kw: returned, "trl", [item({}), item({})])
    if error is None:
        assert results[0] == Result(1.0, None, {}) and results[1].reward is None
        assert results[1].error is not None and "a bool" in results[1].error
    else:
        assert results == [Result(None, results[0].error, {})] * 2
        assert results[0].error is not None and error in results[0].error


def test_trl_log_metric_becomes_an_extra_of_every_item_of_its_call() -> None:
    def reward_func(completions: list[str], log_metric: Any, **kwargs: Any) -> list[float]:
        log_metric("format_ok", 0.5)
        return [1.0] * len(completions)

    assert (
        score(reward_func, "trl", [item({}), item({})])
        == [Result(1.0, None, {"format_ok": 0.5})] * 2
    )


def test_async_rewards_of_a_batch_run_concurrently() -> None:
    # Each call waits until every call of the batch has started: only a concurrent run ends.
    arrived: list[int] = []
    everyone = asyncio.Event()

    async def together(record: dict[str, Any], response: str) -> float:
        arrived.append(record["i"])
        if len(arrived) == 3:
            everyone.set()
        async with asyncio.timeout(30):
            await everyone.wait()
        return float(record["i"])

    results = score(together, "laminar", [item({"i": i}) for i in range(3)])
    assert results == [Result(float(i), None, {}) for i in range(3)]


def test_a_sync_reward_may_run_its_own_event_loop() -> None:
    async def judge(text: str) -> float:
        return float(len(text))

    def reward(record: dict[str, Any], response: str) -> float:
        return asyncio.run(judge(response))  # many verl rewards do this

    assert score(reward, "laminar", [item({}, "abc")]) == [Result(3.0, None, {})]


def test_an_async_reward_that_raises_fails_only_its_trajectory() -> None:
    async def reward(record: dict[str, Any], response: str) -> float:
        if record["bad"]:
            raise ValueError("cannot judge")
        return 1.0

    ok, bad = score(reward, "laminar", [item({"bad": False}), item({"bad": True})])
    assert ok == Result(1.0, None, {})
    assert bad == Result(None, "raised ValueError: cannot judge", {})


def test_several_functions_are_a_weighted_sum_and_each_is_an_extra() -> None:
    def accuracy(record: dict[str, Any], response: str) -> Any:
        return {"score": float(response == "42"), "exact": response == "42"}

    def formatted(completions: list[str], **kwargs: Any) -> list[float | None]:
        return [None if c == "skip" else 1.0 for c in completions]

    def broken(record: dict[str, Any], response: str) -> float:
        if response == "boom":
            raise RuntimeError("no")
        return 0.0

    functions = [
        Function(accuracy, "laminar", "accuracy", 1.0),
        Function(formatted, "trl", "format", 0.25),
        Function(broken, "laminar", "broken", 5.0),
    ]
    results = Scorer(functions).score([item({}, "42"), item({}, "skip"), item({}, "boom")])
    assert results[0] == Result(
        1.25, None, {"accuracy": 1.0, "accuracy/exact": 1.0, "format": 1.0, "broken": 0.0}
    )
    # format declined: left out of the sum, as TRL's nansum leaves a None out
    assert results[1] == Result(0.0, None, {"accuracy": 0.0, "accuracy/exact": 0.0, "broken": 0.0})
    assert results[2] == Result(None, "broken: raised RuntimeError: no", {})


def test_when_every_function_declines_there_is_no_reward() -> None:
    def none(completions: list[str], **kwargs: Any) -> list[None]:
        return [None] * len(completions)

    functions = [Function(none, "trl", "a"), Function(none, "trl", "b")]
    assert Scorer(functions).score([item({})]) == [Result(None, DECLINED, {})]


# -- the reply line ---------------------------------------------------------------------------

results_strategy = st.lists(
    st.builds(
        Result,
        st.none() | st.floats(allow_nan=False, allow_infinity=False),
        st.none() | st.text(max_size=3000),
        st.dictionaries(
            st.from_regex(r"[a-z][a-z0-9_./-]{0,120}", fullmatch=True),
            st.floats(allow_nan=False, allow_infinity=False),
            max_size=40,
        ),
    ),
    min_size=1,
    max_size=64,
)


@settings(max_examples=60, deadline=None)
@given(results_strategy)
def test_a_reply_fits_its_bound_and_keeps_every_reward(results: list[Result]) -> None:
    line = encode_reply(results, 1.5)
    assert len(line) <= MAX_REPLY_BYTES and line.endswith(b"\n")
    reply = json.loads(line)
    assert [r["reward"] for r in reply["results"]] == [r.reward for r in results]
    assert [r["error"] is None for r in reply["results"]] == [r.error is None for r in results]
    if len(json.dumps([r.__dict__ for r in results])) < MAX_REPLY_BYTES // 2:
        assert [r["error"] for r in reply["results"]] == [r.error for r in results]
        assert [r["extras"] for r in reply["results"]] == [r.extras for r in results]


def test_one_weighted_function_is_scaled_and_keeps_its_extras_names() -> None:
    def reward(record: dict[str, Any], response: str) -> Any:
        return {"score": 0.5, "acc": 1}

    scorer = Scorer([Function(reward, "laminar", "reward", 3.0)])
    assert scorer.score([item({})]) == [Result(1.5, None, {"acc": 1.0})]


def test_the_config_takes_one_function_or_a_weighted_list() -> None:
    from pydantic import ValidationError

    from laminar.roles.data.config import DataConfig

    base = {"prompts": "p.jsonl", "tokenizer": "t"}
    plain = DataConfig(**base, reward="m:f", reward_kind="verl", reward_batch=8)
    assert (plain.reward, plain.reward_kind, plain.reward_batch) == ("m:f", "verl", 8)
    listed = DataConfig(
        **base, reward=[{"function": "m:a"}, {"function": "m:b", "weight": 0.2, "kind": "trl"}]
    )
    assert isinstance(listed.reward, list)
    assert [(f.function, f.weight, f.kind) for f in listed.reward] == [
        ("m:a", 1.0, None),
        ("m:b", 0.2, "trl"),
    ]
    for bad in (
        {"reward": []},
        {"reward": "m:f", "reward_kind": "openai"},
        {"reward": "m:f", "reward_batch": 0},
        {"reward": [{"function": "m:a", "name": "no spaces"}]},
        {"reward": [{"function": "m:a", "weight": math.inf}]},
    ):
        with pytest.raises(ValidationError):
            DataConfig(**base, **bad)
