"""The closed loop as processes: manager, data, relay, 2 sim rollouts and a real torch trainer.

Sim rollouts make this fast (the vLLM version is in tests/slow); the trainer, relay and weight
path are the real ones. Checks: every rollout loads each version it switches to with the trainer's
checksums and generates only with it afterwards; a trainer killed with -9 resumes from its last
checkpoint with the same version and cursor, and no trajectory is trained twice or skipped.
"""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import yaml

from laminar.harness.launch import ProcessCluster
from laminar.roles.rollout import RolloutService, WeightsHistory
from laminar.roles.trainer.api import TrainerStatus
from laminar.roles.trainer.checkpoint import latest_checkpoint, load_state
from laminar.roles.trainer.service import TrainerService

from ..support.clients import ClusterClients
from ..support.models import tiny_qwen2
from ..support.poll import until
from ..support.procs import threads_nice
from ..support.scenario import process_cluster, write_config
from ..support.task import write_prompts, write_tokenizer
from ..support.tensorboard import read_scalars

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def loop_config(tmp: Path, max_versions: int, rollout_engine: dict[str, Any]) -> Path:
    return write_config(
        tmp,
        {
            "data": {
                "prompts": str(write_prompts(tmp / "prompts.jsonl", 64)),
                "tokenizer": str(write_tokenizer(tmp / "tok")),
                "reward": "tests.support.task:reward_len",
                "samples_per_prompt": 4,
                "epochs": None,
                "store": str(tmp / "data.sqlite"),
                "sampling": {"max_tokens": 24},
                # backpressure, as examples/arith: rollouts rest once 4 batches wait, so roles
                # started later (a second vLLM engine, the trainer) are not starved of CPU
                "max_ahead": 32,
                "metrics": None,
            },
            "relay": {"weights_bind": "tcp://127.0.0.1:0", "metrics": None},
            "rollout": {
                "metrics": None,
                "concurrency": 8,
                "flush_interval_s": 0.1,
                "take_wait_s": 0.5,
                "engine": rollout_engine,
            },
            "trainer": {
                "metrics": None,
                "model": str(tmp / "model"),
                "batch": {"prompts": 2, "samples": 4, "micro_batch_rows": 8},
                "optim": {"lr": 1e-4},
                "threads_per_rank": 1,
                "max_versions": max_versions,
                "sample_wait_s": 0.5,
                "checkpoint": {"dir": str(tmp / "ckpt"), "keep": 2},
                "publish": {"chunks": 4},
                "metrics_file": str(tmp / "trainer.jsonl"),
            },
        },
    )


SIM = {
    "backend": "sim",
    "vocab_size": 64,
    "lengths": {"kind": "lognormal", "median": 8, "sigma": 0.5, "max_length": 24},
    "cost": {"batch_points": [[1, 0.004], [256, 0.006]], "prefill_s_per_token": 0},
}


class Clients(ClusterClients):
    def trainer(self, name: str = "trainer") -> TrainerService:
        return self.proxy(TrainerService, name)

    def rollout(self, name: str) -> RolloutService:
        return self.proxy(RolloutService, name)


def start_loop(cluster: ProcessCluster, rollouts: int = 2, *, together: bool = True) -> None:
    """Manager, data, a relay and ``rollouts``; ``together``: all members start at once.

    vLLM rollouts start one after another (``together=False``): two vLLM 0.32 CPU engines that
    initialised at the same moment left one hung after its KV cache set-up (seen here)."""
    cluster.serve("manager", "manager")
    members = [("data", "data"), ("relay", "relay-0")]
    rollout = [("rollout", f"rollout-{i}") for i in range(rollouts)]
    if together:
        cluster.serve_many(members + rollout, timeout=240)
        return
    cluster.serve_many(members)
    for role, name in rollout:
        cluster.serve(role, name, timeout=180)


def trajectories(store: Path) -> list[tuple[str, str, int, float]]:
    """(id, rollout, version, started_at) of every stored trajectory, read beside the data role."""
    with sqlite3.connect(f"file:{store}?mode=ro", uri=True) as db:
        rows = db.execute("SELECT body FROM trajectories").fetchall()
    import msgpack

    out = []
    for (body,) in rows:
        t = msgpack.unpackb(body)
        out.append((t["trajectory_id"], t["rollout"], t["version"], t["started_at"]))
    return out


async def check_rollouts_follow(
    clients: Clients, status: TrainerStatus, store: Path, rollouts: int
) -> dict[str, WeightsHistory]:
    """Each rollout loaded the trainer's bytes, and generated with nothing older afterwards."""
    histories = {}
    for i in range(rollouts):
        name = f"rollout-{i}"
        history = await clients.rollout(name).weights.call()
        assert history.loads, f"{name} never loaded a new version"
        for load in history.loads:
            assert load.digest == status.digests[load.version], (name, load.version)
        histories[name] = history
    for tid, rollout, version, started_at in trajectories(store):
        for load in histories[rollout].loads:
            if started_at > load.loaded_at:
                assert version >= load.version, (tid, rollout, version, load.version)
    return histories


