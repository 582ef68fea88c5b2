"""A tiny task for generation tests: a character tokenizer, prompts, and reward functions.

The sim engine emits arbitrary token ids, so the rewards here look at lengths and records, not at
meaning: ``reward_len`` is deterministic, ``reward_flaky`` raises for some records and hangs for
one (to test that failures are recorded, never fatal).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

ALPHABET = "0123456789+-=#\n"


def write_tokenizer(directory: Path) -> Path:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(ALPHABET)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<pad>", "<eos>"])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    return directory


def write_prompts(path: Path, n: int) -> Path:
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"p{i}", "prompt": f"{i}+{i}=", "answer": 2 * i}) + "\n")
    return path


def reward_len(record: dict, response: str) -> float:
    return float(len(response) % 7) / 7.0


def reward_flaky(record: dict, response: str) -> float:
    if record["answer"] == 2:  # prompt p1
        time.sleep(60)
    if record["answer"] % 4 == 0:
        raise ValueError(f"cannot score {record['id']}")
    return 1.0
