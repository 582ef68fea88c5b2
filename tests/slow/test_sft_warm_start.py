"""The example's warm start reaches its target whatever the seed (issue 14: on a fresh machine
seed 1 ran its whole budget at chance, and `make run` then trained a broken start).

The real recipe (the arith task, its model shape, its SFT curriculum), on two seeds other than
`make run`'s, on a short version of the task so the suite stays short: chains of at most 4
operations (``MAX_STEPS = 4``, in the worker processes only: 56% of problems then have 4
operations), to 50% greedy accuracy on 50 training-split problems of that distribution (a guess is
right 10% of the time). Measured alone (2026-11-25, one thread each): both seeds stopped at
500 steps (0.54 and 0.62; 19-20 s), where the full task to 25% took 350 and 550 steps (36 and
62 s). Without the curriculum the same two seeds read 0.02-0.26 for 1,250 and 1,500 steps: the
recipe, not the short task, is what the test passes on.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from laminar.recipe.model import ModelShape, init_model
from laminar.recipe.sft import SftConfig, curriculum_knobs, train_sft
from laminar.recipe.tasks import load_task

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ARITH = str(Path(__file__).resolve().parents[2] / "examples" / "arith")
#: the short task's longest chain
SHORT = 4


@pytest.fixture(scope="module")
def task():
    return load_task(ARITH)


def _warm_start(seed: int, out: str) -> tuple[str, bool, bool, list[tuple[int, float, float]]]:
    """One seed's init + SFT, in its own process (one thread: the two seeds share the cores)."""
    task = load_task(ARITH)
    task.module.MAX_STEPS = SHORT  # this process's copy of the task: training and validation
    init = init_model(task.alphabet, Path(out) / "init", ModelShape(), seed=seed)
    cfg = SftConfig(steps=1500, seed=seed, threads=1, stop_at=0.5, eval_every=50, val_n=50)
    result = train_sft(task, init, Path(out) / "sft", cfg)
    done = (Path(out) / "sft" / "sft.json").is_file()
    return result.stopped_by, result.reached_target, done, result.evals


def test_the_warm_start_reaches_its_target_on_any_seed(tmp_path):
    # Two seeds side by side, one process each: the wall time of one (the suite's budget).
    seeds = (3, 4)
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(len(seeds), mp_context=ctx) as pool:
        runs = {s: pool.submit(_warm_start, s, str(tmp_path / f"seed{s}")) for s in seeds}
        results = {s: f.result(timeout=540) for s, f in runs.items()}
    for seed, (stopped_by, reached, done, evals) in results.items():
        assert stopped_by == "stop_at", (seed, evals)
        assert reached and done, (seed, evals)


def test_the_curriculum_stages_hand_their_knobs_to_generate(task):
    stages = task.sft_curriculum
    assert [until for until, _ in stages] == sorted(until for until, _ in stages)
    assert curriculum_knobs(stages, 0) == {"max_digit": 1}
    assert curriculum_knobs(stages, stages[-1][0]) == {}  # then the task's own distribution
    easy = task.train_records(200, 7, **curriculum_knobs(stages, 0))
    assert all(d == "1" for r in easy for d in r["prompt"][3::3])  # every operation is +1 or -1
    assert len({d for r in task.train_records(200, 7) for d in r["prompt"][3::3]}) == 9
