"""``laminar run`` on a machine with GPUs: each role instance sees only its own."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from laminar.proc.gpus import gpu_env, gpus_wanted, parse_nvidia_smi, plan_gpus, visible_gpus
from laminar.roles.trainer.config import TrainerConfig
from laminar.roles_registry import load_role
from laminar.runtime.errors import ConfigError

SMI = """GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1f0e)
GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-2a1b)
GPU 2: NVIDIA H100 80GB HBM3 (UUID: GPU-3c2d)
GPU 3: NVIDIA H100 80GB HBM3 (UUID: GPU-4d3e)
"""


def test_the_gpus_this_machine_lets_the_run_use() -> None:
    assert parse_nvidia_smi(SMI) == ["0", "1", "2", "3"]
    assert parse_nvidia_smi("No devices were found\n") == []
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 5"}) == ["2", "5"]  # the user's choice
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []


def test_each_instance_gets_its_own_gpus_in_order() -> None:
    rollout = load_role("rollout").config_model
    tp2 = rollout.model_validate(
        {"engine": {"backend": "vllm", "model": "/m", "extra": {"tensor_parallel_size": 2}}}
    )
    trainer = TrainerConfig.model_validate({"model": "/m", "data_parallel": 2, "device": "auto"})
    served = TrainerConfig.model_validate(
        {"model": "/m", "data_parallel": 4, "device": "cuda", "ranks": "serve"}
    )
    assert gpus_wanted("trainer", served, True) == 1  # its ranks are processes of their own
    assert gpus_wanted("trainer_rank", None, True) == 1
    wants = [
        ("manager-0", 0.0),
        ("trainer-0", gpus_wanted("trainer", trainer, True)),
        ("rollout-0", gpus_wanted("rollout", tp2, True)),
        ("data-0", 0.0),
    ]
    plan = plan_gpus(["0", "1", "2", "3"], wants)
    assert plan == {"manager-0": [], "trainer-0": ["0", "1"], "rollout-0": ["2", "3"], "data-0": []}
    assert gpu_env({"A": "1"}, plan["data-0"]) == {"A": "1", "CUDA_VISIBLE_DEVICES": ""}
    assert gpu_env({"A": "1"}, None) == {"A": "1"}  # no GPUs: nothing set
    with pytest.raises(
        ConfigError, match=r"ask for 5 GPUs \(trainer-0 2, rollout-0 2, rollout-1 1\)"
    ):
        plan_gpus(["0", "1", "2", "3"], [("trainer-0", 2), ("rollout-0", 2), ("rollout-1", 1)])


def test_the_supervisor_gives_each_child_its_gpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from laminar.devmode.supervisor import Supervisor
    from laminar.runtime.config import load_config

    monkeypatch.setenv("LAMINAR_TOKEN", "gpu-plan-test-token-0123456789abcdef")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")  # the GPUs the user lets the run have
    vllm = {"backend": "vllm", "model": "/m", "extra": {"tensor_parallel_size": 2}}
    run = {
        "run_dir": str(tmp_path / "run"),
        "cpus": "off",
        "roles": [{"role": "manager"}, {"role": "rollout"}, {"role": "relay"}],
    }
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"run": run, "rollout": {"engine": vllm}}))
    sup = Supervisor(load_config(config), [])
    assert {c.name: c.gpus for c in sup.children} == {
        "manager-0": [],
        "rollout-0": ["4", "5"],
        "relay-0": [],
    }
    run["roles"].append({"role": "rollout", "section": "rollout", "count": 1})
    config.write_text(yaml.safe_dump({"run": run, "rollout": {"engine": vllm}}))
    with pytest.raises(ConfigError, match="ask for 4 GPUs"):
        Supervisor(load_config(config), [])
