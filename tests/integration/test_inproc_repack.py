"""Repack migration on the in-process cluster (``laminar/harness/inproc.py``): manager, data and sim
rollouts in one event loop on virtual time.

The same scenarios and checks as the process tests in ``test_repack.py`` (the first of which
stays there as the ground truth over real processes and sockets): sim tokens are a hash of seed,
id and position, so "the tokens it would have had without the move" is computed by a local
engine running the same ids uninterrupted.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from laminar.harness.inproc import InprocCluster, inproc_cluster, run_inproc
from laminar.roles.data.api import DataApi, SampleRequest
from laminar.roles.data.leasing import HANDOFF_GRACE_S
from laminar.roles.rollout import MigrateRequest, RolloutApi
from laminar.roles.rollout.api import DrainRequest
from laminar.runtime.rpc.client import RpcClient, remote

from ..support.poll import until
from ..support.task import write_prompts, write_tokenizer
from .test_repack import MAX_TOKENS, PROMPTS, SAMPLES, SIM, reference

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def sections(tmp: Path, repack: dict | None = None, engine: dict | None = None) -> dict[str, Any]:
    return {
        "manager": {"repack": repack or {"enabled": False}},
        "data": {
            "prompts": str(write_prompts(tmp / "prompts.jsonl", PROMPTS)),
            "tokenizer": str(write_tokenizer(tmp / "tok")),
            "reward": "tests.support.task:reward_len",
            "samples_per_prompt": SAMPLES,
            "epochs": 1,
            "store": str(tmp / "data.sqlite"),
            "sampling": {"max_tokens": MAX_TOKENS},
        },
        "rollout": {
            "concurrency": 8,
            "flush_interval_s": 0.1,
            "take_wait_s": 0.5,
            "engine": engine or SIM,
        },
    }


def members(*rollouts: str) -> list[tuple[str, str]]:
    return [("data", "data")] + [("rollout", name) for name in rollouts]


async def _in_flight(rollout: RolloutApi, at_least: int) -> bool:
    return (await rollout.state.call()).in_flight >= at_least


async def _finished(data: DataApi):  # type: ignore[no-untyped-def]
    status = await data.status.call()
    return status if status.finished else None


def outcome(trajectories: list) -> list[tuple]:
    """What two runs of one seed must agree on: who generated what, when, of which length."""
    return sorted(
        (t.trajectory_id, t.rollout, t.version, len(t.response_token_ids), t.finished_at)
        for t in trajectories
    )


async def a_drained_mid_batch(cluster: InprocCluster) -> tuple[RolloutApi, DataApi]:
    """``rollout-a`` with a full batch in flight, every sequence with tokens (0.01 s steps) and
    none finished, drained: it takes no more from now on. Its proxy and the data role's."""
    a = cluster.proxy(RolloutApi, "rollout-a")
    data = cluster.proxy(DataApi, "data")
    await until(lambda: _in_flight(a, at_least=8), timeout=30)
    await asyncio.sleep(0.2)
    await a.drain.call(DrainRequest(reason="test"))
    return a, data


async def migrate_scenario(tmp: Path, seed: int) -> list[tuple]:
    async with inproc_cluster(
        sections(tmp), seed=seed, members=members("rollout-a", "rollout-b")
    ) as cluster:
        a, data = await a_drained_mid_batch(cluster)
        report = await a.migrate.call(
            MigrateRequest(destination="rollout-b", address=cluster.address("rollout-b"), version=0)
        )
        assert report.error == "" and not report.returned, report
        assert len(report.moved) >= 8 and report.mode == "reprefill", report
        assert report.tokens > 0
        assert (await a.state.call()).in_flight == 0

        status = await until(lambda: _finished(data), timeout=90)
        assert status.trajectories == PROMPTS * SAMPLES
        done = (await data.sample.call(SampleRequest(n=PROMPTS * SAMPLES))).items
        assert len({t.trajectory_id for t in done}) == PROMPTS * SAMPLES
        moved = [t for t in done if t.trajectory_id in set(report.moved)]
        assert len(moved) == len(report.moved)
        ref = await reference(moved, seed)
        for t in moved:
            assert t.rollout == "rollout-b" and t.version == 0
            tokens, logprobs = ref[t.trajectory_id]
            assert t.response_token_ids == tokens, t.trajectory_id
            assert t.logprobs == pytest.approx(logprobs, abs=1e-6)
        return outcome(done)


