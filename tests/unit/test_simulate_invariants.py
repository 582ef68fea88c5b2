"""The simulator's own invariants (issue 18, "Done means"), on the systems' full runners.

* **Decode only, closed form.** With every cost but decode turned off (``Setup(overheads=False)``:
  no training time, no weight movement, no KV transfer; prefill free; a decode step of constant
  length; every response of one length), each system's throughput has a closed form, and the
  runners must reproduce it exactly: a batch of ``B`` trajectories of ``P + L`` tokens, dealt to
  ``R`` engines that all decode at once, takes ``L`` steps, so an update comes every ``L * STEP``
  seconds and tokens/s = ``B (P + L) / (L STEP)``. The continuous systems keep ``B / R`` in flight
  per engine, so the same holds for them. Anything that charged a hidden cost, dropped a step or
  double-counted a token breaks the equality.
* **Nothing lost or counted twice at 1024 GPUs.** Laminar on the paper's top scale (72B, Table 2's
  1024-GPU placement, the paper's batch, repack on): every trained trajectory id is distinct, and
  every trajectory ever started is trained, still in an engine (counted by the engines) or
  finished and waiting for the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from laminar.simulate.batches import run_batches
from laminar.simulate.cells import cell_setup
from laminar.simulate.continuous import run_continuous
from laminar.simulate.costs import QWEN25_7B, Roofline, train_cost
from laminar.simulate.workload import (
    BATCH,
    PROMPT_TOKENS,
    Lengths,
    Placement,
    Setup,
)

STEP = 0.02  # seconds per decode step, whatever the batch
LENGTH = 300  # every response
ENGINES = 16


@dataclass(frozen=True)
class ConstantStep(Roofline):
    """A decode step of ``STEP`` seconds at any batch and context; prefill free."""

    def decode_step(self, batch: int, context_tokens: float) -> float:
        return STEP if batch > 0 else 0.0

    def prefill(self, tokens: float) -> float:
        return 0.0


@dataclass(frozen=True)
class OneLength(Lengths):
    def responses(
        self, rng: np.random.Generator, difficulty: np.ndarray, per_prompt: int
    ) -> np.ndarray:
        return np.full((difficulty.size, per_prompt), LENGTH, dtype=np.int64)


def decode_only() -> Setup:
    place = Placement(total=2 * ENGINES, train=ENGINES, rollout=ENGINES, tp=1)
    return Setup(
        ConstantStep(QWEN25_7B),
        place,
        train_cost(QWEN25_7B, ENGINES),
        OneLength("7B"),
        overheads=False,
    )


CLOSED_FORM = BATCH * (PROMPT_TOKENS + LENGTH) / (LENGTH * STEP)


def steady_rate(updates: list[float], tokens: list[int], skip: int = 2) -> float:
    gaps = np.diff(updates[skip:])
    return sum(tokens[skip + 1 :]) / float(gaps.sum())


@pytest.mark.parametrize("system", ["verl", "one_step", "stream", "rollpacker"])
def test_batch_systems_reproduce_the_decode_only_closed_form(system: str) -> None:
    updates, tokens = run_batches(system, decode_only(), iterations=7, seed=0)
    assert set(tokens) == {BATCH * (PROMPT_TOKENS + LENGTH)}
    assert steady_rate(updates, tokens) == pytest.approx(CLOSED_FORM, rel=1e-9)


@pytest.mark.parametrize("system", ["areal", "laminar"])
def test_continuous_systems_reproduce_the_decode_only_closed_form(system: str) -> None:
    out = run_continuous(
        system, decode_only(), iterations=7, seed=0, max_in_flight=BATCH // ENGINES
    )
    assert set(out.tokens) == {BATCH * (PROMPT_TOKENS + LENGTH)}
    assert steady_rate(out.updates, out.tokens) == pytest.approx(CLOSED_FORM, rel=1e-9)
    assert out.recompute_tokens == 0 or system == "areal"  # AReaL re-prefills (for free here)


def test_with_overheads_the_same_runs_are_slower() -> None:
    """The switch is what the closed form rests on: on, the same decode-only setup pays for
    training and weights, and each system falls below the closed form."""
    base = decode_only()
    full = Setup(base.roofline, base.place, base.train, base.lengths)
    for system in ("verl", "one_step"):
        updates, tokens = run_batches(system, full, iterations=6, seed=0)
        assert steady_rate(updates, tokens) < 0.99 * CLOSED_FORM
    out = run_continuous("laminar", full, iterations=6, seed=0, max_in_flight=BATCH // ENGINES)
    assert steady_rate(out.updates, out.tokens) < 0.99 * CLOSED_FORM


@pytest.mark.parametrize("seed", [0, 1])
def test_laminar_at_1024_gpus_loses_and_doubles_nothing(seed: int) -> None:
    setup = cell_setup("laminar", "72B", 1024)  # what run_cell("laminar", "72B", 1024) runs
    out = run_continuous("laminar", setup, iterations=4, seed=seed)
    assert len(out.trained) == len(set(out.trained)) == 4 * BATCH
    assert all(0 <= sid < out.issued for sid in out.trained)
    assert len(out.trained) + out.in_flight + out.queued == out.issued
    assert out.migrated > 0  # repack moved trajectories between rollouts meanwhile
