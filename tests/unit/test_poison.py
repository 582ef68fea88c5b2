"""One poison request fails alone: the engine refuses it, the data role records it as failed.

Before, a prompt the engine could not take (too long for its context, token ids outside its
vocabulary) crashed the rollout; its lease went back to the front of the queue, the next rollout
took it and crashed too, until no rollout was left. Here: the engines refuse it and go on, the
rollout reports it failed, the data role records it for good, a lease that keeps killing its
rollouts is quarantined, and neither a whole-group buffer nor a round waits for a group that lost
a member.
"""

from __future__ import annotations

import asyncio

from laminar.engines import EngineRequest, InflightSequence, SimEngineConfig
from laminar.engines.base import EngineOutput
from laminar.engines.costmodel import CostModel
from laminar.engines.sim import SimEngine
from laminar.roles.data.buffer import ExperienceBuffer, FifoSampler, KeepAll
from laminar.roles.data.rounds import RoundGate
from laminar.runtime.schedules import ScheduleConfig
from laminar.trajectory import PartialChunk, SamplingParams
from tests.unit.test_data_store import make_store, traj

FAST = CostModel(batch_points=[(1, 0.001), (256, 0.002)], prefill_s_per_token=0.0)
PARAMS = SamplingParams(max_tokens=8)


async def collect(engine: SimEngine, n: int) -> dict[str, list[EngineOutput]]:
    """Outputs per request until ``n`` requests finished."""
    out: dict[str, list[EngineOutput]] = {}
    done = 0
    async with asyncio.timeout(10):
        async for batch in engine.outputs():
            for o in batch:
                out.setdefault(o.request_id, []).append(o)
                done += o.finished
            if done >= n:
                return out
    raise AssertionError("unreachable")


# -- the engine --------------------------------------------------------------------------------


async def test_the_sim_engine_refuses_a_bad_prompt_alone_and_goes_on() -> None:
    cfg = SimEngineConfig.model_validate(
        {"kv_capacity_tokens": 64, "vocab_size": 100, "lengths": {"kind": "fixed", "value": 5}}
    )
    engine = SimEngine(cfg.model_copy(update={"cost": FAST}))
    await engine.start()
    try:
        prompts = {
            "long": [1] * 64,  # fills the context: no room for one response token
            "vocab": [1, 100],
            "negative": [-1, 2],
            "empty": [],
            "good": [1, 2, 3],
        }
        for rid, prompt in prompts.items():
            await engine.add_request(
                EngineRequest(request_id=rid, prompt_token_ids=prompt, params=PARAMS)
            )
        got = await collect(engine, len(prompts))
        good = got.pop("good")
        assert sum(len(o.token_ids) for o in good) == 5 and good[-1].finish_reason == "stop"
        assert all(o.error is None for o in good)
        for rid, (out,) in got.items():
            assert out.finished and out.token_ids == [] and out.error, rid
        assert "max_model_len 64" in got["long"][0].error
        assert "token id 100 is outside the vocabulary [0, 100)" in got["vocab"][0].error
        assert "token id -1" in got["negative"][0].error and "empty" in got["empty"][0].error
        assert engine.refused == 4 and engine.in_flight == 0
        # the engine goes on; an imported sequence that already fills the context ends "length"
        await engine.add_request(
            EngineRequest(request_id="again", prompt_token_ids=[4], params=PARAMS)
        )
        full = InflightSequence(
            request_id="full",
            prompt_token_ids=[1] * 60,
            response_token_ids=[2] * 4,
            response_logprobs=[-1.0] * 4,
            params=PARAMS,
            version=0,
        )
        await engine.import_sequences([full])
        got = await collect(engine, 2)
        assert sum(len(o.token_ids) for o in got["again"]) == 5
        assert [(o.token_ids, o.finish_reason, o.error) for o in got["full"]] == [
            ([], "length", None)
        ]
    finally:
        await engine.close()


# -- the store: failures, strikes, quarantine ----------------------------------------------------


