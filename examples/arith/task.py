"""Multi-step clock arithmetic: a verifiable task whose response lengths are long-tailed by nature.

Why this task: Laminar exists because RL rollouts have long-tailed lengths (p99 > 10x median). Here
the tail comes from the problems themselves, not from a sampling artefact: a problem is a start
digit and ``k`` labelled operations ``+d`` / ``-d`` (d in 1..9) on a ten-digit wheel (arithmetic
mod 10), with ``k`` drawn from a clipped log-normal (median 4, p99 ~ 42, max 48). The demonstrated
solution writes one line per operation, so the response length grows linearly with ``k``, and a
small model's chance of getting every step right shrinks with ``k``: after the warm start short
chains are often solved and long ones rarely, which leaves RL room to help.

Format (characters only from :data:`ALPHABET`)::

    prompt:    "7c+2b-5a+8=\n"             start 7; operations a: +8, b: -5, c: +2
    response:  "7a+8=5\n5b-5=0\n0c+2=2\n#2"  (then the end-of-sequence token)

Operation ``i`` carries the label ``LABELS[i]`` (``a``..``z``, ``A``..``V``) and is applied in
label order; the prompt lists the operations *last first*. Why, measured on the 2-core recipe
(``README.md``): to execute step ``i`` the model must find operation ``i`` in the prompt. Listed
first-to-last, the distance from response line ``i`` back to operation ``i`` depends on both
``i`` and ``k``; a 2-layer model then learns the lookup for ``k <= 4`` only and is at chance beyond.
Listed last-first, that distance is ``10 i + 6`` tokens whatever ``k`` is, so what is learned for
one chain length carries over to all, and errors grow smoothly with ``i``. The labels make the
order explicit to a reader and give the model a content key for the same lookup. Why mod 10:
two-digit running values (carries, variable widths) were not learned in the budget; single
digits keep every step a small table and every line the same width. The price: a guess is right
one time in ten, so long chains score about 0.1 rather than 0.

The reward is 1.0 iff the number after the first ``#`` equals the true answer.

Test/train separation is by construction: a problem belongs to the ``test`` split iff a stable
hash of its prompt falls in a fixed 10% bucket, so records generated for training (any seed) never
repeat a test problem, with no list of test prompts to coordinate.

Interface used by ``laminar.recipe`` (and by the data role, through ``reward``):
:data:`ALPHABET`, :func:`generate`, :func:`demonstration`, :func:`reward`, and optionally
:data:`SFT_STOP_AT`.

CLI::

    python examples/arith/task.py generate --out DIR --train N --test M --seed S
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: the label of operation i is LABELS[i]
LABELS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
#: every character a prompt or a response may contain (the tokenizer is built over these)
ALPHABET = "0123456789+-=#\n" + LABELS
#: running values live on a wheel of this many digits
MODULUS = 10

#: the number of operations k = 1 + floor(exp(N(STEPS_MU, STEPS_SIGMA))), clipped to MAX_STEPS
STEPS_MU = 1.25
STEPS_SIGMA = 1.05
MAX_STEPS = 48  # <= len(LABELS)
#: share of all problems reserved for the test split (by prompt hash)
TEST_FRACTION = 0.1
#: ``laminar sft`` stops once greedy accuracy on training problems reaches this: RL needs a
#: policy that is right on some problems but far from all (``--stop-at`` overrides)
SFT_STOP_AT = 0.55
#: ``laminar sft`` trains on problems with digits <= 1, then <= 3, then <= 6, then all: the mod-10
#: result of a line has no first-order dependence on its inputs when d is uniform over 1..9, and
#: without this foothold the warm start waited a seed-dependent time for luck (laminar.recipe.sft)
SFT_CURRICULUM = [(150, {"max_digit": 1}), (300, {"max_digit": 3}), (450, {"max_digit": 6})]

_ORDER = {label: i for i, label in enumerate(LABELS)}
_ANSWER = re.compile(r"#\s*(-?\d+)")
_PROMPT = re.compile(r"(\d+)((?:[a-zA-Z][+-]\d)+)=")


def _split_of(prompt: str) -> str:
    bucket = zlib.crc32(prompt.encode()) % 1000
    return "test" if bucket < TEST_FRACTION * 1000 else "train"


def sample_steps(rng: random.Random) -> int:
    """One draw of the number of operations: clipped log-normal, heavy right tail."""
    return min(MAX_STEPS, 1 + math.floor(math.exp(rng.gauss(STEPS_MU, STEPS_SIGMA))))


def _problem(rng: random.Random, max_digit: int = 9) -> tuple[str, int, int]:
    value = rng.randrange(MODULUS)
    start = value
    steps = sample_steps(rng)
    ops = []
    for i in range(steps):
        d = rng.randint(1, max_digit)
        op = "-" if rng.random() < 0.5 else "+"
        value = _apply(value, op, d)
        ops.append(f"{LABELS[i]}{op}{d}")
    return f"{start}{''.join(reversed(ops))}=\n", value, steps


def _apply(value: int, op: str, d: int) -> int:
    return (value + d if op == "+" else value - d) % MODULUS


def generate(n: int, seed: int, split: str = "train", max_digit: int = 9) -> list[dict[str, Any]]:
    """``n`` records of one split, deterministic in ``(seed, split)`` and prefix-stable in ``n``.
    ``max_digit`` < 9 draws the operations' digits from 1..max_digit (the SFT curriculum).

    Each record: ``id`` (unique: split, seed, index), ``prompt``, ``answer`` (int), ``steps``.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', not {split!r}")
    rng = random.Random(f"arith/{split}/{seed}")
    records: list[dict[str, Any]] = []
    while len(records) < n:
        prompt, answer, steps = _problem(rng, max_digit)
        if _split_of(prompt) != split:
            continue
        records.append(
            {
                "id": f"{split}-{seed}-{len(records)}",
                "prompt": prompt,
                "answer": answer,
                "steps": steps,
            }
        )
    return records