def test_migrate_moves_in_flight_trajectories_unchanged(tmp_path: Path) -> None:
    run_inproc(lambda: migrate_scenario(tmp_path, seed=3), seed=3)


async def refuse_scenario(tmp: Path, seed: int) -> list[tuple]:
    async with inproc_cluster(
        sections(tmp), seed=seed, members=members("rollout-a", "rollout-b")
    ) as cluster:
        a = cluster.proxy(RolloutApi, "rollout-a")
        await until(lambda: _in_flight(a, at_least=1), timeout=30)
        before = (await a.state.call()).in_flight
        report = await a.migrate.call(
            MigrateRequest(destination="rollout-b", address=cluster.address("rollout-b"), version=7)
        )
        assert "holds version 0" in report.error and not report.moved
        report = await a.migrate.call(
            MigrateRequest(destination="rollout-a", address=cluster.address("rollout-a"), version=0)
        )
        assert "itself" in report.error
        assert (await a.state.call()).in_flight >= min(before, 1)
        # The data role down: the leases cannot move, so the sequences go straight back into
        # a's engine (they used to be dropped, and came back later to an engine of another
        # version, which refused them for good).
        await cluster.kill("data")
        await until(lambda: _in_flight(a, at_least=1), timeout=30)
        report = await a.migrate.call(
            MigrateRequest(destination="rollout-b", address=cluster.address("rollout-b"), version=0)
        )
        assert "data role" in report.error and not report.moved, report
        assert report.returned and (await a.state.call()).in_flight >= len(report.returned)
        await cluster.restart("data")
        data = cluster.proxy(DataApi, "data")
        status = await until(lambda: _finished(data), timeout=90)
        assert status.trajectories == PROMPTS * SAMPLES
        assert status.failed == 0, status
        done = (await data.sample.call(SampleRequest(n=PROMPTS * SAMPLES))).items
        return outcome(done)


def test_migrate_refuses_a_wrong_version_and_keeps_everything(tmp_path: Path) -> None:
    run_inproc(lambda: refuse_scenario(tmp_path, seed=3), seed=3)


async def ramp_down_scenario(tmp: Path, seed: int) -> list[tuple]:
    """Prompts run out (epochs: 1), rollouts starve and ramp down; the manager's periodic repack
    consolidates their tails. Every trajectory completes once, on one version."""
    # Slow steps, so the tails outlive the time it takes to notice the ramp-down: an empty long
    # poll (take_wait_s), a heartbeat, a repack period.
    slow = {**SIM, "cost": {"batch_points": [[1, 0.03], [256, 0.035]], "prefill_s_per_token": 0}}
    config = sections(tmp, {"enabled": True, "period_s": 0.25, "batch_limit": 64}, engine=slow)
    rollouts = ("rollout-a", "rollout-b", "rollout-c")
    async with inproc_cluster(config, seed=seed, members=members(*rollouts)) as cluster:
        data = cluster.proxy(DataApi, "data")
        status = await until(lambda: _finished(data), timeout=120)
        assert status.trajectories == PROMPTS * SAMPLES
        done = (await data.sample.call(SampleRequest(n=PROMPTS * SAMPLES))).items
        assert len({t.trajectory_id for t in done}) == PROMPTS * SAMPLES
        assert all(t.version == 0 for t in done)
        events = repack_events(cluster)
        assert events, "no repack happened"
        moved = {tid for e in events for tid in e["trajectories"]}
        assert moved and not any(e["errors"] for e in events)
        by_id = {t.trajectory_id: t for t in done}
        destinations = {m["destination"] for e in events for m in e["moves"]}
        ref = await reference([by_id[tid] for tid in moved], seed)
        for tid in moved:
            assert by_id[tid].rollout in destinations
            assert by_id[tid].response_token_ids == ref[tid][0]
        return [*outcome(done), ("repacks", len(events), tuple(sorted(moved)))]


def repack_events(cluster: InprocCluster) -> list[dict[str, Any]]:
    """The manager's repack events (what its admin API serves at ``/v1/events``)."""
    manager = cluster.service("manager")
    return [e.data for e in manager.events.recent(kinds={"repack"})]


def test_manager_repacks_a_ramping_down_cluster(tmp_path: Path) -> None:
    run_inproc(lambda: ramp_down_scenario(tmp_path, seed=3), seed=3)


