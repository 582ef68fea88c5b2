"""Bad prompt data is a clear error at load naming the record; the store's durability setting.

Before, a prompt id ending in ``~e<n>`` collided with another prompt's repeat in a later epoch (a
crash deep in the queue, epochs into a run), a Parquet value that is not JSON crashed start-up
with a bare ``TypeError``, and a prompt too long for the rollouts' context was found only when
it crashed them.
"""

from __future__ import annotations

import datetime

import pytest

from laminar.roles.data.prompts import prepare_prompts, read_records
from laminar.roles.data.store import Store
from laminar.runtime.errors import ConfigError


class CharTokenizer:
    def encode(self, text):
        return type("E", (), {"ids": [ord(c) for c in text]})()


def tokenize(records, **kw):
    return prepare_prompts(
        records, CharTokenizer(), id_key="id", prompt_key="prompt", source="f.jsonl", **kw
    ).rows


def test_a_prompt_id_like_the_epoch_suffix_is_refused():
    with pytest.raises(ConfigError, match=r"record 1: prompt id 'a~e1' ends like the epoch"):
        tokenize([{"id": "a", "prompt": "x"}, {"id": "a~e1", "prompt": "y"}])
    # '~' elsewhere is fine: only the suffix can collide
    assert [pid for pid, _, _ in tokenize([{"id": "a~b", "prompt": "x"}])] == ["a~b"]


@pytest.mark.parametrize(
    ("record", "match"),
    [
        ({"id": None, "prompt": "x"}, "record 0: the prompt id must be a string or an integer"),
        ({"id": "", "prompt": "x"}, "record 0: the prompt id is empty"),
        ({"id": "a/b", "prompt": "x"}, "must not contain '/'"),
        ({"id": "a", "prompt": None}, r"record 0 \(prompt id 'a'\): 'prompt' must be a string"),
        ({"id": 7, "prompt": "x", "when": datetime.date(2024, 5, 1)},
         r"record 0 \(prompt id '7'\): field 'when' holds date .*not JSON"),
        ({"id": "a", "prompt": "x", "blob": b"\x00"}, r"field 'blob' holds bytes"),
    ],
)  # fmt: skip
def test_bad_records_name_the_record_and_the_problem(record, match):
    with pytest.raises(ConfigError, match=match):
        tokenize([record])


def test_a_parquet_column_that_is_not_json_fails_at_load_naming_the_record(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    when = datetime.datetime(2024, 5, 1, 12, 0)
    rows = [{"id": "a", "prompt": "x", "at": when}, {"id": "b", "prompt": "y", "at": when}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    records = read_records(tmp_path / "p.parquet")
    with pytest.raises(ConfigError, match=r"record 0 \(prompt id 'a'\): field 'at' holds datetime"):
        tokenize(records)


def test_prompts_that_cannot_fit_the_context_are_an_error_or_left_out():
    records = [{"id": f"p{i}", "prompt": "x" * n} for i, n in enumerate((3, 8, 2, 9))]
    with pytest.raises(ConfigError) as err:
        tokenize(records, max_model_len=8)
    message = str(err.value)
    assert (
        "2 prompt(s) leave no room for a response within the rollouts' max_model_len 8" in message
    )
    assert "the first: record 1 (prompt id 'p1', 8 tokens)" in message
    assert "max_prompt_tokens: 7" in message
    # 7 tokens leave room for one: allowed (the response stops at the context limit)
    kept = tokenize(records, max_model_len=8, max_prompt_tokens=7)
    assert [pid for pid, _, _ in kept] == ["p0", "p2"]


def test_the_store_applies_its_synchronous_setting(tmp_path):
    # sqlite's numbering: 1 = NORMAL, 2 = FULL
    assert Store(tmp_path / "a.sqlite").db.execute("PRAGMA synchronous").fetchone() == (1,)
    full = Store(tmp_path / "b.sqlite", synchronous="FULL")
    assert full.db.execute("PRAGMA synchronous").fetchone() == (2,)
    with pytest.raises(ValueError, match="synchronous must be one of"):
        Store(tmp_path / "c.sqlite", synchronous="OFF")
