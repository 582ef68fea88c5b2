"""The datasets people have (``roles/data/records.py``, ``prompts.py``): JSONL, JSON, Parquet and
``datasets`` directories, dotted field mapping, datasets without ids, verl's parquet layout read
unchanged, and the over-long prompt policy (skipped and counted, or refused)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from laminar.roles.data.config import DataConfig
from laminar.roles.data.prompts import load_prompts, prepare_prompts, resolve_id_key
from laminar.roles.data.records import MISSING, field, read_records
from laminar.runtime.errors import ConfigError

from ..support.chat_model import verl_rows, write_chat_tokenizer
from ..support.task import write_tokenizer

RECORDS = [
    {"id": "a", "prompt": "1+1=", "answer": 2, "meta": {"level": 1}},
    {"id": "b", "prompt": "2+2=", "answer": 4, "meta": {"level": 3}},
]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def config(prompts: Path, model: Path, **kw: Any) -> DataConfig:
    kw.setdefault("reward", "tests.support.task:reward_len")
    return DataConfig(prompts=str(prompts), tokenizer=str(model), **kw)


def test_every_format_reads_the_same_records(tmp_path: Path) -> None:
    import datasets

    jsonl = write_jsonl(tmp_path / "p.jsonl", RECORDS)
    array = tmp_path / "p.json"
    array.write_text(json.dumps(RECORDS))
    parquet = write_parquet(tmp_path / "p.parquet", RECORDS)
    single = tmp_path / "single"
    datasets.Dataset.from_list(RECORDS).save_to_disk(str(single))
    for path in (jsonl, array, parquet, single):
        assert read_records(path) == RECORDS, path
    splits = tmp_path / "splits"
    held_out = [{"id": "z", "prompt": "9+9=", "answer": 18, "meta": {"level": 9}}]
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(RECORDS), "test": datasets.Dataset.from_list(held_out)}
    ).save_to_disk(str(splits))
    assert read_records(splits) == RECORDS  # train, of several
    assert read_records(splits, split="test") == held_out
    with pytest.raises(ConfigError, match=r"holds the splits \['train', 'test'\], not 'dev'"):
        read_records(splits, split="dev")
    with pytest.raises(ConfigError, match="a single dataset, not a DatasetDict"):
        read_records(single, split="train")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="written by datasets' save_to_disk"):
        read_records(tmp_path / "empty")
    with pytest.raises(ConfigError, match=r"expected a \.jsonl, \.json or \.parquet file"):
        read_records(write_jsonl(tmp_path / "p.csv", RECORDS))
    # a line ends at a newline only: a JSON string may hold a line separator as it is
    odd = [{"id": "a", "prompt": "one\u2028two\x85three"}]
    raw = tmp_path / "raw.jsonl"
    raw.write_text(json.dumps(odd[0], ensure_ascii=False) + "\n")
    assert read_records(raw) == odd
    bad = tmp_path / "bad.json"
    bad.write_text('[{"id": "a", "prompt": "x"}, 3]')
    with pytest.raises(ConfigError, match=r"bad\.json: item 1 of the array is not a JSON object"):
        read_records(bad)


def test_a_datasets_directory_loads_through_the_config(tmp_path: Path) -> None:
    import datasets

    directory = tmp_path / "ds"
    datasets.Dataset.from_list(RECORDS).save_to_disk(str(directory))
    loaded = load_prompts(config(directory, write_tokenizer(tmp_path / "tok")))
    assert [pid for pid, _, _ in loaded.prompts.rows] == ["a", "b"]
    assert loaded.prompts.rows[1][1] == RECORDS[1]
    # the fingerprint covers the directory's files: another dataset there is another prompt set
    datasets.Dataset.from_list(RECORDS[:1]).save_to_disk(str(directory))
    again = load_prompts(config(directory, write_tokenizer(tmp_path / "tok")))
    assert again.fingerprint != loaded.fingerprint


def test_dotted_fields_reach_into_nested_records() -> None:
    record = {"extra_info": {"index": 7, "tags": {"x": None}}, "a.b": 1, "a": {"b": 2}}
    assert field(record, "extra_info.index") == 7
    assert field(record, "extra_info.tags.x") is None  # present, and None
    assert field(record, "extra_info.missing") is MISSING
    assert field(record, "extra_info.index.deeper") is MISSING
    assert field(record, "a.b") == 1  # a column whose name holds the dot wins
    rows = [
        {"uid": {"v": "q1"}, "input": {"text": "1+1="}},
        {"uid": {"v": "q2"}, "input": {"text": "2+2="}},
    ]
    kept = prepare_prompts(
        rows, _CharTokenizer(), id_key="uid.v", prompt_key="input.text", source="f.jsonl"
    )
    assert [(pid, ids) for pid, _, ids in kept.rows] == [
        ("q1", [ord(c) for c in "1+1="]),
        ("q2", [ord(c) for c in "2+2="]),
    ]


def test_row_numbers_are_ids_only_when_no_record_has_one_and_none_is_named(tmp_path: Path) -> None:
    no_ids = [{"prompt": "1+1="}, {"prompt": "2+2="}]
    assert resolve_id_key(no_ids, None) is None
    assert resolve_id_key(no_ids, "id") == "id"  # set in the config: required
    assert resolve_id_key(no_ids, "uid") == "uid"
    some = [{"id": "a", "prompt": "x"}, {"prompt": "y"}]
    assert resolve_id_key(some, None) == "id"
    with pytest.raises(ConfigError, match=r"f\.jsonl: record 1 lacks the field 'id'"):
        prepare_prompts(some, _CharTokenizer(), id_key="id", prompt_key="prompt", source="f.jsonl")
    # through the config: row numbers, stable for the file
    model = write_tokenizer(tmp_path / "tok")
    loaded = load_prompts(config(write_jsonl(tmp_path / "p.jsonl", no_ids), model))
    assert loaded.row_ids and [pid for pid, _, _ in loaded.prompts.rows] == ["0", "1"]
    with pytest.raises(ConfigError, match=r"record 0 lacks the field 'id'"):
        load_prompts(config(tmp_path / "p.jsonl", model, id_key="id"))
    with pytest.raises(ConfigError, match=r"record 0 lacks the field 'extra_info\.index'"):
        load_prompts(config(tmp_path / "p.jsonl", model, id_key="extra_info.index"))


def test_verls_parquet_layout_reads_with_the_defaults(tmp_path: Path) -> None:
    model = write_chat_tokenizer(tmp_path / "m")
    train = write_parquet(tmp_path / "train.parquet", verl_rows(3))
    loaded = load_prompts(config(train, model))
    tok = loaded.tokenizer
    assert [pid for pid, _, _ in loaded.prompts.rows] == ["0", "1", "2"]  # no id column
    _, record, ids = loaded.prompts.rows[1]
    assert tok.decode(ids, skip_special_tokens=False) == (
        "<s><|im_start|>user\nWhat is 1+1?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert record == verl_rows(3)[1]  # the whole record, for the reward function
    assert record["reward_model"]["ground_truth"] == "2"
    # verl's own index as the id: one key
    by_index = load_prompts(config(train, model, id_key="extra_info.index"))
    assert [pid for pid, _, _ in by_index.prompts.rows] == ["100", "101", "102"]
    assert by_index.fingerprint != loaded.fingerprint


class _CharTokenizer:
    def encode(self, text: str) -> Any:
        return type("E", (), {"ids": [ord(c) for c in text]})()


def test_overlong_prompts_are_skipped_and_counted_or_refused() -> None:
    records = [{"id": f"p{i}", "prompt": "x" * n} for i, n in enumerate((3, 8, 2, 9, 6))]

    def prepare(**kw: Any):
        return prepare_prompts(
            records, _CharTokenizer(), id_key="id", prompt_key="prompt", source="f.jsonl", **kw
        )

    skipped = prepare(max_model_len=8, overlong="skip")
    assert [pid for pid, _, _ in skipped.rows] == ["p0", "p2", "p4"]
    assert [(x.prompt_id, x.tokens, x.reason) for x in skipped.left_out] == [
        ("p1", 8, "max_model_len"),
        ("p3", 9, "max_model_len"),
    ]
    with pytest.raises(
        ConfigError, match=r"2 prompt\(s\) leave no room .* record 1 \(prompt id 'p1', 8 tokens\)"
    ):
        prepare(max_model_len=8, overlong="refuse")  # fmt: skip
    # max_prompt_tokens leaves out under either policy, and comes first
    both = prepare(max_model_len=8, max_prompt_tokens=5, overlong="refuse")
    assert [pid for pid, _, _ in both.rows] == ["p0", "p2"]
    assert {x.reason for x in both.left_out} == {"max_prompt_tokens"}
    with pytest.raises(ConfigError, match=r"no prompts of at most 1 tokens \(of 5 records\)"):
        prepare(max_model_len=2, overlong="skip")


def test_laminar_doctor_takes_a_datasets_directory(tmp_path: Path) -> None:
    import datasets

    from laminar.doctor.checks import check_data

    from .test_doctor import arith_needs, small_machine

    directory = tmp_path / "ds"
    datasets.Dataset.from_list(RECORDS).save_to_disk(str(directory))
    (tmp_path / "empty").mkdir()
    paths = (("data.prompts", str(directory)), ("data.prompts", str(tmp_path / "empty")))
    there, empty = check_data(small_machine(), arith_needs(kv=1, data_files=paths))
    assert there.severity == "ok" and empty.severity == "blocker" and "is empty" in empty.found
