"""Reading a prompt dataset into records: JSONL, JSON, Parquet, or a ``datasets`` directory.

A record is a dict (a JSON object, a Parquet row, a row of a Hugging Face dataset); the data
role takes a prompt's id and text from its fields (:func:`field`, dotted paths into nested
fields) and hands the whole record to the reward function. Users' view: ``docs/data.md``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from laminar.reward_calls import lookup
from laminar.runtime.errors import ConfigError

#: What :func:`field` returns for a field a record does not have (a field may hold ``None``).
MISSING: Any = object()


def read_records(path: str | Path, *, split: str | None = None) -> list[dict[str, Any]]:
    """Every record of the dataset at ``path``, in file order.

    ``.jsonl`` (one object per line), ``.json`` (the same, or one array of objects), ``.parquet``,
    or a directory written by ``datasets``' ``save_to_disk`` (a ``DatasetDict`` is read at
    ``split``: by default its only split, else ``train``)."""
    p = Path(path)
    if p.is_dir():
        return _read_saved_dataset(p, split)
    if not p.is_file():
        raise ConfigError(f"prompt dataset {p} does not exist")
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(p)
        except Exception as exc:  # pyarrow's errors have no common base worth naming
            raise ConfigError(f"prompt dataset {p}: not a readable Parquet file ({exc})") from None
        return table.to_pylist()
    if p.suffix not in (".jsonl", ".json"):
        raise ConfigError(
            f"prompt dataset {p}: expected a .jsonl, .json or .parquet file, or a directory "
            "written by datasets' save_to_disk"
        )
    return _read_json(p)


def _read_json(p: Path) -> list[dict[str, Any]]:
    if p.suffix == ".json" and _first_char(p) == "[":
        try:
            records = json.loads(p.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{p}:{exc.lineno}: not valid JSON ({exc.msg})") from None
        for i, record in enumerate(records):
            if not isinstance(record, dict):
                raise ConfigError(f"{p}: item {i} of the array is not a JSON object")
        return list(records)
    records = []
    with p.open() as f:  # lines end at "\n" only: JSON strings may hold U+2028 and the like
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


def _first_char(p: Path) -> str:
    with p.open() as f:
        while chunk := f.read(4096):
            if stripped := chunk.lstrip():
                return stripped[0]
    return ""


def _read_saved_dataset(p: Path, split: str | None) -> list[dict[str, Any]]:
    import datasets  # imported only for a directory: it takes about a second

    datasets.disable_progress_bars()  # one data role's log, not a terminal
    try:
        loaded = datasets.load_from_disk(str(p))
    except FileNotFoundError as exc:
        raise ConfigError(
            f"prompt dataset {p}: a directory must be one written by datasets' save_to_disk ({exc})"
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        names = list(loaded)
        if split is None:
            split = names[0] if len(names) == 1 else "train"
        if split not in loaded:
            raise ConfigError(
                f"prompt dataset {p} holds the splits {names}, not {split!r}: set data.split"
            )
        loaded = loaded[split]
    elif split is not None:
        raise ConfigError(
            f"prompt dataset {p} is a single dataset, not a DatasetDict: data.split "
            f"({split!r}) does not apply; remove it"
        )
    return list(loaded.to_list())


def field(record: dict[str, Any], path: str) -> Any:
    """``record``'s field at ``path``: a key of the record itself if it has one (a column whose
    name holds a dot), else a dotted path into nested objects (``extra_info.index``);
    :data:`MISSING` if there is none. The reward worker reads a record's fields the same way."""
    return lookup(record, path, MISSING)


def has_field(record: dict[str, Any], path: str) -> bool:
    return field(record, path) is not MISSING
