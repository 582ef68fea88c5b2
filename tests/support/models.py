"""Tiny random Qwen2 and Llama checkpoints in the HF format, for tests (no hub, seconds to build)."""

from __future__ import annotations

from pathlib import Path

EOS = 2


def tiny_qwen2(directory: Path, *, seed: int = 0, vocab: int = 64) -> Path:
    # head dim 64: supported by vLLM's CPU attention
    return _tiny(directory, seed, "Qwen2", vocab, num_attention_heads=2, num_key_value_heads=1)


def tiny_llama(directory: Path, *, seed: int = 0, vocab: int = 64, tied: bool = False) -> Path:
    """A tiny random Llama (the other architecture family the trainer is tested on); ``tied``:
    the output head shares the embedding's weights (as Qwen2.5-0.5B and 1.5B do)."""
    return _tiny(
        directory, seed, "Llama", vocab, tied, num_attention_heads=4, num_key_value_heads=2
    )


def _tiny(
    directory: Path, seed: int, family: str, vocab: int, tied: bool = False, **heads: int
) -> Path:
    import torch
    import transformers

    config = getattr(transformers, f"{family}Config")(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        max_position_embeddings=512,
        tie_word_embeddings=tied,
        initializer_range=0.1,  # peaked next-token distributions: no near-ties for greedy
        bos_token_id=1,
        eos_token_id=EOS,
        torch_dtype="float32",
        **heads,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    model.save_pretrained(directory)
    return directory
