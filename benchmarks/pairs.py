"""Alternating pairs: how every ratio in ``benchmarks/`` is measured.

A ratio from one baseline run and one subject run is mostly noise on a shared 2-core machine: a
background job, a frequency step or a page-cache refill moves one side and not the other. So each
benchmark runs the baseline and the subject in turn, ``pairs`` times (at least three), takes one
ratio per pair, and reports the median ratio and the spread of the pair ratios. Drift that spans
the run hits both sides of each pair alike; a spread over 10% says the timed sections are too
short (or the machine too busy) for the median to mean much, and the report says so.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

#: Pairs agree when every pair ratio lies within this fraction of the median ratio.
AGREEMENT = 0.10


def alternate(
    baseline: Callable[[], float],
    subject: Callable[[], float],
    *,
    pairs: int = 3,
    higher_is_better: bool = True,
) -> dict[str, Any]:
    """Run ``baseline()`` then ``subject()``, ``pairs`` times; each returns one figure.

    The ratio of a pair is subject over baseline for rates (``higher_is_better``), baseline over
    subject for times, so a ratio above 1 always means the subject did better.
    """
    if pairs < 3:
        raise ValueError(f"at least three pairs are needed for a median and a spread, got {pairs}")
    base: list[float] = []
    subj: list[float] = []
    for _ in range(pairs):
        base.append(baseline())
        subj.append(subject())
    return summarise(base, subj, higher_is_better=higher_is_better)


def summarise(
    base: list[float], subj: list[float], *, higher_is_better: bool = True
) -> dict[str, Any]:
    """The median ratio and its spread for figures already measured in alternating pairs."""
    if len(base) != len(subj) or not base:
        raise ValueError("one subject figure per baseline figure, at least one pair")
    ratios = [s / b if higher_is_better else b / s for b, s in zip(base, subj, strict=True)]
    median = statistics.median(ratios)
    spread = (max(ratios) - min(ratios)) / median if median else float("inf")
    return {
        "ratio_median": median,
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "spread": spread,
        "pairs_agree": all(abs(r - median) <= AGREEMENT * median for r in ratios),
        "ratios": ratios,
        "baseline": base,
        "subject": subj,
        "baseline_median": statistics.median(base),
        "subject_median": statistics.median(subj),
    }


def describe(name: str, result: dict[str, Any], goal: float | None = None) -> str:
    """One line: ``name 0.93 (pairs 0.91..0.95, spread 4%, agree)`` and the goal's verdict."""
    line = (
        f"{name} {result['ratio_median']:.3f} (pairs {result['ratio_min']:.3f}.."
        f"{result['ratio_max']:.3f}, spread {result['spread']:.0%}, "
        f"{'pairs agree within 10%' if result['pairs_agree'] else 'PAIRS DISAGREE by over 10%'})"
    )
    if goal is not None:
        verdict = "meets" if result["ratio_median"] >= goal else "MISSES"
        line += f"; {verdict} the goal of >= {goal}"
    return line
