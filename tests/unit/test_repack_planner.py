"""The repack planner (Algorithm 1): properties over random clusters, and worked examples."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from laminar.repack import RepackPlan, RepackPolicy, RolloutLoad, is_candidate, plan_repack


@st.composite
def clusters(draw):
    n = draw(st.integers(0, 14))
    versions = draw(st.lists(st.integers(3, 5), min_size=n, max_size=n))
    loads = []
    for i, version in enumerate(versions):
        kv = draw(st.floats(0, 1, allow_nan=False))
        loads.append(
            RolloutLoad(
                rollout=f"r{i:02d}",
                version=version,
                kv_used=kv,
                kv_prev=draw(st.floats(0, 1, allow_nan=False)),
                n_reqs=draw(st.integers(0, 40)),
                waiting=draw(st.sampled_from([0, 0, 0, 2])),
                draining=draw(st.booleans()),
                accepting=draw(st.sampled_from([True, True, True, False])),
            )
        )
    policy = RepackPolicy(
        c_max=draw(st.floats(0.3, 1.0, allow_nan=False)),
        batch_limit=draw(st.integers(1, 64)),
        require_draining=draw(st.booleans()),
    )
    return loads, policy


def apply(loads: list[RolloutLoad], plan: RepackPlan) -> dict[str, tuple[float, int]]:
    after = {r.rollout: (r.kv_used, r.n_reqs) for r in loads}
    for m in plan.moves:
        kv, n = after[m.destination]
        after[m.destination] = (kv + m.kv_used, n + m.n_reqs)
        after[m.source] = (0.0, 0)
    return after


@settings(max_examples=400, deadline=None)
@given(clusters())
def test_plan_invariants(cluster):
    loads, policy = cluster
    plan = plan_repack(loads, policy)
    by_id = {r.rollout: r for r in loads}
    sources = [m.source for m in plan.moves]
    destinations = {m.destination for m in plan.moves}

    # no rollout is both a source and a destination; each source is emptied exactly once
    assert not set(sources) & destinations
    assert len(sources) == len(set(sources))
    # only same-version moves, only between candidates
    for m in plan.moves:
        assert by_id[m.source].version == by_id[m.destination].version == m.version
        assert is_candidate(by_id[m.source], policy)
        assert is_candidate(by_id[m.destination], policy) and by_id[m.destination].accepting
        assert m.n_reqs == by_id[m.source].n_reqs and m.kv_used == by_id[m.source].kv_used
    # every moved trajectory lands exactly once: in-flight counts are conserved per version
    after = apply(loads, plan)
    before_n, after_n = Counter(), Counter()
    for r in loads:
        before_n[r.version] += r.n_reqs
        after_n[r.version] += after[r.rollout][1]
    assert before_n == after_n
    # no destination exceeds C_max or B
    for d in destinations:
        kv, n = after[d]
        assert kv <= policy.c_max + 1e-9
        assert n <= policy.batch_limit
    # best fit leaves nothing on the table: no leftover candidate fits any rollout still there
    released = set(sources)
    for s in loads:
        if s.rollout in released or s.rollout in destinations or not is_candidate(s, policy):
            continue
        for d in loads:
            if d.rollout == s.rollout or d.rollout in released or d.version != s.version:
                continue
            if not is_candidate(d, policy) or not d.accepting:
                continue
            kv, n = after[d.rollout]
            assert not (kv + s.kv_used <= policy.c_max and n + s.n_reqs <= policy.batch_limit)


@settings(max_examples=100, deadline=None)
@given(clusters(), st.randoms())
def test_plan_does_not_depend_on_input_order(cluster, rnd):
    loads, policy = cluster
    shuffled = list(loads)
    rnd.shuffle(shuffled)
    assert plan_repack(shuffled, policy) == plan_repack(loads, policy)


def load(name, kv, n, *, version=1, prev=None, draining=True, waiting=0, accepting=True):
    return RolloutLoad(
        rollout=name,
        version=version,
        kv_used=kv,
        kv_prev=prev if prev is not None else kv,
        n_reqs=n,
        waiting=waiting,
        draining=draining,
        accepting=accepting,
    )


def test_tails_consolidate_onto_the_densest():
    # four rollouts draining for a new version, each with a few long tails
    loads = [load("a", 0.05, 2), load("b", 0.10, 3), load("c", 0.20, 4), load("d", 0.30, 5)]
    plan = plan_repack(loads, RepackPolicy(c_max=0.99, batch_limit=64))
    # smallest first, each to the destination densest after the move: everything ends on d
    assert [(m.source, m.destination) for m in plan.moves] == [("a", "d"), ("b", "d"), ("c", "d")]
    assert plan.released == ["a", "b", "c"] and plan.destinations == ["d"]


def test_capacity_and_batch_limits_bind():
    loads = [load("a", 0.4, 2), load("b", 0.5, 2), load("c", 0.6, 2)]
    plan = plan_repack(loads, RepackPolicy(c_max=0.99))
    # a (0.4) fits b (0.5 -> 0.9) and c (0.6 -> 1.0 > 0.99): b; then b receives, c alone
    assert [(m.source, m.destination) for m in plan.moves] == [("a", "b")]
    plan = plan_repack(loads, RepackPolicy(c_max=0.99, batch_limit=3))
    assert plan.moves == []  # 2 + 2 > B = 3


def test_versions_never_mix_and_non_candidates_stay():
    loads = [
        load("a", 0.1, 2, version=1),
        load("b", 0.1, 2, version=2),
        load("c", 0.2, 2, version=2, draining=False, prev=0.1),  # growing, not draining
        load("d", 0.2, 2, version=2, waiting=1),  # still backfilling
        load("e", 0.25, 2, version=2, accepting=False),  # an operator drained it: source only
        load("f", 0.3, 3, version=1),
    ]
    plan = plan_repack(loads, RepackPolicy())
    assert [(m.source, m.destination) for m in plan.moves] == [("a", "f"), ("e", "b")]
    assert plan.candidates == {1: ["a", "f"], 2: ["b", "e"]}
    paper = plan_repack(loads, RepackPolicy(require_draining=False))
    assert paper.candidates == {1: ["a", "f"], 2: ["b", "e"]}  # c grows: no candidate either


def test_ramp_down_without_draining_is_the_paper_rule():
    policy = RepackPolicy(c_max=0.9, require_draining=False)
    assert is_candidate(load("x", 0.5, 3, prev=0.6, draining=False), policy)
    assert not is_candidate(load("x", 0.5, 3, prev=0.5, draining=False), policy)
    strict = RepackPolicy(c_max=0.9)  # the default: a refilling rollout is never a candidate
    assert not is_candidate(load("x", 0.5, 3, prev=0.6, draining=False), strict)
    assert not is_candidate(load("x", 0.95, 3, prev=0.99), policy)  # above C_max
    assert not is_candidate(load("x", 0.0, 0), policy)  # nothing to move


def test_policy_and_input_validation():
    with pytest.raises(ValueError):
        RepackPolicy(c_max=1.5)
    with pytest.raises(ValueError):
        RepackPolicy(period_s=0)
    with pytest.raises(ValueError):
        RepackPolicy.model_validate({"c_max": 0.9, "bogus": 1})
    with pytest.raises(ValueError, match="appears twice"):
        plan_repack([load("a", 0.1, 1), load("a", 0.2, 1)], RepackPolicy())
