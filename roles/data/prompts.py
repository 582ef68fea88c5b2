"""Loading a prompt dataset: JSONL or Parquet records, tokenized once with the model's tokenizer.

A record is a JSON object (a Parquet row) with at least an id and the prompt text; every other
field is kept and handed to the reward function (the answer, difficulty, ...). Bad input is a
:class:`ConfigError` naming the file, the record and the problem, before anything is stored:

* an id that is missing, empty, not a string or integer, repeated, or that contains ``/`` or ends
  like the epoch suffix ``~e<n>`` (the data role names a prompt's repeat in epoch n
  ``{id}~e{n}``: prompt ``a~e1`` would be the same group as prompt ``a`` in epoch 1);
* a prompt that is not a string, or tokenizes to nothing;
* a field that is not JSON (a Parquet timestamp, decimal or binary column): the record is stored
  and handed to the reward function as JSON;
* with ``max_model_len`` (the rollouts' context length) given, a prompt that leaves no room for a
  response (``tokens >= max_model_len``): no engine could ever generate it. A prompt that fits
  but leaves less than ``max_tokens`` gets a response cut at the context limit (finish reason
  ``length``), as every engine does; that is allowed. To leave too-long prompts out instead of
  failing, set ``max_prompt_tokens`` (those left out are counted).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from laminar.errors import ConfigError

EPOCH_SUFFIX = re.compile(r"~e\d+$")  # what the store appends to a prompt id after epoch 0


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
    max_model_len: int | None = None,
) -> list[tuple[str, dict[str, Any], list[int]]]:
    """``(id, record, prompt token ids)`` per record, checked as the module docstring says;
    prompts longer than ``max_prompt_tokens`` are left out (verl's ``filter_overlong_prompts``),
    and leaving out all of them is an error."""
    rows, seen = [], set()
    too_long: list[tuple[int, str, int]] = []
    for i, record in enumerate(records):
        if id_key not in record or prompt_key not in record:
            raise ConfigError(f"{source}: record {i} lacks {id_key!r} or {prompt_key!r}")
        pid = _prompt_id(record[id_key], source, i)
        if pid in seen:
            raise ConfigError(f"{source}: duplicate prompt id {pid!r} (record {i})")
        seen.add(pid)
        _check_json(record, source, i, pid)
        text = record[prompt_key]
        if not isinstance(text, str):
            raise ConfigError(
                f"{source}: record {i} (prompt id {pid!r}): {prompt_key!r} must be a string, "
                f"got {type(text).__name__}"
            )
        ids = tokenizer.encode(text).ids
        if not ids:
            raise ConfigError(f"{source}: prompt {pid!r} tokenizes to nothing")
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            continue
        if max_model_len is not None and len(ids) >= max_model_len:
            too_long.append((i, pid, len(ids)))
        rows.append((pid, record, ids))
    if too_long:
        i, pid, n = too_long[0]
        raise ConfigError(
            f"{source}: {len(too_long)} prompt(s) leave no room for a response within the "
            f"rollouts' max_model_len {max_model_len}; the first: record {i} (prompt id {pid!r}, "
            f"{n} tokens). Shorten them, raise max_model_len, or set data.max_prompt_tokens: "
            f"{max_model_len - 1} to leave them out (counted)"
        )
    if not rows:
        longer = f" of at most {max_prompt_tokens} tokens" if max_prompt_tokens else ""
        raise ConfigError(f"{source}: no prompts{longer}")
    return rows


def _prompt_id(value: Any, source: str, i: int) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ConfigError(
            f"{source}: record {i}: the prompt id must be a string or an integer, "
            f"got {type(value).__name__} {value!r:.60}"
        )
    pid = str(value)
    if not pid:
        raise ConfigError(f"{source}: record {i}: the prompt id is empty")
    if "/" in pid:
        raise ConfigError(f"{source}: record {i}: prompt id {pid!r} must not contain '/'")
    if EPOCH_SUFFIX.search(pid):
        raise ConfigError(
            f"{source}: record {i}: prompt id {pid!r} ends like the epoch suffix ~e<n> that the "
            f"data role appends to a prompt's id after the first epoch (it would collide with "
            f"prompt {EPOCH_SUFFIX.sub('', pid)!r} in a later epoch); rename it"
        )
    return pid


def _check_json(record: dict[str, Any], source: str, i: int, pid: str) -> None:
    """The record is stored and handed to the reward function as JSON: every field must be."""
    try:
        json.dumps(record)
    except (TypeError, ValueError):
        pass
    else:
        return
    for key, value in record.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"{source}: record {i} (prompt id {pid!r}): field {key!r} holds "
                f"{type(value).__name__} {value!r:.60}, which is not JSON ({exc}); convert it "
                "(e.g. to a string or a number) when writing the dataset"
            ) from None
    raise ConfigError(f"{source}: record {i} (prompt id {pid!r}) is not JSON-serializable")


def fingerprint(*paths: str | Path, extra: str = "") -> str:
    digest = hashlib.sha256(extra.encode())
    for path in paths:
        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        digest.update(p.read_bytes())
    return digest.hexdigest()[:16]
