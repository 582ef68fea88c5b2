"""Repack migration as processes: manager, data and sim rollouts.

Sim engines make trajectories deterministic per id (tokens are a hash of seed, id and position),
so "the tokens it would have had without the move" is computable here: a local engine with the
same config runs the same ids uninterrupted. The vLLM version (greedy, KV state and re-prefill)
is in tests/slow/test_repack_vllm.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from laminar.engines import EngineRequest, SimEngineConfig, create_engine
from laminar.launch import ProcessCluster
from laminar.membership import MembershipApi
from laminar.roles.data.api import DataApi, SampleRequest
from laminar.roles.rollout import MigrateRequest, RolloutApi
from laminar.roles.rollout.api import DrainRequest
from laminar.trajectory import Trajectory

from ..support.clients import ClusterClients
from ..support.poll import until
from ..support.procs import TOKEN
from ..support.scenario import process_cluster, write_config
from ..support.task import write_prompts, write_tokenizer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

PROMPTS, SAMPLES, MAX_TOKENS = 8, 4, 300
SIM = {
    "backend": "sim",
    "vocab_size": 64,
    "seed": 3,
    "lengths": {"kind": "lognormal", "median": 150, "sigma": 0.6, "max_length": MAX_TOKENS},
    "cost": {"batch_points": [[1, 0.01], [256, 0.012]], "prefill_s_per_token": 0},
}


def repack_config(tmp: Path, repack: dict | None = None, engine: dict | None = None) -> Path:
    return write_config(
        tmp,
        {
            "manager": {
                "bind": "tcp://127.0.0.1:0",
                "metrics": None,
                "admin": "127.0.0.1:0",
                "repack": repack or {"enabled": False},
            },
            "data": {
                "prompts": str(write_prompts(tmp / "prompts.jsonl", PROMPTS)),
                "tokenizer": str(write_tokenizer(tmp / "tok")),
                "reward": "tests.support.task:reward_len",
                "samples_per_prompt": SAMPLES,
                "epochs": 1,
                "store": str(tmp / "data.sqlite"),
                "sampling": {"max_tokens": MAX_TOKENS},
                "metrics": None,
            },
            "rollout": {
                "metrics": None,
                "concurrency": 8,
                "flush_interval_s": 0.1,
                "take_wait_s": 0.5,
                "engine": engine or SIM,
            },
        },
    )


async def reference(trajectories: list[Trajectory]) -> dict[str, tuple[list[int], list[float]]]:
    """The same trajectories generated start to finish on one engine (no move)."""
    engine = create_engine(
        SimEngineConfig.model_validate({**SIM, "cost": {"batch_points": [[1, 1e-6]]}})
    )
    await engine.start()
    out: dict[str, tuple[list[int], list[float]]] = {}
    try:
        for t in trajectories:
            await engine.add_request(
                EngineRequest(
                    request_id=t.trajectory_id,
                    prompt_token_ids=t.prompt_token_ids,
                    params={"max_tokens": MAX_TOKENS},
                )
            )
            out[t.trajectory_id] = ([], [])
        pending = set(out)
        async with asyncio.timeout(30):
            async for batch in engine.outputs():
                for o in batch:
                    out[o.request_id][0].extend(o.token_ids)
                    out[o.request_id][1].extend(o.logprobs)
                    if o.finished:
                        pending.discard(o.request_id)
                if not pending:
                    break
    finally:
        await engine.close()
    return out


@contextlib.asynccontextmanager
async def running(
    tmp: Path, config: Path, rollouts: tuple[str, ...]
) -> AsyncIterator[tuple[ProcessCluster, ClusterClients]]:
    """Manager, data and ``rollouts`` as processes, and clients to them."""
    with process_cluster(tmp, config) as cluster:
        clients = ClusterClients(cluster)
        try:
            cluster.serve("manager", "manager")
            cluster.serve_many([("data", "data")] + [("rollout", name) for name in rollouts])
            yield cluster, clients
        finally:
            await clients.close()


async def test_migrate_moves_in_flight_trajectories_unchanged(tmp_path):
    async with running(tmp_path, repack_config(tmp_path), ("rollout-a", "rollout-b")) as (
        cluster,
        clients,
    ):
        a = clients.proxy(RolloutApi, "rollout-a")
        data = clients.proxy(DataApi, "data")

        # a has a full batch in flight, with tokens generated; it takes no more from now on
        await until(lambda: _in_flight(a, at_least=8), timeout=30)
        # long enough for every sequence to have tokens (0.01 s steps, 0.1 s flushes), short
        # enough that none finishes first: at 0.5 s a short one sometimes did, under load
        await asyncio.sleep(0.2)
        await a.drain.call(DrainRequest(reason="test"))
        report = await a.migrate.call(
            MigrateRequest(
                destination="rollout-b",
                address=cluster.info["rollout-b"]["address"],
                version=0,
            )
        )
        assert report.error == "" and not report.returned, report
        assert len(report.moved) >= 8 and report.mode == "reprefill", report
        assert report.tokens > 0 and report.total_s > 0
        assert (await a.state.call()).in_flight == 0

        status = await until(lambda: _finished(data), timeout=90)
        assert status.trajectories == PROMPTS * SAMPLES
        done = (await data.sample.call(SampleRequest(n=PROMPTS * SAMPLES))).items
        assert len({t.trajectory_id for t in done}) == PROMPTS * SAMPLES
        moved = [t for t in done if t.trajectory_id in set(report.moved)]
        assert len(moved) == len(report.moved)
        ref = await reference(moved)
        for t in moved:
            assert t.rollout == "rollout-b" and t.version == 0
            tokens, logprobs = ref[t.trajectory_id]
            assert t.response_token_ids == tokens, t.trajectory_id
            assert t.logprobs == pytest.approx(logprobs, abs=1e-6)


async def test_migrate_refuses_a_wrong_version_and_keeps_everything(tmp_path):
    async with running(tmp_path, repack_config(tmp_path), ("rollout-a", "rollout-b")) as (
        cluster,
        clients,
    ):
        a = clients.proxy(RolloutApi, "rollout-a")
        await until(lambda: _in_flight(a, at_least=1), timeout=30)
        before = (await a.state.call()).in_flight
        report = await a.migrate.call(
            MigrateRequest(
                destination="rollout-b", address=cluster.info["rollout-b"]["address"], version=7
            )
        )
        assert "holds version 0" in report.error and not report.moved
        report = await a.migrate.call(
            MigrateRequest(
                destination="rollout-a", address=cluster.info["rollout-a"]["address"], version=0
            )
        )
        assert "itself" in report.error
        assert (await a.state.call()).in_flight >= min(before, 1)
        # The data role down: the leases cannot move, so the sequences go straight back into
        # a's engine (they used to be dropped, and came back later to an engine of another
        # version, which refused them for good).
        cluster.kill9("data")
        await until(lambda: _in_flight(a, at_least=1), timeout=30)
        report = await a.migrate.call(
            MigrateRequest(
                destination="rollout-b", address=cluster.info["rollout-b"]["address"], version=0
            )
        )
        assert "data role" in report.error and not report.moved, report
        assert report.returned and (await a.state.call()).in_flight >= len(report.returned)
        cluster.serve("data", "data")
        data = clients.proxy(DataApi, "data")
        status = await until(lambda: _finished(data), timeout=90)
        assert status.trajectories == PROMPTS * SAMPLES
        assert status.failed == 0, status


async def _in_flight(rollout, at_least):
    return (await rollout.state.call()).in_flight >= at_least


async def _finished(data):
    status = await data.status.call()
    return status if status.finished else None


async def test_manager_repacks_a_ramping_down_cluster(tmp_path):
    """Prompts run out (epochs: 1), rollouts starve and ramp down; the manager's periodic repack
    consolidates their tails. Every trajectory completes once, on one version."""
    # Slow steps, so the tails outlive the time it takes to notice the ramp-down: an empty long
    # poll (take_wait_s), a heartbeat, a repack period. Same seed and lengths as SIM, so the
    # reference tokens are the same.
    slow = {**SIM, "cost": {"batch_points": [[1, 0.03], [256, 0.035]], "prefill_s_per_token": 0}}
    config = repack_config(
        tmp_path, {"enabled": True, "period_s": 0.25, "batch_limit": 64}, engine=slow
    )
    async with running(tmp_path, config, ("rollout-a", "rollout-b", "rollout-c")) as (_, clients):
        data = clients.proxy(DataApi, "data")
        status = await until(lambda: _finished(data), timeout=120)
        assert status.trajectories == PROMPTS * SAMPLES
        done = (await data.sample.call(SampleRequest(n=PROMPTS * SAMPLES))).items
        assert len({t.trajectory_id for t in done}) == PROMPTS * SAMPLES
        assert all(t.version == 0 for t in done)

        members = (await clients.proxy(MembershipApi, "manager").status.call()).members
        admin = next(m.endpoints["admin"] for m in members if m.role == "manager")
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
            async with http.get(f"{admin}/v1/events", params={"format": "json"}) as r:
                events = [e for e in await r.json() if e["kind"] == "repack"]
        assert events, "no repack happened"
        moved = {tid for e in events for tid in e["data"]["trajectories"]}
        assert moved and not any(e["data"]["errors"] for e in events)
        by_id = {t.trajectory_id: t for t in done}
        destinations = {m["destination"] for e in events for m in e["data"]["moves"]}
        ref = await reference([by_id[tid] for tid in moved])
        for tid in moved:
            assert by_id[tid].rollout in destinations
            assert by_id[tid].response_token_ids == ref[tid][0]
