"""The over-long prompt policy in a real data role (its reward workers are processes): over-long
prompts are skipped and counted, or refused. The datasets are ``tests/unit/test_data_formats.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from laminar.roles.data.prompts import load_prompts
from laminar.roles.data.service import DataService
from laminar.runtime.errors import ConfigError
from tests.unit.test_data_formats import config, write_parquet

from ..support.chat_model import verl_rows, write_chat_tokenizer


async def test_the_data_role_skips_overlong_prompts_and_counts_them(serve, tmp_path: Path) -> None:
    model = write_chat_tokenizer(tmp_path / "m")
    rows = verl_rows(4)
    rows[2]["prompt"] = [{"role": "user", "content": "What is " + "1+" * 40 + "1?"}]
    train = write_parquet(tmp_path / "train.parquet", rows)
    cfg = config(train, model, max_model_len=40, store=str(tmp_path / "data.sqlite"), metrics=None)
    _, svc = await serve(DataService, config=cfg)
    assert svc.stats()["prompts_left_out"] == 1.0
    status = await svc.status()
    assert status.prompts_left_out == 1
    stored = [row[0] for row in svc.store.db.execute("SELECT prompt_id FROM prompts ORDER BY idx")]
    assert stored == ["0", "1", "3"]
    # refuse: the same data role does not start, naming the record
    refused = cfg.model_copy(
        update={"overlong_prompts": "refuse", "store": str(tmp_path / "b.sqlite")}
    )
    with pytest.raises(ConfigError, match=r"record 2 \(prompt id '2', \d+ tokens\)"):
        load_prompts(refused)
