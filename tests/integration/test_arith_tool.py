"""The agentic example (``examples/arith_tool``): its calculator agrees with its demonstrations
through the real sandbox, and the recipe's greedy episodes run it turn by turn."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from laminar.cli import main
from laminar.recipe.episodes import greedy_episodes
from laminar.recipe.evaluate import evaluate
from laminar.recipe.tasks import load_task
from laminar.tools.sandbox import check_sandbox

TASK = str(Path(__file__).resolve().parents[2] / "examples" / "arith_tool")
TINY = ["--hidden", "64", "--layers", "1", "--heads", "2", "--kv-heads", "1",
        "--intermediate", "128", "--max-len", "512"]  # fmt: skip

pytestmark = pytest.mark.skipif(check_sandbox() is not None, reason="no sandbox here")


def test_the_calculator_replays_every_demonstration() -> None:
    task = load_task(TASK)
    env_class = task.environment

    async def play(record: dict) -> None:
        demo = task.demonstration(record)
        turns = demo.split("?")  # model turn i ends with "?", the next starts with the answer
        env = env_class()
        await env.reset(record)
        reward, calls = 0.0, 0
        answer = ""  # the calculator's part at the start of each turn but the first
        for i, turn in enumerate(turns):
            action = turn[len(answer) :]
            if i < len(turns) - 1:
                step = await env.step(action + "?")
                answer = turns[i + 1].split("\n")[0]
                assert step.observation == answer, (record, i)
                calls += 1
            else:
                step = await env.step(action)
                assert step.done
            reward += step.reward
        assert reward == 1.0 and calls == demo.count("?"), record

    async def play_all() -> None:  # at once, as the data role's env.concurrency plays them
        await asyncio.gather(*(play(record) for record in task.test_records(20)))

    asyncio.run(play_all())


def test_the_calculator_answers_a_bad_call_with_the_error_mark() -> None:
    env = load_task(TASK).environment()

    async def go() -> str:
        await env.reset({"id": "x", "prompt": "1a+1=\n", "answer": 2})
        return (await env.step("what?")).observation

    assert asyncio.run(go()) == "!"


def test_greedy_episodes_of_a_tiny_model(tmp_path: Path) -> None:
    out = tmp_path / "init"
    assert main(["model", "init", "--task", TASK, "--out", str(out), *TINY]) == 0
    task = load_task(TASK)
    result = evaluate(task, out, n=8, batch_size=4, threads=1)
    assert result.n == 8 and result.tool_calls is not None
    from laminar.recipe.model import load_model

    model, tok = load_model(out)
    records = task.test_records(4)
    episodes = greedy_episodes(model, tok, task.environment, records, [40] * 4, max_turns=3)
    for e in episodes:
        assert e.done and e.actions <= 3 and e.calls <= 2
        assert len(e.response) <= 40 + e.calls  # the budget (an observation may end past it)
        assert e.reward in (0.0, 1.0)
    # stopped (a trainer that stops mid-evaluation): the turn's generate ends at once
    from laminar.recipe.episodes import EvalStopped
    from tests.unit.test_recipe import stop_after

    asked, stop = stop_after(3)
    with pytest.raises(EvalStopped):
        greedy_episodes(model, tok, task.environment, records, [400] * 4, stop=stop)
    assert 3 <= asked[0] <= 6, asked


def test_the_error_analysis_finds_the_first_wrong_line_and_whether_it_was_called() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("arith_tool_errors", Path(TASK) / "errors.py")
    assert spec is not None and spec.loader is not None
    errors = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(errors)
    demo = "6a?+5=1\n1b-6=5\n5c+8=3\n#3"
    assert errors.first_wrong_line("6a+5=1\n1b?-6=5\n5c+8=3\n#3", demo) is None  # calls aside
    assert errors.first_wrong_line("6a+5=1\n1b-5=6\n6c+8=4\n#4", demo) == (1, False)
    assert errors.first_wrong_line("6a+5=1\n1b?-5=6\n6c+8=4\n#4", demo) == (1, True)
    assert errors.first_wrong_line("6a+5=1\n1b-6=5\n5c+8=3\n3d?!", demo) == (
        3,
        True,
    )  # past the end
    assert errors.first_wrong_line("6a+5=1\n1b-6=5", demo) == (2, False)  # stopped short
