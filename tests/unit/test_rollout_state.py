"""The rollout's phase machine (``roles/rollout/state.py``) in isolation: no engine, no loop.

Every legal transition, every illegal one raising, and the guards the service relies on: a load
waits for an empty flight table and no migration; a migration never overlaps a load or another
migration; only a stable version accepts migrated trajectories; the heartbeat flags mean what
the manager reads them as (the public phase, the repack planner).
"""

from __future__ import annotations

import itertools

import pytest

from laminar.roles.rollout.api import RolloutPhase, RolloutStats
from laminar.roles.rollout.flights import Flight, FlightTable
from laminar.roles.rollout.state import Phase, RolloutPhases, TransitionError
from laminar.trajectory import Assignment, SamplingParams

# (transition, phase before, phase after): the module docstring's table
LEGAL = [
    ("started", Phase.STARTING, Phase.GENERATING),
    ("newer_version", Phase.GENERATING, Phase.PAUSED_FOR_WEIGHTS),
    ("load", Phase.PAUSED_FOR_WEIGHTS, Phase.LOADING),
    ("switched", Phase.PAUSED_FOR_WEIGHTS, Phase.GENERATING),
    ("switched", Phase.LOADING, Phase.GENERATING),
]
PATH = {  # the transitions that reach each phase from STARTING
    Phase.STARTING: [],
    Phase.GENERATING: ["started"],
    Phase.PAUSED_FOR_WEIGHTS: ["started", "newer_version"],
    Phase.LOADING: ["started", "newer_version", "load"],
}


def _fire(m: RolloutPhases, name: str) -> None:
    method = getattr(m, name)
    method(0) if name == "load" else method()


def machine_in(phase: Phase) -> tuple[RolloutPhases, list[str]]:
    seen: list[str] = []
    m = RolloutPhases(on_change=lambda: seen.append("changed"))
    for name in PATH[phase]:
        _fire(m, name)
    assert m.phase is phase
    seen.clear()
    return m, seen


@pytest.mark.parametrize(("name", "before", "after"), LEGAL)
def test_each_legal_transition_moves_and_notifies(name, before, after):
    m, seen = machine_in(before)
    _fire(m, name)
    assert m.phase is after
    assert seen == ["changed"]


ILLEGAL = [
    (name, phase)
    for name, phase in itertools.product(["started", "newer_version", "load", "switched"], Phase)
    if not any(n == name and b is phase for n, b, _ in LEGAL)
]


@pytest.mark.parametrize(("name", "phase"), ILLEGAL)
def test_every_other_transition_raises_and_changes_nothing(name, phase):
    m, seen = machine_in(phase)
    with pytest.raises(TransitionError, match=phase.name):
        _fire(m, name)
    assert m.phase is phase and seen == []


def test_a_load_waits_for_no_flights_and_no_migration():
    m, _ = machine_in(Phase.PAUSED_FOR_WEIGHTS)
    assert not m.may_load(2)
    with pytest.raises(TransitionError, match="2 in flight"):
        m.load(2)
    m.begin_migration()  # a migration may hand some back: not drained even with none here
    assert not m.drained(0) and not m.may_load(0)
    with pytest.raises(TransitionError, match="migration under way"):
        m.load(0)
    m.end_migration()
    assert m.drained(0) and m.may_load(0)
    m.load(0)
    assert m.phase is Phase.LOADING
    assert not m.may_load(0)  # only from PAUSED_FOR_WEIGHTS: one load at a time


@pytest.mark.parametrize("phase", [Phase.STARTING, Phase.GENERATING])
def test_no_load_without_a_newer_version_waiting(phase):
    m, _ = machine_in(phase)
    assert m.drained(0) and not m.may_load(0)


def test_migrations_never_overlap_each_other_or_a_load():
    for phase in (Phase.STARTING, Phase.GENERATING, Phase.PAUSED_FOR_WEIGHTS):
        m, seen = machine_in(phase)
        m.begin_migration()
        assert m.migrating and seen == ["changed"]
        with pytest.raises(TransitionError, match="already under way"):
            m.begin_migration()
        m.end_migration()
        assert not m.migrating
        with pytest.raises(TransitionError, match="no migration"):
            m.end_migration()
    m, _ = machine_in(Phase.LOADING)
    with pytest.raises(TransitionError, match="loading"):
        m.begin_migration()
    assert not m.migrating


