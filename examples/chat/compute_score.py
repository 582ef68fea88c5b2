"""The reward of the chat example, written as verl's custom reward functions are.

verl calls ``compute_score(data_source, solution_str, ground_truth, extra_info)`` on each response
(its ``custom_reward_function.path`` / ``name``); Laminar's data role calls it the same way
(``data.reward: examples/chat/compute_score.py:compute_score``, see docs/rewards.md). Nothing here
knows about Laminar: the file runs under verl unchanged.

A response ends with an answer line ``#<digit>``, as gsm8k's with ``#### <n>``, after working
lines (one per operation) or at once:

    7a+8=5
    5b-5=0
    0c+2=2
    #2

The score is 1.0 when the answer line's number is the ground truth, else 0.0. The dict's other
fields are logged per version (docs/rewards.md, *Results*): ``acc`` (the same as the score),
``format_ok`` (the response ends with an answer line and every line before it is a working line
``<digit><label><+|-><digit>=<digit>``) and ``shows_work`` (it has a working line at all).
"""

from __future__ import annotations

import re
from typing import Any

_ANSWER = re.compile(r"#(-?\d+)")
_LINE = re.compile(r"\d[a-zA-Z][+-]\d=\d")


def compute_score(
    data_source: str | None,
    solution_str: str,
    ground_truth: str,
    extra_info: dict[str, Any] | None = None,
) -> dict[str, float]:
    """``score``, ``acc``, ``format_ok`` and ``shows_work`` of one response (see above)."""
    lines = solution_str.strip().split("\n")
    answer = _ANSWER.fullmatch(lines[-1].strip())
    work = lines[:-1]
    correct = answer is not None and answer[1] == str(ground_truth).strip()
    formatted = answer is not None and all(_LINE.fullmatch(line.strip()) for line in work)
    return {
        "score": 1.0 if correct else 0.0,
        "acc": 1.0 if correct else 0.0,
        "format_ok": 1.0 if formatted else 0.0,
        "shows_work": 1.0 if any(_LINE.fullmatch(line.strip()) for line in lines) else 0.0,
    }