def _parse(prompt: str) -> tuple[int, list[tuple[str, int]]]:
    match = _PROMPT.fullmatch(prompt.strip())
    if match is None:
        raise ValueError(f"not an arith prompt: {prompt!r}")
    ops = sorted(re.findall(r"([a-zA-Z])([+-])(\d)", match.group(2)), key=lambda m: _ORDER[m[0]])
    return int(match.group(1)), [(op, int(d)) for _, op, d in ops]


def demonstration(record: dict[str, Any]) -> str:
    """The target response: a line ``{value}{label}{op}{d}={new}`` per operation, then
    ``#answer`` (no EOS: the recipe appends the tokenizer's EOS token)."""
    value, ops = _parse(record["prompt"])
    lines = []
    for i, (op, d) in enumerate(ops):
        new = _apply(value, op, d)
        lines.append(f"{value}{LABELS[i]}{op}{d}={new}")
        value = new
    lines.append(f"#{value}")
    return "\n".join(lines)


def reward(record: dict[str, Any], response: str) -> float:
    """1.0 iff the integer after the first ``#`` in ``response`` is the answer, else 0.0.

    Never raises: a malformed record or response scores 0.0 (it runs inside the data service).
    """
    try:
        match = _ANSWER.search(response) if isinstance(response, str) else None
        if match is None or response.find("#") != match.start():
            return 0.0
        return 1.0 if int(match.group(1)) == int(record["answer"]) else 0.0
    except Exception:
        return 0.0


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def main(
    argv: list[str] | None = None,
    demonstrate: Callable[[dict[str, Any]], str] = demonstration,
    description: str | None = None,
) -> int:
    """The CLI; ``demonstrate`` writes demos.jsonl's responses (a task built on this one
    passes its own)."""
    parser = argparse.ArgumentParser(description=description or __doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="write train.jsonl, test.jsonl and demos.jsonl")
    gen.add_argument("--out", required=True, help="output directory")
    gen.add_argument("--train", type=int, default=10_000, help="number of training records")
    gen.add_argument("--test", type=int, default=500, help="number of test records")
    gen.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train = generate(args.train, args.seed, "train")
    test = generate(args.test, args.seed, "test")
    _write_jsonl(out / "train.jsonl", train)
    _write_jsonl(out / "test.jsonl", test)
    _write_jsonl(
        out / "demos.jsonl",
        [{"id": r["id"], "prompt": r["prompt"], "response": demonstrate(r)} for r in train],
    )
    print(f"wrote {len(train)} train, {len(test)} test records and demos to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