async def wait_trained(trainer: TrainerService, published: int, timeout: float) -> TrainerStatus:
    """Until the trainer finished and the master relay verified version ``published``."""

    async def finished() -> TrainerStatus | None:
        s = await trainer.status.call()
        return s if not s.training and s.published >= published else None

    return await until(finished, timeout, 0.2)


async def wait_caught_up(clients: Clients, rollouts: int, version: int, timeout: float) -> None:
    async def caught_up() -> bool:
        hs = [await clients.rollout(f"rollout-{i}").weights.call() for i in range(rollouts)]
        return all(h.loads and h.loads[-1].version == version for h in hs)

    await until(caught_up, timeout, 0.2)


async def test_rollouts_follow_the_trainer(tmp_path: Path) -> None:
    tiny_qwen2(tmp_path / "model")
    config = loop_config(tmp_path, 4, SIM)
    with_nice = yaml.safe_load(config.read_text())
    with_nice["cluster"]["nice"] = 10
    config.write_text(yaml.safe_dump(with_nice))
    with process_cluster(tmp_path, config) as cluster:
        start_loop(cluster)
        cluster.serve("trainer", "trainer", timeout=120)
        # cluster.nice: 10 (laminar.proc.placement): the data role gives way, the trainer does not
        ours = os.getpriority(os.PRIO_PROCESS, 0)
        assert threads_nice(cluster.procs["data"].pid) == {max(10, ours)}
        assert threads_nice(cluster.procs["trainer"].pid) == {ours}
        clients = Clients(cluster)
        try:
            status = await wait_trained(clients.trainer(), 4, 150)
            assert set(status.digests) >= {1, 2, 3, 4}
            await wait_caught_up(clients, 2, 4, 60)
            await check_rollouts_follow(clients, status, tmp_path / "data.sqlite", 2)
        finally:
            await clients.close()
    # the policy's reward reaches the records (a batch gathered from trajectories scored before
    # the previous sample reply has none of its own)
    lines = (tmp_path / "trainer.jsonl").read_text().splitlines()
    generated = [json.loads(x).get("reward_generated", -1.0) for x in lines]
    assert any(g is not None for g in generated), generated
    assert all(g is None or 0.0 <= g <= 1.0 for g in generated), generated
    # the same records in TensorBoard, beside the metrics file, at step = version
    scalars = read_scalars(tmp_path / "tensorboard" / "trainer")
    records = [r for r in map(json.loads, lines) if not r.get("eval")]
    assert [r["version"] for r in records] == [1, 2, 3, 4]
    assert scalars["train/reward_mean"] == [
        (r["version"], pytest.approx(r["reward_mean"])) for r in records
    ]
    assert scalars["train/tokens"] == [(r["version"], r["tokens"]) for r in records]


async def test_trainer_kill_9_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    tiny_qwen2(tmp_path / "model")
    config = loop_config(tmp_path, 6, SIM)
    ckpt = tmp_path / "ckpt"
    with process_cluster(tmp_path, config) as cluster:
        start_loop(cluster)
        cluster.serve("trainer", "trainer", timeout=120)
        clients = Clients(cluster)
        try:
            trainer = clients.trainer()

            async def two_done() -> bool:
                return (await trainer.status.call()).version >= 2

            await until(two_done, 120, 0.05)
            cluster.kill9("trainer")
            saved = load_state(latest_checkpoint(ckpt))
            assert saved.version >= 1  # the kill may land mid-checkpoint: the previous one holds

            cluster.serve("trainer", "trainer", timeout=120)
            trainer = clients.trainer()
            status = await trainer.status.call()
            assert status.resumed_version == saved.version
            assert status.resumed_cursor == saved.cursor
            await wait_trained(trainer, 6, 150)
        finally:
            await clients.close()
    final = load_state(latest_checkpoint(ckpt))
    assert final.version == 6
    assert [h["version"] for h in final.history] == [1, 2, 3, 4, 5, 6]
    expected_first = 1
    trained: list[str] = []
    for h in final.history:  # consume-seq ranges are contiguous: nothing skipped, nothing twice
        first, last = h["seqs"]
        assert first == expected_first and last - first + 1 == len(h["ids"]) == 8, h["seqs"]
        expected_first = last + 1
        trained += h["ids"]
    assert len(trained) == len(set(trained)) == 48
    with sqlite3.connect(f"file:{tmp_path / 'data.sqlite'}?mode=ro", uri=True) as db:
        consumed = dict(
            db.execute(
                "SELECT trajectory_id, consume_seq FROM trajectories WHERE consume_seq <= ?",
                (final.cursor,),
            ).fetchall()
        )
    assert set(consumed) == set(trained)
