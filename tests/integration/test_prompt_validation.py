"""A real data role (its reward workers are processes) refuses to start on a prompt too long for
the rollouts' context. The validation at load is ``tests/unit/test_prompt_validation.py``."""

from __future__ import annotations

import json

import pytest

from laminar.roles.data.service import DataConfig, DataService
from laminar.runtime.context import ServiceContext
from laminar.runtime.errors import ConfigError
from tests.support.task import write_prompts, write_tokenizer


async def test_the_data_role_refuses_to_start_on_a_prompt_that_cannot_fit(
    serve, tmp_path, cluster, options
):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 3)
    with prompts.open("a") as f:
        f.write(json.dumps({"id": "long", "prompt": "1" * 40}) + "\n")
    config = DataConfig(
        metrics=None,
        prompts=str(prompts),
        tokenizer=str(write_tokenizer(tmp_path / "tok")),
        reward="tests.support.task:reward_len",
        store=str(tmp_path / "data.sqlite"),
        max_model_len=32,
        overlong_prompts="refuse",
    )
    ctx = ServiceContext(
        role="data", instance="data-x", cluster=cluster, config=config, options=options
    )
    refused = DataService(ctx)
    try:
        with pytest.raises(ConfigError, match=r"record 3 \(prompt id 'long', 40 tokens\)"):
            await refused.on_start()
    finally:
        ctx.close_executors()
    # leaving them out is a setting, and counted
    _, svc = await serve(
        DataService,
        config=config.model_copy(update={"max_prompt_tokens": 31, "store_synchronous": "FULL"}),
    )
    assert svc.stats()["prompts_left_out"] == 1.0
    assert svc.store.db.execute("PRAGMA synchronous").fetchone() == (2,)  # FULL
