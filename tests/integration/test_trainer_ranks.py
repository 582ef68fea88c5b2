"""Trainer ranks as their own processes (``trainer.ranks: serve``), meeting through the manager.

Processes: manager, data, relay, a sim rollout, the trainer (rank 0 of a 2-rank FSDP group) and
one ``trainer_rank`` process. The rank is killed with -9 after a few versions: rank 0 must not
exit but re-form the group (a new generation) once the rank is restarted, from its last
checkpoint plus the batches trained since, and go on to ``max_versions`` with a contiguous
history, nothing trained twice or skipped; and the rollout keeps generating while the group is
down.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
import yaml

from laminar.roles.data.api import DataApi
from laminar.roles.trainer.checkpoint import latest_checkpoint, load_state
from laminar.roles.trainer.rank import TrainerRankService

from ..support.models import tiny_qwen2
from ..support.poll import until
from ..support.scenario import process_cluster
from .test_rl_loop import SIM, Clients, loop_config, start_loop, wait_trained

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def ranks_config(tmp: Path, max_versions: int) -> Path:
    path = loop_config(tmp, max_versions, SIM)
    config = yaml.safe_load(path.read_text())
    config["trainer"].update(data_parallel=2, sharding="fsdp", ranks="serve")
    config["trainer_rank"] = {"metrics": None, "seat_wait_s": 2.0}
    # no backpressure: the rollout must be free to go on generating while the trainer waits;
    # at a tenth of SIM's speed (25 trajectories/s, not 250: the data role stored ~17,000 in
    # this test and spent 27 s of CPU on them, the most of any process in it)
    config["data"]["max_ahead"] = None
    config["rollout"]["engine"]["cost"] = {
        "batch_points": [[1, 0.04], [256, 0.06]],
        "prefill_s_per_token": 0,
    }
    path.write_text(yaml.safe_dump(config))
    return path


async def test_a_killed_rank_rejoins_and_training_continues(tmp_path: Path) -> None:
    tiny_qwen2(tmp_path / "model")
    ckpt = tmp_path / "ckpt"
    with process_cluster(tmp_path, ranks_config(tmp_path, 5)) as cluster:
        start_loop(cluster, rollouts=1)
        cluster.serve("trainer_rank", "rank-a")  # waits for a seat: the trainer offers one
        cluster.serve("trainer", "trainer", timeout=180)  # ready once its group has formed
        clients = Clients(cluster)
        try:
            trainer = clients.trainer()
            rank = clients.proxy(TrainerRankService, "rank-a")
            first = await rank.status.call()
            assert first.rank == 1 and first.world == 2 and first.served == [first.generation]

            async def two_done() -> bool:
                return (await trainer.status.call()).version >= 2

            await until(two_done, 150, 0.1)
            cluster.kill9("rank-a")
            data = clients.proxy(DataApi, "data")
            before = (await data.status.call()).trajectories

            async def generated() -> bool:  # the group cannot form again: its rank is dead
                return (await data.status.call()).trajectories > before + 8

            await until(generated, 60, 0.2)
            cluster.serve("trainer_rank", "rank-a")
            rank = clients.proxy(TrainerRankService, "rank-a")
            status = await wait_trained(trainer, 5, 200)
            assert status.resumed_from is None  # rank 0 never restarted: it re-formed the group
            again = await rank.status.call()
            assert again.served and again.served[0] > first.generation
        finally:
            await clients.close()
    final = load_state(latest_checkpoint(ckpt))
    assert final.version == 5
    assert [h["version"] for h in final.history] == [1, 2, 3, 4, 5]
    expected_first = 1
    trained: list[str] = []
    for h in final.history:  # consume-seq ranges are contiguous: nothing skipped, nothing twice
        first_seq, last = h["seqs"]
        assert first_seq == expected_first and last - first_seq + 1 == len(h["ids"]) == 8
        expected_first = last + 1
        trained += h["ids"]
    assert len(trained) == len(set(trained)) == 40
    with sqlite3.connect(f"file:{tmp_path / 'data.sqlite'}?mode=ro", uri=True) as db:
        consumed = dict(
            db.execute(
                "SELECT trajectory_id, consume_seq FROM trajectories WHERE consume_seq <= ?",
                (final.cursor,),
            ).fetchall()
        )
    assert set(consumed) == set(trained)
