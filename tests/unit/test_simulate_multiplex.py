"""RollMux's phase multiplexing (``laminar/simulate/multiplex.py``) against hand-computed cases.

With a decode step of constant length, one response length and no weight costs to speak of, a
batch generates in ``G = L * STEP`` seconds and trains in ``T``. One job alone takes ``G + T`` per
batch; two jobs in round robin keep the rollout pool busy whenever ``T <= G``, so both together
make one batch per ``G`` (gain ``(G + T) / G``), and when ``T > G`` the trainer is the bottleneck
(one batch per ``T``, gain ``(G + T) / T``). ``T = 0`` gains nothing, ``T = G`` doubles.
"""

from __future__ import annotations

import pytest

from laminar.engines.costmodel import TrainCostModel
from laminar.simulate.costs import ModelShape
from laminar.simulate.multiplex import run_jobs, run_multiplexed
from laminar.simulate.workload import BATCH, PROMPT_TOKENS, Placement, Setup

from .test_simulate_invariants import ENGINES, LENGTH, STEP, ConstantStep, OneLength

TINY = ModelShape("tiny", 1e3, layers=1, kv_heads=1, head_dim=8, hidden=8)  # weights ~ free
G = LENGTH * STEP


def setup(train_s: float) -> Setup:
    place = Placement(total=2 * ENGINES, train=ENGINES, rollout=ENGINES, tp=1)
    train = TrainCostModel(flops_per_token=1e-9, gpus=ENGINES, base_s=train_s)
    return Setup(ConstantStep(TINY), place, train, OneLength("7B"))


@pytest.mark.parametrize("train_s", [0.0, 0.5 * G, G, 2 * G])
def test_round_robin_gains_what_the_idle_phases_allow(train_s: float) -> None:
    batch_tokens = BATCH * (PROMPT_TOKENS + LENGTH)
    solo, solo_busy = run_jobs(setup(train_s), 1, iterations=5, seed=0)
    both, both_busy = run_jobs(setup(train_s), 2, iterations=5, seed=0)
    assert solo == pytest.approx(batch_tokens / (G + train_s), rel=1e-3)
    assert both == pytest.approx(batch_tokens / max(G, train_s), rel=1e-3)
    assert solo_busy == pytest.approx(G / (G + train_s), rel=1e-3)
    if train_s:
        assert both_busy > solo_busy


def test_a_paper_cell_gains_within_the_two_pools_bound() -> None:
    """7B on 16 GPUs: both pools are busy part of the time, so two jobs gain, at most 2x."""
    cell = run_multiplexed("7B", 16, iterations=3)
    assert 1.2 < cell.efficiency_gain <= 2.0
    assert cell.rollout_busy_multiplexed > cell.rollout_busy_solo
