"""The data role's durable store, prompt loading and buffer policies (no services, no network)."""

from __future__ import annotations

import json

import pytest

from laminar.roles.data.buffer import (
    EVICTIONS,
    SAMPLERS,
    ExperienceBuffer,
    FifoSampler,
    KeepAll,
    MaxSize,
    make_policy,
)
from laminar.roles.data.prompts import prepare_prompts, read_records
from laminar.roles.data.store import Store
from laminar.runtime.errors import ConfigError
from laminar.trajectory import PartialChunk, SamplingParams, Trajectory

PARAMS = SamplingParams(max_tokens=8)


def make_store(tmp_path, n=5):
    store = Store(tmp_path / "s.sqlite")
    store.load_prompts(((f"p{i}", {"id": f"p{i}"}, [1, 2, i]) for i in range(n)), "fp")
    return store


def traj(tid: str, n: int = 3, version: int = 0) -> Trajectory:
    prompt_id, _, k = tid.rpartition("/")
    return Trajectory(
        trajectory_id=tid,
        prompt_id=prompt_id,
        sample_index=int(k),
        prompt_token_ids=[1],
        response_token_ids=list(range(n)),
        logprobs=[-0.5] * n,
        version=version,
        finish_reason="stop",
        queued_at=0.0,
        started_at=1.0,
        finished_at=2.0,
    )


def test_refill_queues_whole_groups_in_a_seeded_order_and_stops_after_the_epochs(tmp_path):
    store = make_store(tmp_path)
    assert store.refill(6, samples=2, seed=1, epochs=2) == 6  # 3 prompts x 2 samples
    assert store.refill(100, samples=2, seed=1, epochs=2) == 14  # the rest: 10 prompts in all
    assert store.exhausted(2) and store.refill(100, samples=2, seed=1, epochs=2) == 0
    order = [a.trajectory_id for a in store.lease("r", 100, 0, set(), PARAMS)]
    assert len(order) == len(set(order)) == 20
    first = [t.split("/")[0] for t in order[:10:2]]
    second = [t.split("/")[0].split("~")[0] for t in order[10::2]]
    assert sorted(first) == sorted(second) == [f"p{i}" for i in range(5)]
    other = make_store(tmp_path / "b")
    other.refill(100, samples=2, seed=1, epochs=2)
    assert [a.trajectory_id for a in other.lease("r", 100, 0, set(), PARAMS)] == order


def test_a_store_refuses_another_dataset(tmp_path):
    make_store(tmp_path).close()
    with pytest.raises(ValueError, match="another dataset"):
        Store(tmp_path / "s.sqlite").load_prompts([("x", {}, [1])], "other-fp")


def test_release_requeues_at_the_front_and_resumes_only_on_the_same_version(tmp_path):
    store = make_store(tmp_path)
    store.refill(10, samples=1, seed=0, epochs=None)
    a, b = store.lease("r1", 2, 7, set(), PARAMS)
    store.append_partials(
        "r1",
        [
            PartialChunk(
                trajectory_id=a.trajectory_id,
                version=7,
                offset=0,
                token_ids=[4, 5],
                logprobs=[-1, -2],
            )
        ],
    )
    assert set(store.release("r1")) == {a.trajectory_id, b.trajectory_id}
    # version 8 gets b (no tokens yet: any version) but not a (its tokens came from version 7)
    got8 = store.lease("r2", 1, 8, set(), PARAMS)
    assert [g.trajectory_id for g in got8] == [b.trajectory_id] and got8[0].resume_token_ids == []
    got7 = store.lease("r3", 1, 7, set(), PARAMS)
    assert got7[0].trajectory_id == a.trajectory_id
    assert got7[0].resume_token_ids == [4, 5] and got7[0].version == 7


