"""Repack migration as processes: manager, data and sim rollouts.

Sim engines make trajectories deterministic per id (tokens are a hash of seed, id and position),
so "the tokens it would have had without the move" is computable here: a local engine with the
same config runs the same ids uninterrupted. The vLLM version (greedy, KV state and re-prefill)
is scenario 1 of tests/slow/test_vllm_cluster.py.

One migration stays here as the ground truth over real processes and sockets; the other repack
scenarios (a refused move, a move with the data role down, the manager's periodic repack of a
ramping-down cluster) run on the in-process cluster in ``test_inproc_repack.py``, which imports
this module's engine settings and reference.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from laminar.engines import EngineRequest, SimEngineConfig, create_engine
from laminar.harness.launch import ProcessCluster
from laminar.roles.data.api import DataApi, SampleRequest
from laminar.roles.rollout import MigrateRequest, RolloutApi
from laminar.roles.rollout.api import DrainRequest
from laminar.trajectory import Trajectory

from ..support.clients import ClusterClients
from ..support.poll import until
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


async def reference(
    trajectories: list[Trajectory], seed: int = SIM["seed"]
) -> dict[str, tuple[list[int], list[float]]]:
    """The same trajectories generated start to finish on one engine (no move)."""
    engine = create_engine(
        SimEngineConfig.model_validate({**SIM, "seed": seed, "cost": {"batch_points": [[1, 1e-6]]}})
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


async def _in_flight(rollout, at_least):
    return (await rollout.state.call()).in_flight >= at_least


async def _finished(data):
    status = await data.status.call()
    return status if status.finished else None
