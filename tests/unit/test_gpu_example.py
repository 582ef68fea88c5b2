"""examples/gpu stays valid on a CPU machine: its config loads and every role section validates
(the model path is the user's to fill in), and the README's memory table is what
examples/gpu/memory.py computes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from laminar.roles_registry import load_role
from laminar.runtime.config import load_config

GPU = Path(__file__).resolve().parents[2] / "examples" / "gpu"


def test_the_gpu_recipe_validates_as_a_sharded_bf16_cuda_run() -> None:
    config = load_config(GPU / "config.yaml")
    roles = {r.role for r in config.run.roles}
    sections = {role: config.role_config(role, load_role(role).config_model) for role in roles}
    trainer, rollout = sections["trainer"], sections["rollout"]
    assert (trainer.device, trainer.precision, trainer.sharding) == ("cuda", "bf16", "fsdp")
    assert trainer.activation_checkpointing and trainer.data_parallel == 2
    assert rollout.engine.backend == "vllm" and rollout.engine.gpu_memory_utilization == 0.85
    models = {trainer.model, rollout.engine.model, sections["data"].tokenizer}
    assert models == {"/path/to/Qwen2.5-1.5B-Instruct"}  # one placeholder for the user


def test_the_readme_memory_table_is_the_computed_one() -> None:
    spec = importlib.util.spec_from_file_location("gpu_memory", GPU / "memory.py")
    assert spec is not None and spec.loader is not None
    memory = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = memory  # its dataclasses look their module up
    try:
        spec.loader.exec_module(memory)
    finally:
        del sys.modules[spec.name]
    assert memory.table() in (GPU / "README.md").read_text()
    # the parameter counts match the published sizes of the Qwen2.5 checkpoints
    counts = [round(m.params / 1e9, 2) for m in memory.QWEN25]
    assert counts == [0.49, 1.54, 7.62]
