"""The data role's durable store, prompt loading and buffer policies (no services, no network)."""

from __future__ import annotations

import json

import pytest

from laminar.errors import ConfigError
from laminar.roles.data.buffer import EVICTIONS, SAMPLERS, MaxSize, make_policy
from laminar.roles.data.prompts import read_records, tokenize_records
from laminar.roles.data.store import Store
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


def test_partials_gap_is_an_error_and_completion_is_exactly_once(tmp_path):
    store = make_store(tmp_path)
    store.refill(1, samples=1, seed=0, epochs=1)
    (a,) = store.lease("r", 1, 0, set(), PARAMS)
    with pytest.raises(ValueError, match="gap"):
        store.append_partials(
            "r",
            [
                PartialChunk(
                    trajectory_id=a.trajectory_id, version=0, offset=3, token_ids=[1], logprobs=[-1]
                )
            ],
        )
    assert store.complete("r", [traj(a.trajectory_id)]) == ([a.trajectory_id], 0)
    assert store.complete("r2", [traj(a.trajectory_id)]) == ([], 1)
    assert store.counts()["trajectories"] == 1 and store.partial_lengths() == {}
    with pytest.raises(KeyError):
        store.complete("r", [traj("nope/0")])


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
        tokenize_records(
            [{"id": "a", "prompt": "x"}] * 2, Tok(), id_key="id", prompt_key="prompt", source="f"
        )
    with pytest.raises(ConfigError, match="lacks"):
        tokenize_records([{"id": "a"}], Tok(), id_key="id", prompt_key="prompt", source="f")
