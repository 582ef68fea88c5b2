"""Tiny random Qwen2 checkpoints in the HF format, for engine tests (no hub, seconds to build)."""

from __future__ import annotations

from pathlib import Path

EOS = 2


def tiny_qwen2(directory: Path, *, seed: int = 0, vocab: int = 64) -> Path:
    import torch
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,  # head dim 64: supported by vLLM's CPU attention
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=0.1,  # peaked next-token distributions: no near-ties for greedy
        bos_token_id=1,
        eos_token_id=EOS,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(config)
    model.save_pretrained(directory)
    return directory


def tiny_llama(directory: Path, *, seed: int = 0, vocab: int = 64) -> Path:
    """A tiny random Llama (the other architecture family the trainer is tested on)."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=EOS,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(directory)
    return directory
