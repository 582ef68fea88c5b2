"""Clock arithmetic with a tool: arith's problems, where the model may call a calculator.

The problems are ``examples/arith``'s: a start digit and k labelled operations ``+d`` / ``-d`` on a
ten-digit wheel, k long-tailed (median 4), listed last first. The response writes one line per
operation, as there, but a line may hand the step to the calculator: the model writes the running
value, the operation's label and ``?``; the calculator, which holds the problem (the environment
is reset with its record), answers the operation and its result::

    prompt:    "7c+2b-5a+8=\n"
    response:  "7a?+8=5\n5b-5=0\n0c?+2=2\n#2"
                   ^^^^ the model wrote "7a?"; "+8=5" is the calculator's answer (not trained on)

``?`` ends the model's turn (the environment's stop string). :class:`Calculator` looks the label's
operation up and evaluates the step in the sandbox (:func:`laminar.tools.sandbox.run_python`: a
subprocess without network, token or more than a second of CPU), or answers ``!`` for a call it
cannot read. The final turn, ending with ``#answer`` and EOS, earns 1.0 if the answer is right.
An episode has at most :data:`MAX_TURNS` model turns.

Why a tool that knows the problem: what the small model gets wrong on long chains is finding
operation i among k (arith's README: errors grow with i), not the mod-10 sum. A tool that looks
the operation up (a search tool, in an agent's terms) and computes the step makes a called line
always right; the model's part is the running value, the next label and when to call. The warm
start (``laminar sft`` on :func:`demonstration`) sees a call on :data:`TOOL_RATE` of the lines, a
hash of the record and the line deciding which, so it has learned *that* it may call but not
*where* it needs to; RL can raise accuracy by calling the tool where the model would slip.
docs/benchmarks.md (*Learning*) reports held-out accuracy and tool calls per episode, by chain
length, before and after.

Latency: each call also waits a simulated remote-tool latency, log-normal with median
:data:`LATENCY_MEDIAN_S` and sigma :data:`LATENCY_SIGMA` (p99 ~ 10x the median), drawn from a hash
of the record and the call (deterministic, so a replayed episode waits the same).

CLI (arith's records, this task's demonstrations)::

    python examples/arith_tool/task.py generate --out DIR --train N --test M --seed S
"""

from __future__ import annotations

import asyncio
import importlib.util
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
#: share of demonstration lines that call the calculator (by a hash of the record and line).
#: Why half: at 0.3 greedy decoding of the warm start almost never called (0.0-0.4 calls per
#: episode) and RL's gain hung on whether sampled calls took hold (+5.6 to +18.2 points over
#: seeds 0-2); at 0.5 the warm start calls 1-6 times an episode and RL ended 6 points higher on
#: average (0.707 against 0.643 held out; docs/benchmarks.md, *Learning*)
TOOL_RATE = 0.5
#: most model turns per episode: a 12-step chain calling the tool on every line has 13
MAX_TURNS = 16
#: the simulated remote tool's latency (seconds): log-normal, median and sigma
LATENCY_MEDIAN_S = 0.05
LATENCY_SIGMA = 1.0
#: the sandbox's limits for one call
LIMITS = SandboxLimits(cpu_s=1, wall_s=5, memory_mib=256, output_bytes=1024)

#: the warm start: arith's recipe
SFT_STOP_AT = arith.SFT_STOP_AT
SFT_CURRICULUM = arith.SFT_CURRICULUM

_CALL_LINE = re.compile(r"(\d)([a-zA-Z])\?$")
_ANSWER = re.compile(r"#\s*(-?\d+)")


def generate(n: int, seed: int, split: str = "train", max_digit: int = 9) -> list[dict[str, Any]]:
    """arith's records (the same problems and splits)."""
    return list(arith.generate(n, seed, split, max_digit))


def _calls(record: dict[str, Any], line: int) -> bool:
    h = zlib.crc32(f"{record.get('id', record['prompt'])}/{line}".encode()) % 1000
    return h < TOOL_RATE * 1000


def demonstration(record: dict[str, Any]) -> str:
    """arith's demonstration, with :data:`TOOL_RATE` of its lines calling the calculator: a
    line ``7a+8=5`` becomes ``7a?+8=5``, ``+8=5`` being the calculator's answer."""
    lines = arith.demonstration(record).split("\n")
    for i, line in enumerate(lines):
        if "=" in line and _calls(record, i):
            lines[i] = line[:2] + CALL + line[2:]
    return "\n".join(lines)


def reward(record: dict[str, Any], response: str) -> float:
    """The whole response's score (arith's rule: the number after the first ``#``)."""
    return float(arith.reward(record, response))


class Calculator(Environment):
    """The episode's environment: answers ``{value}{label}?`` calls, scores ``#answer``."""

    stop = (CALL,)

    async def reset(self, record: dict[str, Any]) -> None:
        self.record = record
        self.calls = 0
        _, ops = arith._parse(record["prompt"])
        self.ops = {LABELS[i]: op for i, op in enumerate(ops)}

    async def step(self, action: str) -> Step:
        if "#" in action or not action.endswith(CALL):  # the final turn
            match = _ANSWER.search(action)
            right = match is not None and int(match.group(1)) == int(self.record["answer"])
            return Step(reward=1.0 if right else 0.0, done=True)
        self.calls += 1
        await asyncio.sleep(self._latency())
        match = _CALL_LINE.search(action)
        if match is None or match.group(2) not in self.ops:
            return Step(observation=BAD)
        value, label = int(match.group(1)), match.group(2)
        op, d = self.ops[label]
        result = await run_python(f"print({value} {op} {d})", LIMITS)  # the sandboxed tool
        out = result.stdout.strip() if result.ok else ""
        if not re.fullmatch(r"-?\d+", out):
            return Step(observation=BAD)
        return Step(observation=f"{op}{d}={int(out) % arith.MODULUS}")

    def _latency(self) -> float:
        h = zlib.crc32(f"{self.record.get('id')}/{self.calls}".encode())
        u = (h % 100_000 + 0.5) / 100_000
        return LATENCY_MEDIAN_S * math.exp(LATENCY_SIGMA * NormalDist().inv_cdf(u))


ENVIRONMENT = Calculator


def main(argv: list[str] | None = None) -> int:
    return int(arith.main(argv, demonstration, __doc__.split("\n")[0]))


if __name__ == "__main__":
    raise SystemExit(main())
