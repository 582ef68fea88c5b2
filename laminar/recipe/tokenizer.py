"""Character-level tokenizers for toy tasks: one token per character, exact round trip.

Why character-level: the example tasks have tiny ASCII alphabets (digits and a few symbols), so a
learned BPE would only blur the one-step-per-line structure the model must learn, and one id per
character makes response lengths in tokens equal lengths in characters.

Why it is dressed as a byte-level BPE with no merges: transformers 5 loads any ``qwen2`` model's
tokenizer as ``Qwen2Tokenizer``, which keeps only the vocabulary and merges of ``tokenizer.json``
and rebuilds its own pipeline (NFC, Qwen's split regex, byte-level mapping, BPE). A plain
character WordLevel tokenizer would silently lose ``\\n`` there. Storing each character under its
byte-level symbol (``\\n`` -> ``Ċ``), with the same pipeline, makes ``AutoTokenizer`` and this
module's ``tokenizers.Tokenizer`` produce identical ids for every string over the alphabet.

The vocabulary is padded with ``<reserved_i>`` special tokens to a multiple of
:data:`VOCAB_MULTIPLE`, so every id the model can emit decodes (to nothing, as a special).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported lazily: building the CLI parser must stay light
    from tokenizers import Tokenizer

    from .chat import ChatFormat

PAD = "<pad>"
EOS = "<eos>"
UNK = "<unk>"
SPECIALS = (PAD, EOS, UNK)
VOCAB_MULTIPLE = 16


#: the split regex of Qwen2Tokenizer (transformers), so both pipelines cut text identically
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _byte_symbol(char: str) -> str:
    """The byte-level BPE symbol of an ASCII character (``"\\n"`` -> ``"Ċ"``)."""
    from tokenizers import pre_tokenizers

    if len(char) != 1 or ord(char) >= 128:
        raise ValueError(f"alphabet characters must be ASCII, not {char!r}")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return byte_level.pre_tokenize_str(char)[0][0]


def build_tokenizer(alphabet: str, specials: Sequence[str] = ()) -> Tokenizer:
    """A character-level tokenizer: ids 0..2 are ``<pad>``, ``<eos>``, ``<unk>``; then ``specials``
    (a chat format's, e.g. ``<|im_start|>``), then the alphabet.

    ``alphabet`` is a string of ASCII characters (duplicates ignored). Characters outside it
    encode to ``<unk>`` (one id per ASCII character). A special token written in the text
    encodes to its own id.
    """
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
    )

    chars = list(dict.fromkeys(alphabet))  # dedupe, keep order
    if not chars:
        raise ValueError("the alphabet is empty")
    symbols = [_byte_symbol(c) for c in chars]
    extra = [t for t in dict.fromkeys(specials) if t not in SPECIALS]
    tokens = [*SPECIALS, *extra, *symbols]
    size = -(-len(tokens) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    reserved = [f"<reserved_{i}>" for i in range(size - len(tokens))]
    vocab = {token: i for i, token in enumerate(tokens + reserved)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK, fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in (*SPECIALS, *extra, *reserved)]
    )
    return tok


def save_tokenizer(tok: Tokenizer, directory: str | Path, chat: ChatFormat | None = None) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``; with
    ``chat``, its template goes into ``tokenizer_config.json`` and its end of turn is the EOS
    token there (as an instruct model's is)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    special: dict[str, Any] = {"pad_token": PAD, "eos_token": EOS, "unk_token": UNK}
    if chat is not None:
        special["eos_token"] = chat.end_of_turn
        special["additional_special_tokens"] = list(chat.special_tokens)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1_000_000,
        "clean_up_tokenization_spaces": False,
        "padding_side": "left",
        **special,
    }
    if chat is not None:
        config["chat_template"] = chat.template
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def load_tokenizer(directory: str | Path) -> Tokenizer:
    """The ``tokenizers`` object saved in ``directory`` (no transformers import needed)."""
    from tokenizers import Tokenizer

    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        from laminar.runtime.errors import ConfigError

        raise ConfigError(f"no tokenizer.json in {directory}")
    return Tokenizer.from_file(str(path))


def special_id(tok: Tokenizer, token: str) -> int:
    """The id of a special token; raises ``KeyError`` naming it if the tokenizer lacks it."""
    tid = tok.token_to_id(token)
    if tid is None:
        raise KeyError(f"tokenizer has no {token}")
    return tid