def test_only_a_stable_version_accepts_migrated_trajectories():
    accepting = {p: machine_in(p)[0].accepting for p in Phase}
    assert accepting == {
        Phase.STARTING: False,  # the engine is not up
        Phase.GENERATING: True,
        Phase.PAUSED_FOR_WEIGHTS: True,  # the load waits for them to finish or move
        Phase.LOADING: False,  # the version changes under them
    }


def test_takes_only_while_generating_and_not_drained_by_an_operator():
    for phase in Phase:
        m, _ = machine_in(phase)
        assert m.may_take is (phase is Phase.GENERATING)
        assert m.drain() is True and m.drain() is False  # True only when it changed
        assert not m.may_take and m.operator_drain
        assert m.resume() is True and m.resume() is False
        assert m.may_take is (phase is Phase.GENERATING)


def test_an_operator_drain_survives_a_weight_switch():
    m, _ = machine_in(Phase.GENERATING)
    m.drain()
    for name in ("newer_version", "load", "switched"):
        _fire(m, name)
    assert m.phase is Phase.GENERATING and m.operator_drain and not m.may_take


def test_took_records_a_dry_pool():
    m, seen = machine_in(Phase.GENERATING)
    m.took(0)
    assert m.starved and seen == ["changed"]
    m.took(3)
    assert not m.starved


def test_heartbeat_flags_keep_the_keys_and_meaning_other_roles_read():
    expected = {  # phase -> (paused_for_weights, what the manager shows)
        Phase.STARTING: (0.0, "running"),
        Phase.GENERATING: (0.0, "running"),
        Phase.PAUSED_FOR_WEIGHTS: (1.0, "switching"),
        Phase.LOADING: (1.0, "switching"),
    }
    for phase, (paused, shown) in expected.items():
        m, _ = machine_in(phase)
        stats = m.stats()
        assert stats == {
            "phase": float(list(RolloutPhase).index(RolloutPhase(shown))),
            "paused_for_weights": paused,
            "operator_drain": 0.0,
            "migrating": 0.0,
            "starved": 0.0,
        }
        assert m.public() == shown == RolloutStats.model_validate(stats).phase
    m, _ = machine_in(Phase.GENERATING)
    m.drain()
    assert m.stats()["operator_drain"] == 1.0 and m.public() is RolloutPhase.DRAINING
    m.begin_migration()
    assert m.stats()["migrating"] == 1.0 and m.public() is RolloutPhase.SWITCHING


def _flight(tid: str) -> Flight:
    a = Assignment(
        trajectory_id=tid,
        prompt_id="p",
        sample_index=0,
        prompt_token_ids=[1, 2],
        params=SamplingParams(),
        queued_at=0.0,
    )
    return Flight(a, version=0, started_at=0.0)


def test_the_flight_table_tells_waiters_when_flights_leave():
    seen: list[str] = []
    table = FlightTable(on_change=lambda: seen.append("changed"))
    table.add("a", _flight("a"))
    table.add("b", _flight("b"))
    table.add("c", _flight("c"))
    assert seen == [] and table.snapshot() == ["a", "b", "c"] and len(table) == 3
    assert table.pop("nope") is None and seen == []
    assert table.pop("a") is not None and seen == ["changed"]
    assert table.pop("b", quiet=True) is not None and seen == ["changed"]
    table.changed()
    assert seen == ["changed", "changed"]
    assert set(table.pop_many(["c", "nope"])) == {"c"} and not table


def test_a_flight_reports_only_what_the_data_role_has_not_acknowledged():
    f = _flight("t")
    assert f.unsent("t") is None
    f.tokens, f.logprobs, f.acked = [5, 6, 7], [-0.1, -0.2, -0.3], 1
    chunk = f.unsent("t")
    assert chunk is not None
    assert (chunk.offset, chunk.token_ids, chunk.logprobs) == (1, [6, 7], [-0.2, -0.3])
    f.acked = 3
    assert f.unsent("t") is None
