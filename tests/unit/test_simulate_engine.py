"""The simulator's cost models and its closed-form engine (``laminar/simulate``).

* The decode roofline reproduces the paper's measured 7B step times (Fig. 4) within 10%, and the
  relay chain formula its measured broadcast latencies (Fig. 18) within 15%.
* The engine's jumps from event to event give exactly what a token-by-token loop over the same
  step-time function gives (a reference written here, one step at a time), for equal and for
  long-tailed lengths, and with a KV cache small enough to force preemptions.
* Nothing is lost or counted twice: every sequence finishes once with its full length, also
  after being taken out mid-way and continued on another engine.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from laminar.engines.costmodel import PAPER_FIG4_7B
from laminar.simulate.costs import (
    QWEN25_7B,
    QWEN25_32B,
    QWEN25_72B,
    ModelShape,
    Roofline,
    chain_broadcast,
)
from laminar.simulate.engine import Sequence, SimEngine

FIG18 = {  # machines: (32B, 72B) seconds, paper Fig. 18
    4: (0.42, 0.95), 8: (0.49, 1.10), 16: (0.55, 1.23), 32: (0.61, 1.37), 64: (0.67, 1.50),
    128: (0.73, 1.62),
}  # fmt: skip


@pytest.mark.parametrize(("batch", "seconds"), PAPER_FIG4_7B)  # 7B, context 4096
def test_the_roofline_reproduces_the_measured_7b_decode_steps(batch: int, seconds: float) -> None:
    step = Roofline(QWEN25_7B).decode_step(batch, batch * 4096)
    assert abs(step - seconds) <= 0.1 * seconds, (batch, step, seconds)


@pytest.mark.parametrize("machines", sorted(FIG18))
def test_the_relay_chain_model_matches_the_measured_broadcasts(machines: int) -> None:
    for model, measured in zip((QWEN25_32B, QWEN25_72B), FIG18[machines], strict=True):
        modelled = chain_broadcast(model.weight_bytes, machines)
        assert abs(modelled - measured) <= 0.15 * measured, (model.name, machines, modelled)


def test_bigger_models_on_more_gpus_hold_sensible_caches() -> None:
    for model, tp in ((QWEN25_7B, 1), (QWEN25_32B, 4), (QWEN25_72B, 8)):
        roofline = Roofline(model, tp)
        assert 500_000 < roofline.kv_capacity_tokens < 3_000_000, model.name
        assert 32 <= roofline.roofline_batch() <= 256, model.name


def reference(engine: SimEngine, sequences: list[Sequence]) -> dict[int, float]:
    """Token by token, the same rules: FIFO admission under the watermark, prefill before the
    next step, the last admitted preempted when the cache is full."""
    r, cap = engine.roofline, engine.roofline.kv_capacity_tokens
    now, waiting, running, done = 0.0, list(sequences), [], {}
    while waiting or running:
        used = sum(s.context for s in running)
        new = []
        while waiting and len(running) + len(new) < engine.max_running:
            if used + waiting[0].context > cap * 0.99:
                break
            seq = waiting.pop(0)
            used += seq.context
            new.append(seq)
        now += r.prefill(sum(s.context for s in new))
        running += new
        room = cap - sum(s.context for s in running)
        if room < len(running):  # full: the last admitted goes back to the front
            waiting.insert(0, running.pop())
            continue
        now += r.decode_step(len(running), sum(s.context for s in running))
        for s in running:
            s.generated += 1
        for s in [s for s in running if s.generated >= s.target]:
            done[s.id] = now
            running.remove(s)
    return done


def toy(kv_tokens: int) -> Roofline:
    """A small model whose step time grows visibly with context, and a cache of ``kv_tokens``."""
    shape = ModelShape("toy", 5e8, layers=2, kv_heads=2, head_dim=64, hidden=512)
    fraction = (shape.weight_bytes + kv_tokens * shape.kv_bytes_per_token) / (80 * 2**30)
    return Roofline(shape, memory_fraction=fraction)


def sequences(lengths: list[int], prompt: int = 50) -> list[Sequence]:
    return [Sequence(i, prompt, n) for i, n in enumerate(lengths)]


@pytest.mark.parametrize(
    ("lengths", "kv_tokens"),
    [
        ([300] * 16, 1_000_000),  # one event: all finish together
        (list(np.random.default_rng(0).integers(5, 900, 40)), 1_000_000),  # a tail
        (list(np.random.default_rng(1).integers(5, 900, 40)), 6_000),  # preemptions
    ],
)
def test_event_jumps_equal_a_token_by_token_loop(lengths: list[int], kv_tokens: int) -> None:
    engine = SimEngine(toy(kv_tokens), max_running=32)
    engine.add(sequences(lengths), at=0.0)
    done = {i: t for i, t, _ in engine.run_until(math.inf)}
    expected = reference(SimEngine(toy(kv_tokens), max_running=32), sequences(lengths))
    assert done.keys() == expected.keys()
    for i, t in expected.items():
        assert done[i] == pytest.approx(t, rel=1e-9), i
    assert engine.stats.decode_tokens == sum(lengths)
    if kv_tokens < 10_000:
        assert engine.stats.preemptions > 0 and engine.stats.recompute_tokens > 0


def test_taken_out_and_continued_elsewhere_nothing_is_lost_or_doubled() -> None:
    lengths = list(np.random.default_rng(2).integers(10, 2000, 64))
    a, b = SimEngine(toy(100_000), max_running=16), SimEngine(toy(100_000), max_running=16)
    a.add(sequences(lengths), at=0.0)
    early = a.run_until(0.5)
    moved = a.take(at=0.5, keep_kv=True)
    assert {s.id for s in moved}.isdisjoint(i for i, _, _ in early)
    assert len(early) + len(moved) == len(lengths) and a.in_flight == 0
    assert any(s.generated > 0 for s in moved)
    b.add(moved, at=0.5)
    late = b.run_until(math.inf)
    finished = early + late
    assert sorted(i for i, _, _ in finished) == list(range(len(lengths)))
    assert all(n == lengths[i] for i, _, n in finished)
    assert a.stats.decode_tokens + b.stats.decode_tokens == sum(lengths)
    # moved with their KV: only the ones that had not started are prefilled on arrival
    assert b.stats.recompute_tokens == 0


def test_running_until_a_time_stops_within_one_step_of_it() -> None:
    engine = SimEngine(toy(1_000_000))
    engine.add(sequences([10_000] * 4), at=0.0)
    assert engine.run_until(1.0) == []
    step = engine.roofline.decode_step(4, engine.kv_tokens)
    assert 1.0 - step <= engine.now <= 1.0
    assert engine.next_finish() > 1.0


def test_a_sequence_bigger_than_the_cache_is_a_clear_error() -> None:
    engine = SimEngine(toy(1_000))
    with pytest.raises(ValueError, match="KV cache"):
        engine.add(sequences([10], prompt=5_000), at=0.0)


@pytest.mark.parametrize("seed", [3, 4])
@pytest.mark.parametrize("system", ["areal", "laminar"])
def test_continuous_systems_train_every_trajectory_once(system: str, seed: int) -> None:
    """Small batches on a few 7B rollouts: every update takes whole, distinct trajectories; the
    trainer's order is completion order; Laminar's staleness stays bounded and its repack moves
    trajectories; AReaL recomputes what each publish aborted."""
    from laminar.simulate.continuous import run_continuous
    from laminar.simulate.costs import train_cost
    from laminar.simulate.workload import Lengths, Placement, Setup

    place = Placement(total=8, train=4, rollout=4, tp=1)
    setup = Setup(Roofline(QWEN25_7B), place, train_cost(QWEN25_7B, 4), Lengths("7B"))
    out = run_continuous(system, setup, iterations=6, seed=seed, max_in_flight=64, batch=128)
    assert len(out.updates) == 6 and out.updates == sorted(out.updates)
    assert len(out.trained) == 6 * 128 and len(set(out.trained)) == len(out.trained)
    if system == "laminar":
        assert max(out.staleness) <= 6 and min(out.staleness) >= 0
    else:
        assert out.recompute_tokens > 0


@pytest.mark.parametrize("system", ["verl", "one_step", "stream", "rollpacker", "areal", "laminar"])
def test_every_system_runs_a_paper_cell(system: str) -> None:
    """7B on 16 GPUs (Table 2's placement), the paper's batch: updates come in order, and no
    system trains faster than its trainer's GPUs allow (the cost model's ceiling)."""
    from laminar.simulate.cells import run_cell
    from laminar.simulate.costs import train_cost
    from laminar.simulate.workload import placement

    cell = run_cell(system, "7B", 16, warmup=1, measured=1)
    ceiling = train_cost(QWEN25_7B, placement(system, "7B", 16).train).tokens_per_s()
    assert 0 < cell.tokens_per_s <= ceiling, (cell, ceiling)
    assert cell.iteration_s > 0
