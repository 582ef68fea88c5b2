"""Greedy decoding without copying the KV cache: grouped-query attention done by the kernel.

Every held-out evaluation (the trainer's, ``laminar eval``, SFT's stop checks) decodes with HF's
``generate`` on a left-padded batch. The task models have fewer key/value heads than query heads
(grouped-query attention, as Qwen2 and Llama have), and transformers' ``sdpa`` attention, given
an attention mask, expands the keys and values to one head per query head (``repeat_kv``: a copy
of the whole cache, every layer, every decoding step) because on CUDA that keeps SDPA on its fast
kernels. On a CPU that copy is most of the decoding time (docs/benchmarks.md, *Evaluation*),
and its cost grows with the square of the response length.
``torch.nn.functional.scaled_dot_product_attention`` takes the grouped heads itself
(``enable_gqa``), masked or not, with the same result (the same greedy tokens, which the recipe's
tests hold it to).

:func:`fast_attention` switches a model to that for the duration: a model on a CPU whose layers
are not compiled (for anything but plain masked attention it hands over to transformers' own).
Training is left on ``sdpa``: a training step expands the keys once per layer, not once per
token. ``benchmarks/evaluation.py`` measures the difference.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

#: the attention implementation's name, registered with transformers on first use
NAME = "laminar_gqa_sdpa"


def gqa_sdpa(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Any, None]:
    """transformers' ``sdpa`` attention, with the key/value heads left grouped (see the module)."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.device.type != "cpu" or kwargs.get("position_bias") is not None or kwargs.get("cache"):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=bool(query.shape[2] > 1 and attention_mask is None and causal),
        enable_gqa=getattr(module, "num_key_value_groups", 1) > 1,
    )
    return out.transpose(1, 2).contiguous(), None


@functools.cache
def _register() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(NAME, gqa_sdpa)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # the masks sdpa takes


def _switchable(model: Any) -> bool:
    """``model`` attends with ``sdpa``, on a CPU, with no layer compiled: a compiled layer
    guards on its config, so a switch there and back would recompile it for every evaluation
    (``trainer.compile``, which is slow)."""
    if getattr(getattr(model, "config", None), "_attn_implementation", None) != "sdpa":
        return False
    if any(p.device.type != "cpu" for p in model.parameters()):
        return False
    return not any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())


@contextlib.contextmanager
def fast_attention(model: Any) -> Iterator[None]:
    """``model`` decodes with :func:`gqa_sdpa` for the duration, if it can switch
    (:func:`_switchable`); its implementation as it was afterwards."""
    if not _switchable(model):
        yield
        return
    before = model.config._attn_implementation
    _register()
    model.set_attn_implementation(NAME)
    try:
        yield
    finally:
        model.set_attn_implementation(before)
