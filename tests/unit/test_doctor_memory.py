"""``laminar doctor`` predicts each role's memory from the model and the config, and refuses a run
that does not fit the machine, with the numbers (laminar/doctor/memory.py).

The model is the shape of Qwen2.5-0.5B (494 M parameters, a 152k vocabulary, tied): its
safetensors file holds the real header and is sparse, so the test writes kilobytes, not 2 GB.
The machine is made up: the 24 GiB of the project's machines, 23.2 GiB available.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from laminar.doctor.checks import check_role_memory
from laminar.doctor.needs import needs_from_config
from laminar.runtime.config import load_config

from .test_doctor import GiB, NumaNode, small_machine

ROOT = Path(__file__).resolve().parents[2]
SHAPE = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
}


def half_billion(directory: Path) -> Path:
    """config.json and a sparse model.safetensors of the 0.5B shape (fp32)."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(SHAPE))
    h, i, v = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["vocab_size"]
    kv = 2 * 64
    shapes = {"model.embed_tokens.weight": [v, h], "model.norm.weight": [h]}
    for n in range(SHAPE["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes |= {
            p + "self_attn.q_proj.weight": [h, h], p + "self_attn.q_proj.bias": [h],
            p + "self_attn.k_proj.weight": [kv, h], p + "self_attn.k_proj.bias": [kv],
            p + "self_attn.v_proj.weight": [kv, h], p + "self_attn.v_proj.bias": [kv],
            p + "self_attn.o_proj.weight": [h, h], p + "mlp.gate_proj.weight": [i, h],
            p + "mlp.up_proj.weight": [i, h], p + "mlp.down_proj.weight": [h, i],
            p + "input_layernorm.weight": [h], p + "post_attention_layernorm.weight": [h],
        }  # fmt: skip
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = math.prod(shape) * 4
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    with (directory / "model.safetensors").open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    (directory / "tokenizer.json").write_text("{}")
    return directory


def arith_with(model: Path, tmp: Path, rollouts: int, dtype: str | None = None) -> Path:
    """The arith example's config with the 0.5B model and the issue's small batch (2 prompts x
    4 samples, 48-token responses)."""
    config = yaml.safe_load((ROOT / "examples" / "arith" / "config.yaml").read_text())
    config["data"] |= {"tokenizer": str(model), "sampling": {"max_tokens": 48}}
    config["trainer"] |= {"model": str(model), "eval": None}
    config["trainer"]["batch"] |= {"prompts": 2, "samples": 4}
    config["rollout"]["engine"] |= {"model": str(model)}
    config["rollout"]["engine"].pop("kv_cache_bytes")  # the default size
    if dtype is not None:
        config["rollout"]["engine"]["dtype"] = dtype
    for spec in config["run"]["roles"]:
        if spec["role"] == "rollout":
            spec["count"] = rollouts
    path = tmp / f"arith-{rollouts}-{dtype}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def machine() -> object:
    return small_machine(nodes=(NumaNode(0, frozenset({0, 1}), int(23.5 * GiB), int(23.2 * GiB)),))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return half_billion(tmp_path_factory.mktemp("m") / "qwen05")


def test_the_half_billion_model_fits_with_one_rollout_and_not_with_two(
    model: Path, tmp_path: Path
) -> None:
    """Engines in bf16 (and so versions published in bf16): one rollout fits, two do not. In
    fp32 not even one does: the arith config as it is (16-row micro-batches without activation
    checkpointing, a 1024-token context for 32 sequences) is what was OOM-killed."""
    findings = {}
    for n in (1, 2):
        path = arith_with(model, tmp_path, n, "bfloat16")
        (findings[n],) = check_role_memory(machine(), needs_from_config(load_config(str(path), [])))  # type: ignore[arg-type]
    fp32 = needs_from_config(load_config(str(arith_with(model, tmp_path, 1)), []))
    (findings[0],) = check_role_memory(machine(), fp32)  # type: ignore[arg-type]
    assert findings[0].severity == "blocker", findings[0]
    assert findings[1].severity in ("ok", "warning"), findings[1]
    refused = findings[2]
    assert refused.severity == "blocker" and "does not fit" in refused.found
    # the numbers: each role with its parts, the total, what the machine has
    assert "23.2 GiB available" in refused.found
    for part in ("trainer-0", "weights+grads+optimizer 7.4 GiB", "staging", "rollout-1",
                 "relay-0", "versions 1.8 GiB"):  # fmt: skip
        assert part in refused.found, (part, refused.found)
    assert "run fewer rollouts" in refused.fix and "trainer-0" in refused.fix


def test_the_prediction_follows_the_settings_that_change_it(model: Path, tmp_path: Path) -> None:
    def trainer(path: Path) -> dict[str, int]:
        needs = needs_from_config(load_config(str(path), []))
        return next(r for r in needs.memory if r.name == "trainer-0").parts

    fp32 = trainer(arith_with(model, tmp_path, 1))
    bf16 = trainer(arith_with(model, tmp_path, 1, "bfloat16"))
    assert bf16["staging"] * 2 == fp32["staging"]  # publish.dtype follows the engine's
    assert bf16["weights+grads+optimizer"] == fp32["weights+grads+optimizer"] == 494032768 * 16
    # a 152k vocabulary: logprobs are taken a chunk at a time (auto), never whole logits
    assert fp32["logprobs"] < 2 * GiB
    path = arith_with(model, tmp_path, 1)
    config = yaml.safe_load(path.read_text())
    config["trainer"] |= {"logprobs": "full", "activation_checkpointing": True}
    path.write_text(yaml.safe_dump(config))
    full = trainer(path)
    assert full["logprobs"] > fp32["logprobs"] and full["activations"] < fp32["activations"]


def test_a_config_whose_model_is_missing_predicts_what_it_can(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    config = yaml.safe_load((ROOT / "examples" / "arith" / "config.yaml").read_text())
    config["trainer"]["model"] = config["rollout"]["engine"]["model"] = str(missing)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    needs = needs_from_config(load_config(str(path), []))
    assert not any(r.name.startswith("trainer") for r in needs.memory)
    (finding,) = check_role_memory(replace(machine()), needs)  # type: ignore[arg-type]
    assert finding.severity == "ok"


def test_a_head_size_the_cpu_attention_cannot_run_is_refused(tmp_path: Path) -> None:
    from laminar.doctor.checks import check_head_size

    from ..support.models import tiny_model

    def findings(head: int) -> list:  # type: ignore[type-arg]
        model = tiny_model(tmp_path / f"h{head}", "llama", head_dim=head)
        config = yaml.safe_load((ROOT / "examples" / "arith" / "config.yaml").read_text())
        config["rollout"]["engine"]["model"] = str(model)
        path = tmp_path / f"c{head}.yaml"
        path.write_text(yaml.safe_dump(config))
        return check_head_size(machine(), needs_from_config(load_config(str(path), [])))  # type: ignore[arg-type]

    (refused,) = findings(40)
    assert refused.severity == "blocker" and "heads of 40" in refused.found
    assert findings(48) == [] and findings(64) == []