def test_a_lease_whose_rollouts_keep_dying_is_quarantined_and_innocents_are_spread(tmp_path):
    store = make_store(tmp_path, 6)
    store.refill(6, samples=1, seed=0, epochs=1)
    first = [a.trajectory_id for a in store.lease("r1", 3, 0, set(), PARAMS)]
    requeued, quarantined = store.release_dead("r1", quarantine_after=2)
    assert requeued == first and quarantined == []  # one strike each: suspects now
    # a rollout gets at most one suspect at a time (the one first in the queue)
    got = [a.trajectory_id for a in store.lease("r2", 6, 0, set(), PARAMS)]
    assert got[0] == first[0] and set(got[1:]).isdisjoint(first) and len(got) == 4
    # r2 dies before any token: its suspect gets a second strike and is quarantined
    requeued, quarantined = store.release_dead("r2", quarantine_after=2)
    assert [tid for tid, _ in quarantined] == [first[0]] and first[0] not in requeued
    assert "2 rollouts in a row died" in quarantined[0][1]
    assert store.failures() == [(first[0], "quarantined", quarantined[0][1])]
    counts = store.counts()
    assert (counts["failed"], counts["quarantined"], counts["done"]) == (1, 1, 0)
    # never handed out again, and a late completion of it is a duplicate
    assert store.complete("r1", [traj(first[0])]) == ([], 1, [])
    # the rest are all suspects now: a rollout takes one at a time
    (a,) = store.lease("r3", 6, 0, set(), PARAMS)
    assert store.lease("r3", 6, 0, {a.trajectory_id}, PARAMS) == []
    # an acknowledged token is progress: its strikes clear, and r3 may take the next suspect
    chunk = PartialChunk(
        trajectory_id=a.trajectory_id, version=0, offset=0, token_ids=[5], logprobs=[-1.0]
    )
    assert store.append_partials("r3", [chunk]) == ([], [])
    (b,) = store.lease("r3", 6, 0, {a.trajectory_id}, PARAMS)
    assert b.trajectory_id not in (a.trajectory_id, first[0])
    leased = [tid for tids in store.leases().values() for tid in tids]
    assert first[0] not in leased and sorted(leased) == sorted({a.trajectory_id, b.trajectory_id})
    # r3 dies: the lease that made progress there is not suspected; the other gets its 2nd strike
    requeued, quarantined = store.release_dead("r3", quarantine_after=2)
    assert requeued == [a.trajectory_id] and [t for t, _ in quarantined] == [b.trajectory_id]
    strikes = dict(store.db.execute("SELECT trajectory_id, strikes FROM samples"))
    assert strikes[a.trajectory_id] == 0 and store.counts()["quarantined"] == 2


def test_a_group_with_a_failed_member_is_evicted_from_whole_group_samples(tmp_path):
    store = make_store(tmp_path, 2)
    store.refill(4, samples=2, seed=0, epochs=1)
    leased = [a.trajectory_id for a in store.lease("r", 4, 0, set(), PARAMS)]
    broken = leased[0]
    recorded, refused = store.fail("r", [(broken, "refused by the engine")], "refused")
    assert recorded == [broken] and refused == []
    store.complete("r", [traj(t) for t in leased[1:]])
    store.set_rewards([(t, 1.0, None) for t in leased[1:]])
    buffer = ExperienceBuffer(store, FifoSampler(), KeepAll(), group_size=2)
    batch = buffer.sample(4, 0, whole_groups=True)
    assert batch is not None and len(batch.items) == 2  # the whole group only
    assert {t.prompt_id for t in batch.items} != {broken.rpartition("/")[0]}
    assert store.counts()["orphaned"] == 1 and store.ready_entries() == []


def test_a_group_with_spare_samples_completes_despite_as_many_failures(tmp_path):
    """``data.redundant_samples``: groups of 2 started with 3 samples; a failure is what the
    spare is for, a second one breaks the group."""
    store = make_store(tmp_path, 2)
    store.refill(4, samples=3, seed=0, epochs=1)
    leased = [a.trajectory_id for a in store.lease("r", 6, 0, set(), PARAMS)]
    groups: dict[str, list[str]] = {}
    for tid in leased:
        groups.setdefault(tid.rpartition("/")[0], []).append(tid)
    (_, one), (_, two) = sorted(groups.items())
    failed = [one[0], *two[:2]]
    recorded, _ = store.fail("r", [(t, "refused by the engine") for t in failed], "refused")
    assert sorted(recorded) == sorted(failed)
    done = [one[1], one[2], two[2]]
    new, _, _ = store.complete("r", [traj(t) for t in done], keep=2)
    assert sorted(new) == sorted(done)
    store.set_rewards([(t, float(i), None) for i, t in enumerate(done)])
    buffer = ExperienceBuffer(store, FifoSampler(), KeepAll(), group_size=2, spare_samples=1)
    batch = buffer.sample(4, 0, whole_groups=True)
    assert batch is not None and sorted(t.trajectory_id for t in batch.items) == sorted(one[1:])
    assert store.counts()["orphaned"] == 1 and store.ready_entries() == []  # the broken one


def test_a_round_replaces_a_group_that_lost_a_member(tmp_path):
    store = make_store(tmp_path, 6)
    gate = RoundGate(ScheduleConfig(kind="sync", round_prompts=2), 2, 0, None)
    leased = [a.trajectory_id for a in gate.lease(store, "r", 8, 0, set(), PARAMS)]
    assert len(leased) == 4 and gate.open
    bad_group = leased[0].rpartition("/")[0]
    recorded, _ = store.fail("r", [(leased[0], "refused")], "refused")
    gate.note_failed(store, recorded)
    assert bad_group not in gate.groups and len(gate.groups) == 2  # a fresh group took its place
    fresh = [a.trajectory_id for a in gate.lease(store, "r", 8, 0, set(leased), PARAMS)]
    assert len(fresh) == 2 and {t.rpartition("/")[0] for t in fresh} <= set(gate.groups)
    done = [t for t in [*leased, *fresh] if not t.startswith(f"{bad_group}/")]
    new, _, _ = store.complete("r", [traj(t) for t in done])
    gate.note_completed(store, new)
    assert not gate.open  # the round ended without the broken group
    assert sorted(gate.history[-1]["kept"]) == sorted(gate.groups)
    assert bad_group not in gate.history[-1]["kept"] and gate.history[-1]["deferred"] == []


# -- the cluster -------------------------------------------------------------------------------
