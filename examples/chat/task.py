"""Clock arithmetic as a chat task, in verl's parquet layout: the data and the recipe's task module.

The problems are ``examples/arith``'s (a start digit and ``k`` labelled operations ``+d`` / ``-d``
on a ten-digit wheel, listed last first), with chains of at most :data:`MAX_STEPS` operations. Each
is a conversation: a system message and the problem as the user's message; the assistant answers
with arith's working lines and ``#answer``, and ends its turn with ``<|im_end|>``. The model is a
chat model built here (``laminar model init``: a ChatML template in its tokenizer_config.json,
``<|im_end|>`` among its end-of-sequence ids), so the data role renders the prompts with the
model's own template, as it would any instruct model's.

What RL has to learn: the warm start's demonstrations (:func:`sft_demonstration`) answer most
problems of one or two operations at once, ``#answer`` with no working, as much instruct data
answers easy-looking questions, and show the working on longer ones. The warm start copies the
habit: greedy, it answers short problems at once and is right on two-step ones about as often as
a guess, while it solves most three-step chains by working them out. Working is right where
guessing is not, so the groups of a short problem disagree and RL learns to show the working
there too (the ``shows_work`` extra of ``compute_score`` follows it). Why not arith's own
frontier: there the warm start fails on a lookup it has not learnt (the operation of line 4 or
5), which sampling rarely finds, and RL barely moved it (``README.md`` beside this file has the
measurements).

``generate --out DIR`` writes ``train.parquet`` and ``test.parquet`` with verl's columns exactly
(as verl's ``examples/data_preprocess/gsm8k.py`` writes them)::

    data_source   "clock_arith"
    prompt        [{"role": "system", "content": SYSTEM},
                   {"role": "user", "content": "7c+2b-5a+8="}]
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": "2"}
    extra_info    {"split": "train", "index": 0, "steps": 3}

and ``compute_score.py`` beside this file scores a response as verl's reward functions do. A
Laminar run reads both unchanged (``config.yaml``); this module adds only what the recipe needs to
build and warm-start the model and to measure it (``laminar.recipe.tasks``): :data:`ALPHABET`,
:data:`CHAT_TEMPLATE`, :func:`generate`, :func:`demonstration` (the worked answer, which sizes
the evaluation's budget), :func:`sft_demonstration`, :func:`reward`. Train and test
problems are disjoint by construction (arith's prompt-hash split).

CLI::

    python examples/chat/task.py generate --out DIR --train N --test M --seed S
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import zlib
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent


def _load(path: Path, name: str) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


arith = _load(HERE.parent / "arith" / "task.py", "laminar_example_arith_task")
scoring = _load(HERE / "compute_score.py", "laminar_example_chat_compute_score")

#: the recipe builds a ChatML chat model for this task and renders its prompts with the template
CHAT_TEMPLATE = "chatml"
DATA_SOURCE = "clock_arith"
ABILITY = "math"
SYSTEM = "Solve mod 10."
#: every character a message or a response may hold (the template's role names are added by
#: the recipe)
ALPHABET = arith.ALPHABET + SYSTEM
#: the longest chain: arith's chains of at most this many operations
MAX_STEPS = 6
#: the warm start's demonstrations answer problems of at most DIRECT_STEPS operations at once,
#: without the working lines, this share of the time (by a hash of the problem)
DIRECT_STEPS = 2
DIRECT_RATE = 0.6
#: ``laminar sft`` stops once greedy accuracy on training problems reaches this. Low, because
#: greedy the warm start answers short problems at once and mostly wrongly: the stop only has to
#: see that the working of longer chains has been learnt
SFT_STOP_AT = 0.35
SFT_CURRICULUM = arith.SFT_CURRICULUM


def generate(n: int, seed: int, split: str = "train", max_digit: int = 9) -> list[dict[str, Any]]:
    """``n`` rows of one split in verl's layout, deterministic in ``(seed, split)`` and
    prefix-stable in ``n``; ``max_digit`` as arith's (the SFT curriculum)."""
    want = 2 * n
    while True:
        problems = [
            r for r in arith.generate(want, seed, split, max_digit) if r["steps"] <= MAX_STEPS
        ]
        if len(problems) >= n:
            break
        want *= 2
    return [_row(p, split, i) for i, p in enumerate(problems[:n])]


def _row(problem: dict[str, Any], split: str, index: int) -> dict[str, Any]:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": problem["prompt"].strip()},
        ],
        "ability": ABILITY,
        "reward_model": {"style": "rule", "ground_truth": str(problem["answer"])},
        "extra_info": {"split": split, "index": index, "steps": problem["steps"]},
    }


def _problem(row: dict[str, Any]) -> str:
    return next(m["content"] for m in row["prompt"] if m["role"] == "user")


def demonstration(row: dict[str, Any]) -> str:
    """The assistant's answer: arith's working lines and ``#answer`` (the recipe ends the turn
    with ``<|im_end|>``)."""
    return str(arith.demonstration({"prompt": _problem(row)}))


def answers_directly(row: dict[str, Any]) -> bool:
    """Whether the warm start's demonstration of ``row`` skips the working (:data:`DIRECT_RATE`
    of the problems of at most :data:`DIRECT_STEPS` operations)."""
    if row["extra_info"]["steps"] > DIRECT_STEPS:
        return False
    return zlib.crc32(f"direct/{_problem(row)}".encode()) % 1000 < DIRECT_RATE * 1000


def sft_demonstration(row: dict[str, Any]) -> str:
    """The warm start's target: :func:`demonstration`, or for a share of the problems only its
    answer line."""
    demo = demonstration(row)
    return demo.rsplit("\n", 1)[-1] if answers_directly(row) else demo


def reward(row: dict[str, Any], response: str) -> float:
    """``compute_score``'s score, called as the data role calls it (docs/rewards.md)."""
    result = scoring.compute_score(
        data_source=row.get("data_source"),
        solution_str=response,
        ground_truth=row["reward_model"]["ground_truth"],
        extra_info=dict(row.get("extra_info") or {}),
    )
    return float(result["score"])


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="write train.parquet and test.parquet (verl's layout)")
    gen.add_argument("--out", required=True, help="output directory")
    gen.add_argument("--train", type=int, default=20_000, help="number of training rows")
    gen.add_argument("--test", type=int, default=500, help="number of test rows")
    gen.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_parquet(out / "train.parquet", generate(args.train, args.seed, "train"))
    write_parquet(out / "test.parquet", generate(args.test, args.seed, "test"))
    print(f"wrote {args.train} train and {args.test} test rows to {out}/{{train,test}}.parquet")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
