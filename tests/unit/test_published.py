"""What a version holds: the checkpoint's names in the engines' dtype, and whether an engine takes it.

The trainer publishes what ``save_pretrained`` writes (no alias of a tied head: Gemma's engine has
no module for one and refused the whole version), in ``publish.dtype``; an engine checks a version
against its checkpoint's safetensors headers before loading any of it (``laminar.engines
.checkpoint``): unknown tensors are left out, missing or reshaped ones refuse the version.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from laminar.engines.checkpoint import IncompatibleWeights, checkpoint_tensors
from laminar.roles.trainer.compute import PolicyTrainer
from laminar.roles.trainer.config import TrainerConfig
from laminar.roles.trainer.published import published_keys
from laminar.roles.trainer.staging import copy_plan, whole_tensors
from laminar.roles_registry import load_role_config
from laminar.runtime.config import load_config
from laminar.weights.manifest import plan_specs
from laminar.weights.tensors import tensors_from

from ..support.models import FAMILIES, tiny_model


def _state_of(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_version_holds_exactly_what_the_checkpoint_holds(tmp_path: Path, family: str) -> None:
    model_dir = tiny_model(tmp_path / "model", family, vocab=96)
    trainer = PolicyTrainer(TrainerConfig(model=str(model_dir), metrics=None))
    saved = _state_of(model_dir)
    published = dict(trainer.named_weights())
    assert list(published) == [k for k in trainer.model.state_dict() if k in saved]
    assert published.keys() == saved.keys()
    for name, tensor in published.items():
        assert torch.equal(tensor, saved[name]), name
    tied = trainer.model.config.tie_word_embeddings
    assert ("lm_head.weight" in trainer.model.state_dict()) and (
        ("lm_head.weight" in published) != tied
    )
    # and the engine side agrees: nothing left out, nothing missing
    checkpoint = checkpoint_tensors(model_dir)
    assert checkpoint is not None and checkpoint.tied == tied
    assert checkpoint.fit({k: tuple(v.shape) for k, v in published.items()}, 1) == []


def test_bf16_publishing_casts_floats_into_a_half_size_version(tmp_path: Path) -> None:
    model_dir = tiny_model(tmp_path / "model", "qwen3", vocab=96)
    config = TrainerConfig(model=str(model_dir), metrics=None, publish={"dtype": "bfloat16"})
    trainer = PolicyTrainer(config)
    specs = trainer.weight_specs()
    assert {dtype for _, dtype, _ in specs} == {torch.bfloat16}
    manifest = plan_specs(specs, 1)
    full = plan_specs([(n, torch.float32, s) for n, _, s in specs], 1)
    assert sum(t.nbytes for t in manifest.tensors) * 2 == sum(t.nbytes for t in full.tensors)
    buffer = np.zeros(manifest.total_bytes, dtype=np.uint8)
    copy_plan(whole_tensors(trainer.model, manifest), memoryview(buffer))
    staged = dict(tensors_from(manifest, memoryview(buffer)))
    state = trainer.model.state_dict()
    for name, tensor in staged.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, state[name].to(torch.bfloat16)), name
    assert dict(trainer.named_weights()).keys() == staged.keys()


def test_the_publish_dtype_follows_the_rollouts_engine_unless_set(tmp_path: Path) -> None:
    def trainer_config(sections: dict) -> TrainerConfig:
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump(sections))
        _, model = load_role_config("trainer", tmp_path)
        return load_config(str(path), []).role_config("trainer", model)

    engine = {"engine": {"backend": "vllm", "model": "m", "dtype": "bfloat16"}}
    assert trainer_config({"trainer": {"model": "m"}, "rollout": engine}).publish.dtype == (
        "bfloat16"
    )
    own = {"trainer": {"model": "m", "publish": {"dtype": "float32", "chunks": 2}}}
    derived = trainer_config({**own, "rollout": engine}).publish
    assert (derived.dtype, derived.chunks) == ("float32", 2)
    kept = trainer_config({"trainer": {"model": "m", "publish": {"chunks": 3}}, "rollout": engine})
    assert (kept.publish.dtype, kept.publish.chunks) == ("bfloat16", 3)
    assert trainer_config({"trainer": {"model": "m"}}).publish.dtype == "auto"


def test_an_engine_leaves_out_unknown_tensors_and_refuses_missing_or_reshaped_ones(
    tmp_path: Path,
) -> None:
    checkpoint = checkpoint_tensors(tiny_model(tmp_path / "m", "gemma2", vocab=96))
    assert checkpoint is not None
    shapes = dict(checkpoint.shapes)
    # another trainer's tied head: left out, the rest loads
    assert checkpoint.fit({**shapes, "lm_head.weight": (96, 128)}, 2) == ["lm_head.weight"]
    missing = {k: v for k, v in shapes.items() if k != "model.norm.weight"}
    with pytest.raises(
        IncompatibleWeights, match=r"version 3 .*1 tensor\(s\) missing: model\.norm"
    ):
        checkpoint.fit(missing, 3)
    wrong = {**shapes, "model.embed_tokens.weight": (97, 128)}
    with pytest.raises(IncompatibleWeights, match=r"embed_tokens\.weight \[97, 128\]"):
        checkpoint.fit(wrong)
    assert checkpoint_tensors(tmp_path) is None  # nothing to check against: no safetensors


def test_a_checkpoint_may_keep_the_alias_of_a_tied_head(tmp_path: Path) -> None:
    """Some tied checkpoints store the head too; a version without it still loads whole."""
    model_dir = tiny_model(tmp_path / "m", "qwen3", vocab=96)
    from safetensors.torch import save_file

    state = _state_of(model_dir)
    save_file({**state, "lm_head.weight": state["model.embed_tokens.weight"].clone()},
              str(model_dir / "model.safetensors"))  # fmt: skip
    checkpoint = checkpoint_tensors(model_dir)
    assert checkpoint is not None and "lm_head.weight" in checkpoint.shapes
    assert checkpoint.fit({k: tuple(v.shape) for k, v in state.items()}) == []


def test_published_keys_of_an_untied_model_are_its_state_dict() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    assert list(published_keys(model)) == list(model.state_dict())
