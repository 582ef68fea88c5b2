"""Clock arithmetic with a calculator: the arith task, where the model may call a sandboxed tool.

The problems are ``examples/arith``'s (a start digit and k labelled ``+d`` / ``-d`` operations on
a ten-digit wheel; k long-tailed, median 4). The response writes one line per operation, as
there, but a line may end in a tool call instead of the model's own result::

    prompt:    "7c+2b-5a+8=\\n"
    response:  "7a+8?5\\n5b-5=0\\n0c+2?2\\n#2"
                    ^^ the model wrote "7a+8?"; "5" is the calculator's answer (not trained on)

``?`` ends the model's turn (the environment's stop string); :class:`Calculator` reads the line's
expression, evaluates it in the sandbox (:func:`laminar.tools.sandbox.run_python`: a subprocess
without network, token or more than a second of CPU) and answers the digit, or ``!`` for a call it
cannot read. The final turn, ending with ``#answer`` and EOS, earns 1.0 if the answer is right.
An episode has at most :data:`MAX_TURNS` model turns.

Why this shows tool use being learned: the warm start (``laminar sft`` on :func:`demonstration`)
sees a call on only :data:`TOOL_RATE` of the lines, so greedy decoding at first never calls it and
computes by itself, which a small model gets wrong more often on long chains. Under sampling
(temperature 1) about a third of the lines do call it, and those lines are always right. RL can
therefore raise accuracy by calling the tool more: the README reports held-out accuracy and tool
calls per episode before and after.

Latency: each call also waits a simulated remote-tool latency, log-normal with median
:data:`LATENCY_MEDIAN_S` and sigma :data:`LATENCY_SIGMA` (p99 ~ 10x the median), drawn from a hash
of the record and the call (deterministic, so a replayed episode waits the same).

CLI (the same as arith's)::

    python examples/arith_tool/task.py generate --out DIR --train N --test M --seed S
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import re
import sys
import zlib
from pathlib import Path
from statistics import NormalDist
from typing import Any

from laminar.tools.env import Environment, Step
from laminar.tools.sandbox import SandboxLimits, run_python


def _load_arith() -> Any:
    path = Path(__file__).resolve().parent.parent / "arith" / "task.py"
    name = "laminar_example_arith_task"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


arith = _load_arith()

#: the tool call (ends a model turn) and the calculator's "cannot read that" answer
CALL, BAD = "?", "!"
ALPHABET = arith.ALPHABET + CALL + BAD
LABELS = arith.LABELS
#: share of demonstration lines that call the calculator (by a hash of the record and line)
TOOL_RATE = 0.3
#: most model turns per episode: a 12-step chain calling the tool on every line has 13
MAX_TURNS = 16
#: the simulated remote tool's latency (seconds): log-normal, median and sigma
LATENCY_MEDIAN_S = 0.05
LATENCY_SIGMA = 1.0
#: the sandbox's limits for one call
LIMITS = SandboxLimits(cpu_s=1, wall_s=5, memory_mib=256, output_bytes=1024)

SFT_STOP_AT = arith.SFT_STOP_AT
SFT_CURRICULUM = arith.SFT_CURRICULUM

_CALL_LINE = re.compile(r"(\d)([a-zA-Z])([+-])(\d)\?$")
_ANSWER = re.compile(r"#\s*(-?\d+)")


def generate(n: int, seed: int, split: str = "train", max_digit: int = 9) -> list[dict[str, Any]]:
    """arith's records (the same problems and splits)."""
    return list(arith.generate(n, seed, split, max_digit))


def _calls(record: dict[str, Any], line: int) -> bool:
    h = zlib.crc32(f"{record.get('id', record['prompt'])}/{line}".encode()) % 1000
    return h < TOOL_RATE * 1000


def demonstration(record: dict[str, Any]) -> str:
    """arith's demonstration, with :data:`TOOL_RATE` of its lines calling the calculator (the
    digit after ``?`` is then the calculator's answer)."""
    lines = arith.demonstration(record).split("\n")
    out = []
    for i, line in enumerate(lines):
        if "=" in line and _calls(record, i):
            line = line.replace("=", CALL)
        out.append(line)
    return "\n".join(out)


def reward(record: dict[str, Any], response: str) -> float:
    """The whole response's score (arith's rule: the number after the first ``#``)."""
    return float(arith.reward(record, response))


class Calculator(Environment):
    """The episode's environment: answers ``?`` calls, scores the final ``#answer``."""

    stop = (CALL,)

    async def reset(self, record: dict[str, Any]) -> None:
        self.record = record
        self.calls = 0

    async def step(self, action: str) -> Step:
        if "#" in action or not action.endswith(CALL):  # the final turn
            match = _ANSWER.search(action)
            right = match is not None and int(match.group(1)) == int(self.record["answer"])
            return Step(reward=1.0 if right else 0.0, done=True)
        self.calls += 1
        await asyncio.sleep(self._latency())
        match = _CALL_LINE.search(action)
        if match is None:
            return Step(observation=BAD)
        value, _, op, d = match.groups()
        result = await run_python(f"print(({value} {op} {d}) % 10)", LIMITS)
        digit = result.stdout.strip() if result.ok else ""
        return Step(observation=digit if len(digit) == 1 and digit.isdigit() else BAD)

    def _latency(self) -> float:
        h = zlib.crc32(f"{self.record.get('id')}/{self.calls}".encode())
        u = (h % 100_000 + 0.5) / 100_000
        return LATENCY_MEDIAN_S * math.exp(LATENCY_SIGMA * NormalDist().inv_cdf(u))


ENVIRONMENT = Calculator


def main(argv: list[str] | None = None) -> int:
    """arith's ``generate`` (the same records), with this task's demonstrations."""
    code = int(arith.main(argv))
    args = list(argv if argv is not None else sys.argv[1:])
    out = Path(args[args.index("--out") + 1])
    rows = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    demos = [{"id": r["id"], "prompt": r["prompt"], "response": demonstration(r)} for r in rows]
    (out / "demos.jsonl").write_text("".join(json.dumps(d) + "\n" for d in demos))
    return code


if __name__ == "__main__":
    raise SystemExit(main())
