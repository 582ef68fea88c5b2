"""How many bytes of KV cache a vLLM rollout needs: a pure function of its settings and model.

Why bytes, and why here: vLLM on CPU sizes its KV cache as ``gpu_memory_utilization`` x the
memory of the worker's NUMA node, minus the worker's own RSS. That depends on the machine, not
on the rollout: where node 0 holds a small share of the memory, a small share of that node is
less than the worker's RSS, the request goes negative and the engine refuses to start. A rollout's
need is known in advance (``max_num_seqs`` sequences of at most ``max_model_len`` tokens, each
token costing ``2 x layers x kv_heads x head_dim x dtype bytes``), so on CPU we always ask vLLM
for that many bytes (``kv_cache_memory_bytes``), with headroom; on GPUs
``gpu_memory_utilization`` bounds the engine as vLLM intends, and an explicit ``kv_cache_bytes``
sizes the cache within it.

Nothing here imports vLLM or torch: ``laminar doctor`` uses the same arithmetic to say whether a
configured cache fits the machine before anything starts.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from laminar.runtime.errors import ConfigError

#: bytes per element of the dtypes a KV cache is kept in (vLLM keeps it in the model's dtype)
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "fp8": 1}
#: the derived default asks for this much more than the worst case (block rounding, prefix reuse)
HEADROOM = 1.25
#: and never less than this (vLLM needs whole blocks for every layer)
MIN_BYTES = 16 << 20


def model_config(model_dir: str | Path) -> dict[str, Any]:
    """The model's ``config.json`` (a :class:`ConfigError` naming the file if it is missing)."""
    path = Path(model_dir) / "config.json"
    try:
        return dict(json.loads(path.read_text()))
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist: rollout.engine.model must be an HF model "
                          "directory, or set rollout.engine.kv_cache_bytes") from None  # fmt: skip
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read it ({exc})") from None


def _language(config: dict[str, Any]) -> dict[str, Any]:
    """Multimodal wrappers keep the language model's sizes in ``text_config``."""
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


def head_dim(config: dict[str, Any]) -> int | None:
    """The attention's head size of an HF ``config.json`` (None: the config does not say)."""
    config = _language(config)
    try:
        heads = int(config["num_attention_heads"])
        return int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None


def kv_bytes_per_token(config: dict[str, Any], dtype: str = "auto") -> int:
    """Bytes of K and V one token occupies across all layers, for an HF ``config.json``.

    ``dtype`` is the engine's (``auto`` = the model's own ``torch_dtype``/``dtype``).
    """
    config = _language(config)
    try:
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"model config lacks the attention sizes ({exc!r})") from None
    if dtype == "auto":
        dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"unknown KV-cache dtype {dtype!r}; known: {sorted(DTYPE_BYTES)}")
    return 2 * layers * kv_heads * head_dim * DTYPE_BYTES[dtype]


def needed_kv_bytes(per_token: int, max_num_seqs: int, max_model_len: int) -> int:
    """The derived default: every sequence at full length, x :data:`HEADROOM`, whole MiB."""
    need = per_token * max_num_seqs * max_model_len * HEADROOM
    return max(MIN_BYTES, math.ceil(need / (1 << 20)) << 20)


def rollout_kv_bytes(cfg: Any) -> int:
    """The KV-cache bytes of a :class:`~laminar.engines.configs.VllmEngineConfig`: its
    ``kv_cache_bytes`` if set, else :func:`needed_kv_bytes` for its model and limits."""
    if cfg.kv_cache_bytes is not None:
        return int(cfg.kv_cache_bytes)
    per_token = kv_bytes_per_token(model_config(cfg.model), cfg.dtype)
    return needed_kv_bytes(per_token, cfg.max_num_seqs, cfg.max_model_len)


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
