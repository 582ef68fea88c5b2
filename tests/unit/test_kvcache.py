"""KV cache sized in bytes from what the rollout needs, never from the machine's memory."""

from __future__ import annotations

import json

import pytest

from laminar.engines import VllmEngineConfig
from laminar.engines.kvcache import (
    MIN_BYTES,
    kv_bytes_per_token,
    needed_kv_bytes,
    rollout_kv_bytes,
)
from laminar.engines.vllm_engine import memory_args, platform_args
from laminar.runtime.errors import ConfigError

QWEN2_TINY = {
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_size": 128,
    "torch_dtype": "float32",
}


def test_bytes_per_token_counts_k_and_v_of_every_layer_and_kv_head():
    # 2 (K, V) x 2 layers x 2 KV heads x head dim 32 x 4 bytes
    assert kv_bytes_per_token(QWEN2_TINY) == 2 * 2 * 2 * 32 * 4
    assert kv_bytes_per_token(QWEN2_TINY, "bfloat16") == 2 * 2 * 2 * 32 * 2
    # an explicit head_dim wins over hidden/heads; no num_key_value_heads means MHA
    mha = {"num_hidden_layers": 1, "num_attention_heads": 8, "hidden_size": 512, "head_dim": 128}
    assert kv_bytes_per_token(mha, "float16") == 2 * 1 * 8 * 128 * 2


def test_bad_model_configs_say_what_is_missing():
    with pytest.raises(ConfigError, match="attention sizes"):
        kv_bytes_per_token({"hidden_size": 128})
    with pytest.raises(ConfigError, match="unknown KV-cache dtype"):
        kv_bytes_per_token(QWEN2_TINY, "int3")


def test_needed_bytes_cover_every_sequence_at_full_length_with_headroom():
    per_token = 1024
    need = needed_kv_bytes(per_token, max_num_seqs=32, max_model_len=1024)
    assert need >= 32 * 1024 * per_token * 1.25
    assert need % (1 << 20) == 0
    assert needed_kv_bytes(1, 1, 16) == MIN_BYTES  # never below one usable cache


def test_rollout_bytes_derive_from_the_model_directory_unless_set(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN2_TINY))
    cfg = VllmEngineConfig(model=str(tmp_path), max_model_len=1024, max_num_seqs=32)
    assert rollout_kv_bytes(cfg) == needed_kv_bytes(1024, 32, 1024) == 40 << 20
    cfg.kv_cache_bytes = "64MiB"  # validated on assignment
    assert rollout_kv_bytes(cfg) == 64 << 20
    with pytest.raises(ConfigError, match="does not exist"):
        rollout_kv_bytes(VllmEngineConfig(model=str(tmp_path / "nope")))


def test_sizes_parse_with_units_and_reject_nonsense():
    assert VllmEngineConfig(model="m", kv_cache_bytes="2GiB").kv_cache_bytes == 2 << 30
    assert VllmEngineConfig(model="m", kv_cache_bytes=4096).kv_cache_bytes == 4096
    for bad in ("lots", 0, -1):
        with pytest.raises(ValueError):
            VllmEngineConfig(model="m", kv_cache_bytes=bad)


def test_cpu_always_asks_for_bytes_gpu_only_when_set(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN2_TINY))
    cfg = VllmEngineConfig(model=str(tmp_path), max_model_len=1024, max_num_seqs=32)
    # on CPU the share of the machine is never what sizes the cache
    assert memory_args(cfg, cpu=True) == {"kv_cache_memory_bytes": 40 << 20}
    assert memory_args(cfg, cpu=False) == {"gpu_memory_utilization": 0.9}
    cfg.kv_cache_bytes = 1 << 30
    assert memory_args(cfg, cpu=False) == {
        "gpu_memory_utilization": 0.9,  # vLLM checks this share is free, whatever else is set
        "kv_cache_memory_bytes": 1 << 30,
    }


def test_cpu_prefills_whole_prompts():
    # seeded requests chunked on CPU kill vLLM's worker (engines/vllm_engine.platform_args)
    assert platform_args(cpu=True) == {"enable_chunked_prefill": False}
    assert platform_args(cpu=False) == {}