def test_give_back_requeues_only_unstarted_leases_of_that_rollout_in_queue_order(tmp_path):
    store = make_store(tmp_path)
    store.refill(10, samples=1, seed=0, epochs=None)
    a, b, c = store.lease("r1", 3, 4, set(), PARAMS)
    (d,) = store.lease("r2", 1, 4, set(), PARAMS)
    chunk = PartialChunk(
        trajectory_id=b.trajectory_id, version=4, offset=0, token_ids=[4], logprobs=[-1]
    )
    store.append_partials("r1", [chunk])  # b has started
    ids = [c.trajectory_id, b.trajectory_id, a.trajectory_id, d.trajectory_id, "nope/0"]
    assert store.give_back("r1", ids) == [a.trajectory_id, c.trajectory_id]
    assert store.give_back("r1", ids) == []  # a repeated call is a no-op
    # back at the front, in queue order, and free for any version (no tokens of their own)
    got = store.lease("r3", 2, 9, set(), PARAMS)
    assert [g.trajectory_id for g in got] == [a.trajectory_id, c.trajectory_id]
    assert store.holder(b.trajectory_id) == ("leased", "r1", 4)
    assert store.holder(d.trajectory_id) == ("leased", "r2", 4)


def test_a_lease_given_back_unstarted_starts_at_its_next_lease(tmp_path):
    now = [100.0]
    store = Store(tmp_path / "s.sqlite", now=lambda: now[0])
    store.load_prompts(((f"p{i}", {"id": f"p{i}"}, [1, 2, i]) for i in range(2)), "fp")
    store.refill(10, samples=1, seed=0, epochs=None)
    a, b = store.lease("r1", 2, 0, set(), PARAMS)
    chunk = PartialChunk(
        trajectory_id=b.trajectory_id, version=0, offset=0, token_ids=[4], logprobs=[-1]
    )
    store.append_partials("r1", [chunk])  # b has tokens: its release below keeps its start
    assert store.give_back("r1", [a.trajectory_id]) == [a.trajectory_id]
    assert store.release("r1") == [b.trajectory_id]
    now[0] = 130.0
    again = {x.trajectory_id: x for x in store.lease("r2", 2, 0, set(), PARAMS)}
    # a waited in a rollout's hand and never ran: its first start is this lease, not the first
    assert again[a.trajectory_id].started_at == 130.0
    assert again[b.trajectory_id].started_at == 100.0


def test_partials_gap_is_refused_and_completion_is_exactly_once(tmp_path):
    store = make_store(tmp_path)
    store.refill(1, samples=1, seed=0, epochs=1)
    (a,) = store.lease("r", 1, 0, set(), PARAMS)
    gap = PartialChunk(
        trajectory_id=a.trajectory_id, version=0, offset=3, token_ids=[1], logprobs=[-1]
    )
    drop, refused = store.append_partials("r", [gap])
    assert drop == [] and [tid for tid, _ in refused] == [a.trajectory_id]
    assert "gap" in refused[0][1] and store.partial_lengths() == {}
    assert store.complete("r", [traj(a.trajectory_id)]) == ([a.trajectory_id], 0, [])
    assert store.complete("r2", [traj(a.trajectory_id)]) == ([], 1, [])
    assert store.counts()["trajectories"] == 1 and store.partial_lengths() == {}
    new, _, refused = store.complete("r", [traj("nope/0")])
    assert new == [] and refused[0][0] == "nope/0" and "unknown" in refused[0][1]


def test_scored_trajectories_are_consumed_once_and_eviction_drops_the_oldest(tmp_path):
    store = make_store(tmp_path)
    store.refill(5, samples=1, seed=0, epochs=1)
    leased = store.lease("r", 5, 0, set(), PARAMS)
    store.complete("r", [traj(a.trajectory_id) for a in leased])
    assert store.ready_entries() == []  # not scored yet
    store.set_rewards([(a.trajectory_id, 1.0, None) for a in leased])
    ready = store.ready_entries()
    assert [e.trajectory_id for e in ready] == [a.trajectory_id for a in leased]
    evict = MaxSize(max_size=3).evict(ready, 0)
    assert evict == [a.trajectory_id for a in leased[:2]]
    store.evict(evict)
    fifo = make_policy("fifo", SAMPLERS, {})
    pick = fifo.select(store.ready_entries(), 2, 0)
    assert [t.trajectory_id for t in store.consume(pick)] == pick
    assert store.consume(pick) == []
    counts = store.counts()
    assert counts["consumed"] == 2 and counts["evicted"] == 2


def test_policy_names_and_bad_options_are_clear_errors():
    assert isinstance(make_policy("max_size", EVICTIONS, {"max_size": 2}), MaxSize)
    with pytest.raises(ConfigError, match="cannot construct"):
        make_policy("max_size", EVICTIONS, {"size": 2})
    with pytest.raises(ConfigError):
        make_policy("nosuch", SAMPLERS, {})


