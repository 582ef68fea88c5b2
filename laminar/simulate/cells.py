"""One cell of the sweep: a system, a model, a GPU count -> tokens/s (the paper's metric).

Tokens/s = (prompt + response tokens of a global batch) / the gap between consecutive actor
updates, averaged over ``measured`` updates after ``warmup`` (the paper: 5 after 10; fewer here by
default, the steady state comes within a few).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from .batches import run_batches
from .continuous import run_continuous
from .costs import EAGER_STEP_S, Roofline, train_cost
from .workload import Lengths, Setup, model_shape, placement

#: Systems built on verl, whose rollouts run vLLM eagerly (``laminar.simulate.costs``).
EAGER_SYSTEMS = ("verl", "one_step", "stream", "rollpacker")


@dataclass
class Cell:
    system: str
    model: str
    gpus: int
    tokens_per_s: float
    iteration_s: float
    train_gpus: int
    rollout_gpus: int
    extra: dict[str, Any] = field(default_factory=dict)


def cell_setup(system: str, model: str, gpus: int) -> Setup:
    """What ``system`` runs on for ``model`` at Table 2's ``gpus`` placement: its engines' costs
    (decoding eagerly for the verl-based systems), the placement, the trainer, the lengths."""
    shape = model_shape(model)
    place = placement(system, model, gpus)
    eager = EAGER_STEP_S if system in EAGER_SYSTEMS else 0.0
    roofline = Roofline(shape, place.tp, eager_step_s=eager)
    return Setup(roofline, place, train_cost(shape, place.train), Lengths(model))


def run_cell(
    system: str, model: str, gpus: int, *, seed: int = 0, warmup: int = 2, measured: int = 4
) -> Cell:
    start = time.perf_counter()
    setup = cell_setup(system, model, gpus)
    place = setup.place
    total = warmup + measured + 1
    extra: dict[str, Any] = {}
    if system in ("areal", "laminar"):
        out = run_continuous(system, setup, total, seed)
        updates, tokens = out.updates, out.tokens
        extra = {
            "recompute_tokens": out.recompute_tokens,
            "migrated": out.migrated,
            "staleness_max": max(out.staleness, default=0),
        }
    else:
        updates, tokens = run_batches(system, setup, total, seed)
    gaps = [b - a for a, b in zip(updates[warmup:], updates[warmup + 1 :], strict=False)]
    measured_tokens = tokens[warmup + 1 :]
    iteration = sum(gaps) / len(gaps)
    extra["wall_s"] = time.perf_counter() - start
    return Cell(
        system, model, gpus, sum(measured_tokens) / sum(gaps), iteration, place.train,
        place.rollout, extra,
    )  # fmt: skip
