"""Where a checkpoint's greedy episodes go wrong: the first wrong line, and whether it was called.

    .venv/bin/python examples/arith_tool/errors.py runs/latest/checkpoints/v000046 --steps 5 8

For the test problems of ``--steps`` operations (the held-out set ``laminar eval`` uses), runs the
greedy episodes with the calculator, and for each wrong one compares its lines with the
demonstration's (the ``?`` marks dropped): prints a few, then how many first go wrong at each line
and whether that line was handed to the calculator. The analysis of the example in
docs/benchmarks.md (*Learning*: which lines the trained policy still gets wrong) comes from this.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from laminar.recipe.evaluate import demo_lengths, eval_records, greedy_budget, task_rewards
from laminar.recipe.model import load_model
from laminar.recipe.tasks import load_task

CALL = "?"


def first_wrong_line(response: str, demonstration: str) -> tuple[int, bool] | None:
    """``(index, called)`` of the first line of ``response`` that differs from the
    demonstration's (calls ignored), or None if none does."""
    got, want = response.split("\n"), demonstration.replace(CALL, "").split("\n")
    for i, line in enumerate(got):
        if i >= len(want) or line.replace(CALL, "") != want[i]:
            return i, CALL in line
    return None if len(got) == len(want) else (len(got), False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a checkpoint or model directory")
    ap.add_argument("--steps", type=int, nargs=2, default=(5, 8), help="operations, from to")
    ap.add_argument("--n", type=int, default=500, help="test problems to draw from")
    ap.add_argument("--show", type=int, default=8, help="wrong episodes to print")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(2)
    task = load_task(str(Path(__file__).resolve().parent))
    model, tok = load_model(args.model)
    low, high = args.steps
    records = [r for r in eval_records(task, args.n) if low <= int(r["steps"]) <= high]
    demos = [task.demonstration(r) for r in records]
    budgets = [greedy_budget(n) for n in demo_lengths(tok, demos)]  # as `laminar eval`
    rewards, responses, calls = task_rewards(task, model, tok, records, budgets)
    lines: Counter[int] = Counter()
    called: Counter[bool] = Counter()
    shown = 0
    for record, reward, response, demo in zip(records, rewards, responses, demos, strict=True):
        if reward:
            continue
        text = tok.decode(response)
        where = first_wrong_line(text, demo)
        if where is not None:
            lines[where[0] + 1] += 1
            called[where[1]] += 1
        if shown < args.show:
            print(f"{record['prompt']!r}\n  want {demo!r}\n  got  {text!r}")
            shown += 1
    wrong = sum(1 for r in rewards if not r)
    assert calls is not None
    accuracy = 1 - wrong / len(records)
    print(f"{len(records)} problems of {low}-{high} steps: accuracy {accuracy:.3f}, "
          f"{sum(calls) / len(calls):.2f} tool calls per episode")  # fmt: skip
    print(f"{wrong} wrong; first wrong line (1 = the first): {dict(sorted(lines.items()))}; "
          f"that line called: {called[True]}, not called: {called[False]}")  # fmt: skip


if __name__ == "__main__":
    main()