def test_prompt_files_jsonl_and_parquet_with_clear_errors(tmp_path):
    good = tmp_path / "p.jsonl"
    good.write_text(
        json.dumps({"id": "a", "prompt": "x"})
        + "\n\n"
        + json.dumps({"id": "b", "prompt": "y"})
        + "\n"
    )
    assert [r["id"] for r in read_records(good)] == ["a", "b"]
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.Table.from_pylist([{"id": "a", "prompt": "x", "answer": 3}]), tmp_path / "p.parquet"
    )
    assert read_records(tmp_path / "p.parquet") == [{"id": "a", "prompt": "x", "answer": 3}]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "prompt": "x"}\n{oops\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2: not valid JSON"):
        read_records(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        read_records(tmp_path / "missing.jsonl")

    class Tok:
        def encode(self, text):
            return type("E", (), {"ids": [ord(c) for c in text]})()

    with pytest.raises(ConfigError, match="duplicate prompt id 'a'"):
        prepare_prompts(
            [{"id": "a", "prompt": "x"}] * 2, Tok(), id_key="id", prompt_key="prompt", source="f"
        )
    with pytest.raises(ConfigError, match="lacks"):
        prepare_prompts([{"id": "a"}], Tok(), id_key="id", prompt_key="prompt", source="f")
    two = [{"id": "a", "prompt": "xy"}, {"id": "b", "prompt": "xyz"}]
    kept = prepare_prompts(two, Tok(), id_key="id", prompt_key="prompt", source="f",
                           max_prompt_tokens=2).rows  # fmt: skip
    assert [pid for pid, _, _ in kept] == ["a"]
    with pytest.raises(ConfigError, match="no prompts of at most 1 tokens"):
        prepare_prompts(two, Tok(), id_key="id", prompt_key="prompt", source="f",
                        max_prompt_tokens=1)  # fmt: skip


# -- the experience buffer: consume cursor, whole groups, staleness ------------------------------


def buffered(tmp_path, prompts=5, group=1, versions=None, score=True, **kw):
    """A store whose ``prompts * group`` samples are finished (and scored), plus its buffer."""
    store = make_store(tmp_path, prompts)
    store.refill(prompts * group, samples=group, seed=0, epochs=1)
    leased = [a.trajectory_id for a in store.lease("r", prompts * group, 0, set(), PARAMS)]
    versions = versions or {}
    store.complete("r", [traj(t, version=versions.get(t, 0)) for t in leased])
    if score:
        store.set_rewards([(t, 1.0, None) for t in leased])
    sampler = make_policy(kw.pop("sampler", "fifo"), SAMPLERS, {})
    buffer = ExperienceBuffer(store, sampler, KeepAll(), group_size=group, **kw)
    return store, buffer, leased


def ids(batch):
    return [t.trajectory_id for t in batch.items]


def test_consume_seqs_count_up_and_a_restarted_trainer_gets_exactly_what_it_did_not_commit(
    tmp_path,
):
    store, buffer, leased = buffered(tmp_path, prompts=6)
    first = buffer.sample(2, 0)
    assert first.seqs == [1, 2] and first.cursor == 2 and ids(first) == leased[:2]
    committed = first.cursor  # the trainer checkpoints here
    lost = buffer.sample(2, 0)  # ... trains on these, crashes before the next checkpoint
    assert lost.seqs == [3, 4] and lost.cursor == 4 and lost.redelivered == 0
    store.close()  # the data role restarts too: the counter is durable

    store = Store(tmp_path / "s.sqlite")
    buffer = ExperienceBuffer(store, FifoSampler(), KeepAll(), group_size=1)
    again = buffer.sample(3, 0, after=committed)
    assert ids(again) == [*ids(lost), leased[4]]  # the uncommitted, in order, then a fresh one
    assert again.seqs == [3, 4, 5] and again.cursor == 5 and again.redelivered == 2
    assert [t.reward for t in again.items] == [1.0] * 3
    # re-delivery alone when it fills n; after=None never re-delivers
    assert buffer.sample(1, 0, after=0).seqs == [1]
    last = buffer.sample(5, 0)
    assert ids(last) == [leased[5]] and last.seqs == [6]
    empty = buffer.sample(2, 0, after=6)
    assert empty.items == [] and empty.seqs == [] and empty.cursor == 6
    assert buffer.sample(2, 0).cursor == 0
    assert store.consume_cursor() == 6 and store.counts()["consumed"] == 6
    # waiting callers ask with partial=False: nothing is consumed unless n are there
    assert buffer.sample(1, 0, partial=False) is None
    assert buffer.sample(2, 0, after=5, partial=False) is None


def test_an_older_store_gains_the_consume_seq_column(tmp_path):
    store, _, leased = buffered(tmp_path, prompts=2)
    store.consume([leased[0]])
    store.db.execute("DROP INDEX trajectories_consume_seq")
    store.db.execute("ALTER TABLE trajectories DROP COLUMN consume_seq")
    store.close()
    store = Store(tmp_path / "s.sqlite")
    assert store.counts()["consumed"] == 1 and store.consume_cursor() == 0
    assert [s for s, _ in store.consume_numbered(leased)] == [1]  # leased[0] was consumed before


def test_whole_groups_are_complete_contiguous_and_in_completion_order(tmp_path):
    store, buffer, leased = buffered(tmp_path, prompts=4, group=2, score=False)
    g = [leased[i : i + 2] for i in range(0, 8, 2)]  # the four groups, members by sample index
    # completion (buffer seq) order: g1 completes first, then g0, then g3; g2 lacks a score
    order = [g[0][1], g[1][1], g[1][0], g[2][0], g[0][0], g[3][1], g[3][0]]
    store.db.execute("DELETE FROM trajectories")
    store.db.execute("UPDATE samples SET state = 'leased'")
    store.complete("r", [traj(t) for t in [*order, g[2][1]]])
    store.set_rewards([(t, 0.5, None) for t in order])
    with pytest.raises(ValueError, match="multiple of samples_per_prompt"):
        buffer.sample(3, 0, whole_groups=True)
    assert buffer.sample(8, 0, whole_groups=True, partial=False) is None  # 3 groups complete
    got = buffer.sample(4, 0, whole_groups=True)
    assert ids(got) == g[1] + g[0] and got.seqs == [1, 2, 3, 4]
    rest = buffer.sample(4, 0, whole_groups=True)  # g2 is incomplete: only g3
    assert ids(rest) == g[3] and rest.cursor == 6
    store.set_rewards([(g[2][1], 0.5, None)])
    assert ids(buffer.sample(4, 0, whole_groups=True)) == g[2]
    # re-delivery returns what was consumed, in consume order: group-contiguous
    assert ids(buffer.sample(6, 0, after=2, whole_groups=True)) == g[0] + g[3] + g[2]


def test_whole_groups_follow_the_sampler_and_skip_groups_with_an_evicted_member(tmp_path):
    store, buffer, leased = buffered(tmp_path, prompts=3, group=2, sampler="newest")
    store.evict([leased[3]])  # group 1 can never complete
    assert ids(buffer.sample(4, 0, whole_groups=True)) == leased[4:6] + leased[0:2]
    assert buffer.sample(2, 0, whole_groups=True).items == []
    assert [e.trajectory_id for e in store.ready_entries()] == [leased[2]]


def test_constant_groups_are_filtered_durably_and_the_batch_fills_from_the_next(tmp_path):
    store, buffer, leased = buffered(tmp_path, prompts=4, group=2, drop_constant_groups=True)
    g = [leased[i : i + 2] for i in range(0, 8, 2)]
    # g0 all right, g1 mixed, g2 all wrong, g3 mixed (buffered() scored everything 1.0)
    store.set_rewards([(g[1][1], 0.0, None), (*g[2][0:1], 0.0, None), (g[2][1], 0.0, None)])
    store.set_rewards([(g[3][0], 0.0, None)])
    got = buffer.sample(4, 0, whole_groups=True)
    assert ids(got) == g[1] + g[3] and got.seqs == [1, 2, 3, 4]
    assert buffer.filtered == 4 and store.counts()["filtered"] == 4
    assert store.counts()["evicted"] == 4 and store.ready_entries() == []
    assert buffer.sample(2, 0, whole_groups=True).items == [] and buffer.filtered == 0
    # off (the default): a constant group is trained on like any other
    store, buffer, leased = buffered(tmp_path / "off", prompts=2, group=2)
    assert ids(buffer.sample(4, 0, whole_groups=True)) == leased
    assert buffer.filtered == 0 and store.counts()["filtered"] == 0


def test_staleness_drop_evicts_for_good_and_counts(tmp_path):
    versions = {f"p{i}/0": i for i in range(5)}
    store, buffer, _ = buffered(tmp_path, versions=versions, staleness_bound=1)
    got = buffer.sample(10, 3)  # staleness 3 - version: p0 and p1 are over the bound
    assert sorted(t.version for t in got.items) == [2, 3, 4]
    counts = store.counts()
    assert counts["stale_dropped"] == 2 and counts["evicted"] == 2 and counts["consumed"] == 3
    assert buffer.held == 0 and store.ready_entries() == []
    buffer.staleness_bound = None
    assert buffer.sample(10, 3).items == []  # dropped ones are never trained


def test_staleness_hold_keeps_them_for_a_later_larger_bound(tmp_path):
    versions = {f"p{i}/0": i for i in range(5)}
    store, buffer, _ = buffered(
        tmp_path, versions=versions, staleness_bound=1, staleness_action="hold"
    )
    assert [t.version for t in buffer.sample(1, 3).items] == [2]
    assert buffer.held == 2 and store.counts()["stale_dropped"] == 0
    buffer.staleness_bound = 3
    assert sorted(t.version for t in buffer.sample(10, 3).items) == [0, 1, 3, 4]
    assert buffer.held == 0


@pytest.mark.parametrize("action", ["drop", "hold"])
def test_staleness_with_whole_groups_judges_the_whole_group(tmp_path, action):
    store, buffer, leased = buffered(
        tmp_path,
        prompts=2,
        group=2,
        versions={},
        staleness_bound=1,
        staleness_action=action,
    )
    store.db.execute("UPDATE trajectories SET version = 2")
    store.db.execute("UPDATE trajectories SET version = 0 WHERE trajectory_id = ?", (leased[1],))
    got = buffer.sample(4, 2, whole_groups=True)
    assert ids(got) == leased[2:4]
    counts = store.counts()
    if action == "drop":
        assert counts["stale_dropped"] == 2 and buffer.held == 0
        assert store.ready_entries() == []
    else:
        assert counts["stale_dropped"] == 0 and buffer.held == 2
        assert [e.trajectory_id for e in store.ready_entries()] == leased[0:2]


def test_a_negative_staleness_bound_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="staleness bound"):
        buffered(tmp_path, staleness_bound=-1)


def test_backpressure_counts_what_is_ahead_of_the_trainer_and_never_withholds_a_lost_lease(
    tmp_path,
):
    store = make_store(tmp_path, n=8)
    store.refill(8, samples=1, seed=0, epochs=1)
    first = store.lease("r", 4, 0, set(), PARAMS, fresh_limit=3)
    assert len(first) == 3 and store.ahead() == 3  # capped: 3 in generation
    store.complete("r", [traj(a.trajectory_id) for a in first[:2]])
    assert store.ahead() == 3  # finished but not trained on still counts
    assert store.lease("r", 4, 0, {first[2].trajectory_id}, PARAMS, fresh_limit=0) == []
    # the reply of the first lease was "lost": r holds nothing, so its lease comes back anyway
    again = store.lease("r", 4, 0, set(), PARAMS, fresh_limit=0)
    assert [a.trajectory_id for a in again] == [first[2].trajectory_id]
    store.set_rewards([(a.trajectory_id, 1.0, None) for a in first[:2]])
    store.consume([a.trajectory_id for a in first[:2]])
    assert store.ahead() == 1  # consumption made room


def test_a_lost_lease_of_an_older_version_is_requeued_for_that_version_not_re_delivered(tmp_path):
    """A rollout that no longer holds a lease it took at version 0, and holds version 1 now,
    must not get it back: its engine would refuse the resume and record it failed for good
    (issue 15's chaos benchmark). It waits in the queue for a rollout of version 0."""
    store = make_store(tmp_path, n=2)
    store.refill(2, samples=1, seed=0, epochs=1)
    a, b = store.lease("r1", 2, 0, set(), PARAMS)
    chunk = PartialChunk(
        trajectory_id=a.trajectory_id, version=0, offset=0, token_ids=[5, 6], logprobs=[-1, -1]
    )
    store.append_partials("r1", [chunk])
    # r1 loaded version 1 and lost both: b (no tokens) may start afresh on version 1, a may not
    again = store.lease("r1", 2, 1, set(), PARAMS)
    assert [(x.trajectory_id, x.resume_token_ids) for x in again] == [(b.trajectory_id, [])]
    resumed = store.lease("r0", 2, 0, set(), PARAMS)
    assert [x.trajectory_id for x in resumed] == [a.trajectory_id]
    assert resumed[0].version == 0 and resumed[0].resume_token_ids == [5, 6]


def test_async_ratio_stops_new_starts_on_stale_weights_but_not_resumes(tmp_path):
    """ROLL Flash's alpha, hand-computed: with the trainer at version 5 and alpha = 2, a rollout
    on version 3 may start trajectories (5 - 3 = 2 <= 2) and one on version 2 may not (3 > 2);
    alpha = 0 allows only the trainer's own version; no alpha, any. The stale rollout still
    gets back the trajectory it had started at its version (a resume), and nothing fresh."""
    from laminar.roles.data.leasing import may_start

    assert may_start(5, 3, 2) and not may_start(5, 2, 2)
    assert may_start(5, 5, 0) and not may_start(5, 4, 0)
    assert may_start(50, 0, None)
    store = make_store(tmp_path)
    store.refill(10, samples=1, seed=0, epochs=None)
    (a,) = store.lease("r1", 1, 2, set(), PARAMS)
    chunk = PartialChunk(trajectory_id=a.trajectory_id, version=2, offset=0, token_ids=[4],
                         logprobs=[-1.0])  # fmt: skip
    store.append_partials("r1", [chunk])
    store.release("r1")
    stale = store.lease("r2", 5, 2, set(), PARAMS, start_new=may_start(5, 2, 2))
    assert [s.trajectory_id for s in stale] == [a.trajectory_id]
    assert stale[0].resume_token_ids == [4]
    fresh = store.lease("r3", 5, 3, set(), PARAMS, start_new=may_start(5, 3, 2))
    assert len(fresh) == 5 and a.trajectory_id not in {f.trajectory_id for f in fresh}


def scanned_totals(store):  # what the triggers' totals must equal: the scan they replace
    row = store.db.execute(
        "SELECT COUNT(*), COALESCE(SUM(scored), 0), COALESCE(SUM(consumed), 0), "
        "COALESCE(SUM(evicted), 0), COALESCE(SUM(reward_error IS NOT NULL), 0), "
        "COALESCE(SUM(n_tokens), 0), AVG(reward) FROM trajectories"
    ).fetchone()
    keys = ("trajectories", "scored", "consumed", "evicted", "reward_errors", "tokens")
    return dict(zip(keys, row[:6], strict=True)), row[6]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_trigger_kept_totals_equal_a_scan_after_any_writes_and_on_reopen(tmp_path, seed):
    import random

    rng = random.Random(seed)
    store = make_store(tmp_path, n=12)
    store.refill(12, samples=2, seed=seed, epochs=1)
    assert store.buffer_counts() == scanned_totals(store)[0] and store.mean_reward() is None
    leased = [a.trajectory_id for a in store.lease("r", 24, 0, set(), PARAMS)]
    done: list[str] = []
    for step in range(40):
        op = rng.choice(["complete", "score", "consume", "evict"])
        if op == "complete" and len(done) < len(leased):
            batch = leased[len(done) : len(done) + rng.randint(1, 4)]
            store.complete("r", [traj(t, n=rng.randint(1, 9)) for t in batch])
            done += batch
        elif op == "score" and done:
            picked = rng.sample(done, min(len(done), 3))
            store.set_rewards(
                [(t, rng.choice([0.0, 0.25, 1.0]), None) if rng.random() < 0.8
                 else (t, None, "reward raised") for t in picked]
            )  # fmt: skip
        elif op == "consume" and done:
            store.consume(rng.sample(done, min(len(done), 2)))
        elif op == "evict" and done:
            store.evict(rng.sample(done, 1))
        counts, mean = scanned_totals(store)
        assert store.buffer_counts() == counts, (step, op)
        assert store.mean_reward() == pytest.approx(mean), (step, op)
    # a store whose totals row went wrong (or one from before the triggers) is recounted on open
    store.db.execute("UPDATE trajectory_totals SET trajectories = 999, reward_sum = -5")
    store.close()
    store = Store(tmp_path / "s.sqlite")
    assert store.buffer_counts() == scanned_totals(store)[0]
    assert store.mean_reward() == pytest.approx(scanned_totals(store)[1])
