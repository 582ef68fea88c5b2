"""A generation run as real processes: manager + data + rollouts, with a kill -9 of the data role.

Shared by the fast (sim engines) and slow (vLLM engines) integration tests.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import yaml

from laminar.harness.launch import ProcessCluster
from laminar.roles.data.api import DataApi, DataStatus, SampleRequest
from laminar.runtime.config import ClusterConfig
from laminar.runtime.context import transport_options
from laminar.runtime.rpc.client import RpcClient, remote
from laminar.trajectory import Trajectory

from .procs import TOKEN, env


def process_cluster(tmp: Path, config: Path) -> ProcessCluster:
    return ProcessCluster(config, tmp / "logs", env=env())


def write_config(tmp: Path, sections: dict[str, Any]) -> Path:
    config = {
        "cluster": {
            "heartbeat_interval_s": 0.25,
            "heartbeat_timeout_s": 2.0,
            "rpc_timeout_s": 10.0,
        },
        "manager": {"bind": "tcp://127.0.0.1:0", "metrics": None, "admin": "127.0.0.1:0"},
        **sections,
    }
    path = tmp / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def data_client(address: str) -> tuple[RpcClient, DataApi]:
    options = transport_options(ClusterConfig(), TOKEN.encode())
    client = RpcClient(address, options, timeout=10.0)
    return client, remote(DataApi, client)


async def wait_status(data: DataApi, predicate, timeout: float) -> DataStatus:
    async with asyncio.timeout(timeout):
        while True:
            status = await data.status.call()
            if predicate(status):
                return status
            await asyncio.sleep(0.2)


async def kill_data_midway(
    cluster: ProcessCluster,
    *,
    total: int,
    kill_after: int,
    timeout: float,
    config: Path | None = None,
) -> tuple[list[Trajectory], dict[str, Any]]:
    """Run to completion with one kill -9 of the data role once ``kill_after`` are done.

    Checks no completed trajectory and no acknowledged partial token is lost; returns every
    trajectory (consumed through ``sample``) and figures for the caller's own checks. The data
    role (``data-0``, from ``config`` or the cluster's) is left running.
    """
    data_info = cluster.serve("data", "data-0", config=config)
    client, data = data_client(data_info["address"])
    try:
        await wait_status(data, lambda s: s.trajectories >= kill_after, timeout)
        # The kill comes right after the snapshot: whatever was acknowledged by then must survive.
        done_before = set((await data.completed_ids.call()).ids)
        partial_before = (await data.partial_lengths.call()).lengths
        cluster.kill9("data-0")
    finally:
        await client.close()

    data_info = cluster.serve("data", "data-0", config=config)
    client, data = data_client(data_info["address"])
    try:
        done_after_restart = set((await data.completed_ids.call()).ids)
        lost = done_before - done_after_restart
        assert not lost, f"completed trajectories lost by kill -9: {sorted(lost)[:5]}"
        status = await wait_status(data, lambda s: s.finished, timeout)
        assert status.trajectories == total, status
        ids = (await data.completed_ids.call()).ids
        assert len(ids) == len(set(ids)) == total
        trajectories = (await data.sample.call(SampleRequest(n=total))).items
    finally:
        await client.close()
    by_id = {t.trajectory_id: t for t in trajectories}
    for tid, n in partial_before.items():  # acknowledged tokens were kept (resumed, not redone)
        assert len(by_id[tid].response_token_ids) >= n, (tid, n)
    return trajectories, {
        "done_before_kill": len(done_before),
        "partials_before_kill": len(partial_before),
        "status": json.loads(status.model_dump_json()),
    }
