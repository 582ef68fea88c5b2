"""Tiny random decoders in the HF format, for tests (no hub, seconds to build): the families a
user brings, each with the quirks publishing must get right (tied heads, fused projections,
logit soft-capping, per-head norms)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

EOS = 2

#: family -> (config class, model class, config settings beyond the common ones). Head size 64:
#: vLLM's CPU attention supports it (the config's own default may not be).
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"num_attention_heads": 2, "num_key_value_heads": 1}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 64, "tie_word_embeddings": True}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"num_attention_heads": 4, "num_key_value_heads": 2}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"head_dim": 64, "sliding_window": None}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 64, "tie_word_embeddings": True}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 64, "tie_word_embeddings": True}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),  # qkv and gate/up fused
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {"pad_token_id": 0}),
}  # fmt: skip


def tiny_model(
    directory: Path, family: str, *, seed: int = 0, vocab: int = 64, **settings: Any
) -> Path:
    """A tiny random model of ``family`` (a key of :data:`FAMILIES`), saved as HF does."""
    import torch
    import transformers

    config_class, model_class, own = FAMILIES[family]
    values: dict[str, Any] = {
        "vocab_size": vocab,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        "initializer_range": 0.1,  # peaked next-token distributions: no near-ties for greedy
        "bos_token_id": 1,
        "eos_token_id": EOS,
        "torch_dtype": "float32",
        **own,
        **settings,
    }
    config = getattr(transformers, config_class)(**values)
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config)
    model.save_pretrained(directory)
    return directory


def tiny_qwen2(directory: Path, *, seed: int = 0, vocab: int = 64) -> Path:
    return tiny_model(directory, "qwen2", seed=seed, vocab=vocab)


def tiny_llama(directory: Path, *, seed: int = 0, vocab: int = 64, tied: bool = False) -> Path:
    """A tiny random Llama (the other architecture family the trainer is tested on); ``tied``:
    the output head shares the embedding's weights (as Qwen2.5-0.5B and 1.5B do)."""
    return tiny_model(directory, "llama", seed=seed, vocab=vocab, tie_word_embeddings=tied)
