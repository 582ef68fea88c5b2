"""The data role's round schedules keep deferred samples in an explicit ``parked`` state.

Before, a deferred group's samples were leased to a pseudo-rollout named ``~deferred``: it showed
up among the holders of leases (status, the lease sweep), and SQL outside the store marked it.
Also here: the store stamps rows with an injected clock, and no SQL lives outside the store.
"""

from __future__ import annotations

import asyncio
import re
import sqlite3
from pathlib import Path

import pytest

from laminar.roles.data.context import store_clock
from laminar.roles.data.rounds import RoundGate
from laminar.roles.data.store import Store
from laminar.runtime.clock import DEFAULT_EPOCH, VirtualClock, run_virtual
from laminar.runtime.schedules import ScheduleConfig
from laminar.trajectory import PartialChunk, SamplingParams
from tests.unit.test_data_store import make_store, traj

PARAMS = SamplingParams(max_tokens=8)
DATA = Path(__file__).resolve().parents[2] / "roles" / "data"


def chunk(tid: str) -> PartialChunk:
    return PartialChunk(trajectory_id=tid, version=0, offset=0, token_ids=[5], logprobs=[-1.0])


def test_a_deferred_group_is_parked_and_comes_back_in_the_long_round(tmp_path):
    store = make_store(tmp_path, 8)
    schedule = ScheduleConfig(kind="tail_batching", round_prompts=2, over_launch=2.0)
    gate = RoundGate(schedule, 1, 0, None)
    leased = [a.trajectory_id for a in gate.lease(store, "r", 8, 0, set(), PARAMS)]
    assert len(leased) == 4 and gate.plan is not None and gate.plan.kind == "short"
    store.append_partials("r", [chunk(leased[3])])
    new, _, _ = store.complete("r", [traj(t) for t in leased[:2]])
    gate.note_completed(store, new)
    assert not gate.open and gate.history[-1]["deferred"] == [
        t.rpartition("/")[0] for t in leased[2:]
    ]
    # parked: neither queued nor leased (no pseudo-rollout holds them), their tokens withdrawn
    assert store.leases() == {} and store.parked_count() == 2
    counts = store.counts()
    assert (counts["queued"], counts["leased"], counts["partial_tokens"]) == (0, 0, 0)
    # their old holder is told to drop them, and a late completion is ignored
    assert store.append_partials("r", [chunk(leased[2])]) == ([leased[2]], [])
    assert gate.filter_completed(store, [traj(leased[2]), traj(leased[0])]) == [traj(leased[0])]
    # the next round (version 1's) is long: it takes the deferred groups back, from scratch
    again = gate.lease(store, "r", 8, 1, set(), PARAMS)
    assert gate.plan.kind == "long" and sorted(a.trajectory_id for a in again) == leased[2:]
    assert all(a.resume_token_ids == [] for a in again) and store.parked_count() == 0


# The samples table as releases before the parked state wrote it (a CHECK cannot be altered).
OLD_SAMPLES = """
CREATE TABLE prompts (idx INTEGER PRIMARY KEY, prompt_id TEXT NOT NULL UNIQUE,
    record TEXT NOT NULL, token_ids BLOB NOT NULL);
CREATE TABLE samples (
    trajectory_id TEXT PRIMARY KEY, prompt_id TEXT NOT NULL,
    prompt_idx INTEGER NOT NULL REFERENCES prompts (idx), sample_index INTEGER NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('queued', 'leased', 'done')), seq INTEGER NOT NULL,
    rollout TEXT, version INTEGER, queued_at REAL NOT NULL, started_at REAL);
INSERT INTO prompts VALUES (0, 'p0', '{}', x'01000000'), (1, 'p1', '{}', x'02000000');
INSERT INTO samples VALUES
    ('p0/0', 'p0', 0, 0, 'leased', 1, '~deferred', NULL, 0.0, NULL),
    ('p1/0', 'p1', 1, 0, 'leased', 2, 'r1', 3, 0.0, 1.0),
    ('p1/1', 'p1', 1, 1, 'queued', 3, NULL, NULL, 0.0, NULL);
"""


def test_an_older_store_reads_its_pseudo_rollout_leases_as_parked(tmp_path):
    path = tmp_path / "old.sqlite"
    with sqlite3.connect(path) as db:
        db.executescript(OLD_SAMPLES)
    store = Store(path)
    assert store.leases() == {"r1": ["p1/0"]} and store.parked_count() == 1
    assert store.counts()["leased"] == 1 and store.queued_count() == 1
    assert store.release_parked() == ["p0/0"]  # to the front of the queue
    assert [a.trajectory_id for a in store.lease("r2", 2, 0, set(), PARAMS)] == ["p0/0", "p1/1"]
    store.park(["p1"])  # the rebuilt table accepts the new state
    assert store.parked_count() == 2 and store.leases() == {"r2": ["p0/0"]}
    store.close()
    assert Store(path).parked_count() == 2  # a current store is left as it is


def test_the_store_stamps_rows_with_its_clock(tmp_path):
    store = Store(tmp_path / "s.sqlite", now=lambda: 1234.5)
    store.load_prompts([("p", {}, [1])], "fp")
    store.refill(1, samples=1, seed=0, epochs=1)
    (a,) = store.lease("r", 1, 0, set(), PARAMS)
    assert (a.queued_at, a.started_at) == (1234.5, 1234.5)


def test_the_store_reads_virtual_wall_time_on_its_own_thread(tmp_path):
    async def main() -> tuple[float, float]:
        clock = VirtualClock()
        loop = asyncio.get_running_loop()
        with pytest.raises(RuntimeError):  # why store_clock: the thread has no loop
            await loop.run_in_executor(None, clock.wall)
        now = store_clock(clock)
        await clock.sleep(5.0)
        store = await loop.run_in_executor(None, lambda: Store(tmp_path / "v.sqlite", now=now))
        await loop.run_in_executor(None, store.load_prompts, [("p", {}, [1])], "fp")
        await loop.run_in_executor(None, store.refill, 1, 1, 0, 1)
        (a,) = await loop.run_in_executor(None, store.lease, "r", 1, 0, set(), PARAMS)
        return a.queued_at, clock.wall()

    queued_at, wall = run_virtual(main())
    assert queued_at == DEFAULT_EPOCH + 5.0 == wall


SQL = re.compile(r"\.(execute|executemany|executescript)\(")


def test_every_sql_statement_of_the_data_role_is_in_its_store():
    outside = [
        f"{path.relative_to(DATA)}:{n}"
        for path in sorted(DATA.rglob("*.py"))
        if "store" not in path.relative_to(DATA).parts
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if SQL.search(line)
    ]
    assert outside == []