def test_a_seed_fixes_the_run(tmp_path: Path) -> None:
    """Two runs of one seed agree on every trajectory's rollout, length and finishing time (and
    on the repacks); another seed is another run."""
    runs = []
    for i, seed in enumerate((3, 3, 4)):
        tmp = tmp_path / str(i)
        tmp.mkdir()
        runs.append(run_inproc(lambda tmp=tmp, seed=seed: ramp_down_scenario(tmp, seed), seed=seed))
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


async def source_dies_scenario(tmp: Path, seed: int) -> None:
    """The source rollout dies while the destination takes its sequences in: the leases are the
    destination's already (the data role moved them first), so the destination must finish
    taking them in, although the call that brought them was cut with the source's connection
    (``ServiceContext.run_to_end``). Cut, it kept them in its table and never gave them to its
    engine: held by a live rollout that generated nothing, the run never finished."""
    async with inproc_cluster(
        sections(tmp), seed=seed, members=members("rollout-a", "rollout-b")
    ) as cluster:
        a, data = await a_drained_mid_batch(cluster)
        engine = cluster.service("rollout-b").engine
        importing, import_sequences = asyncio.Event(), engine.import_sequences

        async def slow_import(sequences: list) -> None:  # type: ignore[type-arg]
            importing.set()
            await asyncio.sleep(1.0)  # the source dies meanwhile
            await import_sequences(sequences)

        engine.import_sequences = slow_import
        migrate = asyncio.ensure_future(
            a.migrate.call(
                MigrateRequest(
                    destination="rollout-b", address=cluster.address("rollout-b"), version=0
                )
            )
        )
        await importing.wait()
        await cluster.kill("rollout-a")
        await asyncio.gather(migrate, return_exceptions=True)
        status = await until(lambda: _finished(data), timeout=90)
        assert status.trajectories == PROMPTS * SAMPLES


@pytest.mark.parametrize("seed", [3, 4])
def test_a_source_that_dies_during_the_hand_off_loses_nothing(tmp_path: Path, seed: int) -> None:
    run_inproc(lambda: source_dies_scenario(tmp_path, seed=seed), seed=seed)


async def manager_leaves_scenario(tmp: Path, seed: int) -> float:
    """The manager's ``migrate`` call is cut (the manager gone, its connection closed) after the
    data role has moved the leases to the destination and before the source has sent the
    sequences: the source still runs the migration to its end (``ServiceContext.run_to_end``),
    so the destination's engine takes them in at once, and the run finishes. Cut, the source
    stopped there with the sequences out of its table and its engine: held by the destination,
    generated by nobody, until the data role's hand-off grace ran out and it delivered them
    again. The (virtual) seconds from the cut to the destination's first import."""
    async with inproc_cluster(
        sections(tmp), seed=seed, members=members("rollout-a", "rollout-b")
    ) as cluster:
        _, data = await a_drained_mid_batch(cluster)
        leasing = cluster.service("data").leasing
        moved, transfer = asyncio.Event(), leasing.transfer

        async def slow_transfer(req):  # type: ignore[no-untyped-def]
            out = await transfer(req)
            moved.set()
            await asyncio.sleep(1.0)  # the leases are the destination's; the manager leaves
            return out

        leasing.transfer = slow_transfer
        engine = cluster.service("rollout-b").engine
        imports: list[float] = []
        import_sequences = engine.import_sequences

        async def timed_import(sequences: list) -> None:  # type: ignore[type-arg]
            imports.append(asyncio.get_running_loop().time())
            await import_sequences(sequences)

        engine.import_sequences = timed_import
        manager = RpcClient(cluster.address("rollout-a"), cluster.options, timeout=10.0)
        request = MigrateRequest(
            destination="rollout-b", address=cluster.address("rollout-b"), version=0
        )
        migrate = asyncio.ensure_future(remote(RolloutApi, manager).migrate.call(request))
        await moved.wait()
        cut = asyncio.get_running_loop().time()
        await manager.close()
        await asyncio.gather(migrate, return_exceptions=True)
        status = await until(lambda: _finished(data), timeout=180)
        assert status.trajectories == PROMPTS * SAMPLES
        assert imports, "the destination imported nothing"
        return imports[0] - cut


@pytest.mark.parametrize("seed", [3, 4])
def test_a_migration_whose_manager_left_still_hands_its_sequences_over(
    tmp_path: Path, seed: int
) -> None:
    waited = run_inproc(lambda: manager_leaves_scenario(tmp_path, seed=seed), seed=seed)
    assert waited < HANDOFF_GRACE_S / 10, waited  # handed over, not delivered again
