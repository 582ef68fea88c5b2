"""Where a rank's policy lives and in what precision: its device, its loading, bf16 autocast.

``device``: ``cuda`` takes GPU ``rank`` mod the count (one rank per GPU); ``auto`` is cuda when
torch sees a GPU. ``precision``: under ``bf16`` only the network runs in autocast; weights,
gradients, optimizer states and the log-softmax stay fp32 (:mod:`.compute`).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForCausalLM


def resolve_device(device: str, rank: int = 0) -> torch.device:
    """``auto``: cuda when torch sees a GPU, else cpu; ``cuda``: GPU ``rank`` mod the count."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("trainer.device is cuda but torch sees no GPU (a CPU build of torch?)")
    return torch.device("cuda", rank % torch.cuda.device_count())


def load_policy(
    path: str,
    device: torch.device | str = "cpu",
    *,
    activation_checkpointing: bool = False,
    compile: bool = False,
) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return for_training(model, activation_checkpointing, compile).to(device)


def layer_classes(model: torch.nn.Module) -> set[str]:
    """The transformer blocks: what HF marks as never to be split across devices."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    if not names:
        raise ValueError(
            f"{type(model).__name__} names no `_no_split_modules`: cannot tell its decoder layers"
        )
    return names


def for_training(model: Any, activation_checkpointing: bool, compile: bool = False) -> Any:
    """No KV cache (training never decodes), activation checkpointing if asked for, and each
    decoder layer compiled if asked for.

    Why per layer (as torchtitan does) and in place (``Module.compile``): one layer's graph
    serves them all, so compiling takes seconds, not minutes; FSDP2 then shards the compiled
    layers as it would the plain ones; and the parameters keep their names (``torch.compile``
    on the model would prefix them with ``_orig_mod.``, which every published version and
    checkpoint would carry). Shapes vary with every micro-batch, so the graphs are dynamic."""
    model.config.use_cache = False
    if activation_checkpointing:
        if not model.supports_gradient_checkpointing:
            raise ValueError(f"{type(model).__name__} does not support activation checkpointing")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if compile:
        layers = layer_classes(model)
        for module in model.modules():
            if type(module).__name__ in layers:
                module.compile(dynamic=True)
    return model


class Precision:
    """``model`` called under bf16 autocast (or as it is, for fp32): what ``token_logprobs``
    calls, so that only the network runs in low precision and the log-softmax stays fp32."""

    def __init__(self, model: torch.nn.Module, device: torch.device, precision: str) -> None:
        self.model, self.device_type = model, device.type
        self.enabled = precision == "bf16"

    def __call__(self, **inputs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=torch.bfloat16, enabled=self.enabled):
            return self.model(**inputs)

    def linear_head(self) -> tuple[Any, torch.Tensor] | None:
        """The model's decoder (called under the same autocast) and its head's weight, for
        :func:`laminar.rl.logprobs.linear_head`; None when its logits are not a plain product."""
        from laminar.rl.logprobs import linear_head

        head = linear_head(self.model)
        if head is None:
            return None
        decoder, weight = head

        def run(**inputs: Any) -> Any:
            with torch.autocast(self.device_type, dtype=torch.bfloat16, enabled=self.enabled):
                return decoder(**inputs)

        return run, weight
