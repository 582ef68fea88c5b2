"""examples/chat as a user runs it: its config passes ``laminar doctor``, and the data role reads its
verl parquet with the chat model's template and scores responses with its ``compute_score``.

Prepared here as ``make run`` prepares it (the task's data, ``laminar model init``), without the
SFT warm start, which changes the weights and not what is checked here; the config's paths are
pointed at the prepared files with ``--set``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from laminar.recipe.tasks import load_task
from laminar.roles.data.config import DataConfig
from laminar.roles.data.prompts import load_prompts
from laminar.roles.data.rewards import RewardPool, RewardResult
from laminar.runtime.config import load_config

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CHAT = ROOT / "examples" / "chat"
CONFIG = CHAT / "config.yaml"
SIZES = ["--train", "200", "--test", "20", "--seed", "0"]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("chat")
    laminar = [sys.executable, "-m", "laminar"]
    subprocess.run(
        [sys.executable, str(CHAT / "task.py"), "generate", "--out", str(out / "data"), *SIZES],
        check=True,
        cwd=ROOT,
    )
    model = out / "model"
    subprocess.run(
        [*laminar, "model", "init", "--task", str(CHAT), "--out", str(model), "--seed", "1"],
        check=True,
        cwd=ROOT,
    )
    return {"data": out / "data", "model": model, "store": out / "data.sqlite"}


def overrides(prepared: dict[str, Path]) -> list[str]:
    model = prepared["model"]
    return [
        f"data.prompts={prepared['data'] / 'train.parquet'}",
        f"data.tokenizer={model}",
        f"data.store={prepared['store']}",
        f"trainer.model={model}",
        f"rollout.engine.model={model}",
    ]


def test_the_config_passes_laminar_doctor(prepared: dict[str, Path]) -> None:
    sets = [arg for item in overrides(prepared) for arg in ("--set", item)]
    done = subprocess.run(
        [sys.executable, "-m", "laminar", "doctor", str(CONFIG), "--json", *sets],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    report = json.loads(done.stdout)
    assert done.returncode == 0 and report["blockers"] == 0, done.stdout + done.stderr
    checked = json.dumps(report["findings"])
    assert str(prepared["model"]) in checked and "train.parquet" in checked


async def test_the_data_role_reads_the_parquet_and_scores_with_compute_score(
    prepared: dict[str, Path],
) -> None:
    config = load_config(CONFIG, overrides(prepared))
    data = config.role_config("data", DataConfig)
    loaded = load_prompts(data)
    assert loaded.row_ids and loaded.prompts.rendered == 200 and not loaded.prompts.left_out
    assert loaded.stop_warning is None
    task = load_task(str(CHAT))
    _, record, ids = loaded.prompts.rows[7]
    assert loaded.tokenizer.decode(ids, skip_special_tokens=False).endswith(
        "<|im_start|>assistant\n"
    )
    right = task.demonstration(record)
    truth = record["reward_model"]["ground_truth"]
    wrong = right[: -len(truth)] + str((int(truth) + 3) % 10)
    pool = RewardPool(  # as the data role starts it (roles/data/service.py)
        data.reward,  # type: ignore[arg-type]
        kind=data.reward_kind,
        batch=data.reward_batch,
        kwargs=data.reward_kwargs,
        prompt_key=data.prompt_key,
        workers=data.reward_workers,
        timeout_s=data.reward_timeout_s,
        sandbox=data.reward_sandbox,
    )
    try:
        scored = [await pool.score(record, text) for text in (right, wrong, "no answer")]
    finally:
        await pool.close()
    assert scored == [
        RewardResult(1.0, None, {"acc": 1.0, "format_ok": 1.0, "shows_work": 1.0}),
        RewardResult(0.0, None, {"acc": 0.0, "format_ok": 1.0, "shows_work": 1.0}),
        RewardResult(0.0, None, {"acc": 0.0, "format_ok": 0.0, "shows_work": 0.0}),
    ]
