"""Multi-turn episodes as real processes: manager + data + 2 sim rollouts; one rollout gets kill -9
while it holds episodes whose observations the data role has acknowledged.

The in-process twin (``test_inproc_episodes.py``) covers the same rules on virtual time; this one
crosses real sockets and a real SIGKILL, with the environment's real (``asyncio.sleep``) latency.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from laminar.roles.data.api import SampleRequest
from tests.support.poll import until
from tests.support.scenario import data_client, process_cluster, wait_status, write_config
from tests.support.task import write_prompts, write_tokenizer

from .test_inproc_episodes import MAX_TURNS, _tokenizer, check_episode

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def episodes_in_flight(store: Path, rollout: str) -> dict[str, int]:
    """Trajectories leased to ``rollout`` whose stored tokens hold an observation: their lengths."""
    db = sqlite3.connect(f"file:{store}?mode=ro", uri=True)
    try:
        rows = db.execute(
            "SELECT p.trajectory_id, MAX(p.stop) FROM partials p JOIN samples s "
            "ON s.trajectory_id = p.trajectory_id WHERE s.state = 'leased' AND s.rollout = ? "
            "GROUP BY p.trajectory_id HAVING SUM(p.env_spans IS NOT NULL) > 0",
            (rollout,),
        ).fetchall()
    finally:
        db.close()
    return dict(rows)


async def test_kill_9_of_a_rollout_mid_episode_loses_no_episode(tmp_path: Path) -> None:
    total = 24 * 4
    store = tmp_path / "data.sqlite"
    config = write_config(
        tmp_path,
        {
            "data": {
                "prompts": str(write_prompts(tmp_path / "prompts.jsonl", 24)),
                "tokenizer": str(write_tokenizer(tmp_path / "tok")),
                "env": {"spec": "tests.support.envs:CountingEnv", "max_turns": MAX_TURNS},
                "samples_per_prompt": 4,
                "store": str(store),
                "metrics": None,
            },
            "rollout": {
                "metrics": None,
                "concurrency": 8,
                "flush_interval_s": 0.1,
                "engine": {
                    "backend": "sim",
                    "vocab_size": 17,
                    "lengths": {"kind": "longtail", "median": 60, "max_length": 400},
                    "cost": {"batch_points": [[1, 0.004], [256, 0.008]], "prefill_s_per_token": 0},
                },
            },
        },
    )
    with process_cluster(tmp_path, config) as cluster:
        cluster.serve("manager", "manager")
        info = cluster.serve("data", "data-0")
        for i in range(2):
            cluster.serve("rollout", f"rollout-{i}")
        client, data = data_client(info["address"])
        try:

            async def two_mid_episode() -> dict[str, int] | None:
                held = episodes_in_flight(store, "rollout-1")
                return held if len(held) >= 2 else None

            held = await until(two_mid_episode, timeout=60, interval=0.05)
            cluster.kill9("rollout-1")
            status = await wait_status(data, lambda s: s.finished, timeout=150)
            assert status.trajectories == total and status.failed == 0, status
            assert status.reward_errors == 0, status
            done = (await data.sample.call(SampleRequest(n=total))).items
        finally:
            await client.close()
    tok = _tokenizer(tmp_path)
    by_id = {t.trajectory_id: t for t in done}
    assert len(by_id) == total
    for t in done:
        check_episode(t, tok)
    for tid, n in held.items():  # continued on the other rollout from the acknowledged tokens
        assert by_id[tid].rollout == "rollout-0", tid
        assert len(by_id[tid].response_token_ids) >= n, (tid, n)
