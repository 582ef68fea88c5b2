"""``laminar model init``: a small, randomly initialised Qwen2 model for a task, in HF format.

Why Qwen2: it is the architecture every engine we target (vLLM on GPU and on CPU, HF
transformers for the trainer) supports first-class, so the same checkpoint directory runs in the
trainer, the relays' manifests and the rollouts without conversion. The defaults are sized for
CPU: hidden 128, 2 layers, 4 query / 2 KV heads (head dim 32, which vLLM's CPU attention supports),
MLP 384, ~0.4 M parameters, float32. The vocabulary is the task's character
tokenizer (see :mod:`laminar.recipe.tokenizer`), already a multiple of 16.

The directory holds ``config.json``, ``generation_config.json`` (EOS/pad ids), ``model.safetensors``
and the tokenizer files (a chat task's with its chat template: :mod:`.chat`). It is written
atomically (temp dir, then rename), so a crash never leaves a half-written model behind.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from laminar.runtime.errors import ConfigError

from .tokenizer import EOS, PAD, build_tokenizer, load_tokenizer, save_tokenizer, special_id

if TYPE_CHECKING:
    from .chat import ChatFormat

#: head dims vLLM's CPU attention backend accepts (hidden_size / num_attention_heads)
SUPPORTED_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 256)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclass(frozen=True)
class ModelShape:
    """The knobs of ``laminar model init`` (defaults = the CPU recipe of ``examples/arith``)."""

    hidden: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 384
    max_len: int = 1024
    rope_theta: float = 10_000.0
    tie_embeddings: bool = False

    def validate(self) -> None:
        if min(self.hidden, self.layers, self.heads, self.kv_heads, self.intermediate) < 1:
            raise ConfigError(f"model sizes must be positive: {asdict(self)}")
        if self.hidden % self.heads:
            raise ConfigError(f"hidden {self.hidden} is not a multiple of heads {self.heads}")
        if self.heads % self.kv_heads:
            raise ConfigError(f"heads {self.heads} is not a multiple of kv-heads {self.kv_heads}")
        head_dim = self.hidden // self.heads
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ConfigError(
                f"head dim {head_dim} (hidden/heads) is not one vLLM's CPU attention supports: "
                f"{SUPPORTED_HEAD_DIMS}"
            )


def qwen2_config(vocab_size: int, eos_id: int | list[int], pad_id: int, shape: ModelShape) -> Any:
    """The ``transformers.Qwen2Config`` of a model of this shape."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_len,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        tie_word_embeddings=shape.tie_embeddings,
        use_sliding_window=False,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
        dtype="float32",
        architectures=["Qwen2ForCausalLM"],
    )


def atomic_dir(out: str | Path) -> tuple[Path, Path]:
    """A fresh temp dir beside ``out`` to write into; pass both to :func:`commit_dir`."""
    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would hide the model from other users (a vLLM service)
    return tmp, out


def commit_dir(tmp: Path, out: Path) -> None:
    """Replace ``out`` by ``tmp`` (the old contents, if any, are removed after the swap)."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old.{os.getpid()}")
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def save_model_dir(
    model: Any,
    tokenizer_src: Path | None,
    out: str | Path,
    tok: Any = None,
    extra: dict[str, str] | None = None,
    chat: ChatFormat | None = None,
) -> Path:
    """Save an HF causal LM + tokenizer files + generation config atomically into ``out``.

    The tokenizer comes from ``tokenizer_src`` (a model dir whose files are copied) or ``tok``
    (with ``chat``, a chat model's: see :func:`.tokenizer.save_tokenizer`); ``extra`` maps more
    file names to their text (e.g. a training summary).
    """
    from transformers import GenerationConfig

    tmp, final = atomic_dir(out)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        cfg = model.config
        GenerationConfig(
            eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id, do_sample=False
        ).save_pretrained(tmp)
        if tok is not None:
            save_tokenizer(tok, tmp, chat)
        elif tokenizer_src is not None:
            for name in TOKENIZER_FILES:
                if (tokenizer_src / name).is_file():
                    shutil.copy2(tokenizer_src / name, tmp / name)
        for name, text in (extra or {}).items():
            (tmp / name).write_text(text)
        for path in tmp.iterdir():
            path.chmod(0o644)
        commit_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def init_model(
    alphabet: str, out: str | Path, shape: ModelShape, seed: int = 0, chat: ChatFormat | None = None
) -> Path:
    """Build the tokenizer and a randomly initialised Qwen2 model; write both to ``out``.

    With ``chat`` (a chat task's format, :mod:`.chat`) the tokenizer also has the format's
    special tokens and the characters of its role names, the directory carries its template, and
    the model's ``eos_token_id`` lists the end of turn first, then ``<eos>`` (an instruct model's
    pair: the rollouts' engine stops at either)."""
    import torch
    from transformers import Qwen2ForCausalLM

    shape.validate()
    if chat is None:
        tok = build_tokenizer(alphabet)
        eos: int | list[int] = special_id(tok, EOS)
    else:
        tok = build_tokenizer(alphabet + chat.text, chat.special_tokens)
        eos = [special_id(tok, chat.end_of_turn), special_id(tok, EOS)]
    config = qwen2_config(tok.get_vocab_size(), eos, special_id(tok, PAD), shape)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).float()
    return save_model_dir(model, None, out, tok=tok, chat=chat)


def check_model_dir(directory: str | Path) -> Path:
    """``directory`` if it holds a config, weights and a tokenizer; else a :class:`ConfigError`."""
    path = Path(directory)
    if not path.is_dir():
        raise ConfigError(f"model directory {directory} does not exist")
    for name in ("config.json", "tokenizer.json"):
        if not (path / name).is_file():
            raise ConfigError(f"model directory {directory} has no {name}")
    if not any(path.glob("*.safetensors")):
        raise ConfigError(f"model directory {directory} has no *.safetensors weights")
    return path


def load_model(directory: str | Path) -> tuple[Any, Any]:
    """``(model, tokenizer)`` from a model dir: float32 ``Qwen2ForCausalLM`` + ``tokenizers``."""
    import torch
    from transformers import AutoModelForCausalLM

    path = check_model_dir(directory)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model, load_tokenizer(path)


def count_parameters(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())
