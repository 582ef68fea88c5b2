"""Loading a prompt dataset: JSONL or Parquet records, tokenized once with the model's tokenizer.

A record is a JSON object (a Parquet row) with at least an id and the prompt text; every other
field is kept and handed to the reward function (the answer, difficulty, ...). Bad input is a
:class:`ConfigError` naming the file, line and problem, before anything is stored.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from laminar.errors import ConfigError


def read_records(path: str | Path) -> list[dict[str, Any]]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"prompt dataset {p} does not exist")
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(p).to_pylist()
    if p.suffix not in (".jsonl", ".json"):
        raise ConfigError(f"prompt dataset {p}: expected a .jsonl or .parquet file")
    records = []
    with p.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{p}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(record, dict):
                raise ConfigError(f"{p}:{lineno}: expected a JSON object per line")
            records.append(record)
    return records


def load_tokenizer(path: str | Path) -> Any:
    """A ``tokenizers.Tokenizer`` from ``tokenizer.json`` or a model directory holding one."""
    from tokenizers import Tokenizer

    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise ConfigError(f"no tokenizer at {p}")
    return Tokenizer.from_file(str(p))


def tokenize_records(
    records: list[dict[str, Any]],
    tokenizer: Any,
    *,
    id_key: str,
    prompt_key: str,
    source: str,
    max_prompt_tokens: int | None = None,
) -> list[tuple[str, dict[str, Any], list[int]]]:
    """``(id, record, prompt token ids)`` per record; prompts longer than ``max_prompt_tokens``
    are left out (verl's ``filter_overlong_prompts``), and leaving out all of them is an error."""
    rows, seen = [], set()
    for i, record in enumerate(records):
        if id_key not in record or prompt_key not in record:
            raise ConfigError(f"{source}: record {i} lacks {id_key!r} or {prompt_key!r}")
        pid = str(record[id_key])
        if pid in seen:
            raise ConfigError(f"{source}: duplicate prompt id {pid!r} (record {i})")
        if "/" in pid:
            raise ConfigError(f"{source}: prompt id {pid!r} must not contain '/'")
        seen.add(pid)
        ids = tokenizer.encode(str(record[prompt_key])).ids
        if not ids:
            raise ConfigError(f"{source}: prompt {pid!r} tokenizes to nothing")
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            continue
        rows.append((pid, record, ids))
    if not rows:
        longer = f" of at most {max_prompt_tokens} tokens" if max_prompt_tokens else ""
        raise ConfigError(f"{source}: no prompts{longer}")
    return rows


def fingerprint(*paths: str | Path, extra: str = "") -> str:
    digest = hashlib.sha256(extra.encode())
    for path in paths:
        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        digest.update(p.read_bytes())
    return digest.hexdigest()[:16]
