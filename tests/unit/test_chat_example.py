"""examples/chat: its data is verl's parquet layout, its reward verl's ``compute_score``, and the
recipe builds, trains and evaluates its chat model on the prompts the data role renders."""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from laminar.recipe.chat import CHATML_TEMPLATE, IM_END, IM_START
from laminar.recipe.evaluate import greedy_budget, task_rewards
from laminar.recipe.model import ModelShape, init_model, load_model
from laminar.recipe.sft import SftConfig, _batches, train_sft
from laminar.recipe.tasks import Task, load_task
from laminar.recipe.tokenizer import EOS, PAD, load_tokenizer, special_id
from laminar.reward_kinds import detect_kind
from laminar.runtime.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
CHAT = ROOT / "examples" / "chat"
VERL_COLUMNS = ["data_source", "prompt", "ability", "reward_model", "extra_info"]
SIZES = ["--train", "300", "--test", "40", "--seed", "3"]
TINY = ModelShape(hidden=64, layers=1, heads=2, kv_heads=1, intermediate=64, max_len=256)


@pytest.fixture(scope="module")
def task() -> Task:
    return load_task(str(CHAT))


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory, task: Task) -> Path:
    """What ``python examples/chat/task.py generate`` writes (its ``main``, in this process)."""
    out = tmp_path_factory.mktemp("chat-data")
    assert task.module.main(["generate", "--out", str(out), *SIZES]) == 0
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory, task: Task) -> Path:
    return init_model(task.alphabet, tmp_path_factory.mktemp("m") / "chat", TINY, 0, task.chat)


# --- the data: verl's layout ------------------------------------------------------------------


def test_the_parquet_files_have_verls_columns_and_types(data: Path) -> None:
    for split, n in (("train", 300), ("test", 40)):
        table = pq.read_table(data / f"{split}.parquet")
        assert table.column_names == VERL_COLUMNS
        assert table.num_rows == n
        rows = table.to_pylist()
        for i, row in enumerate(rows):
            assert row["data_source"] == "clock_arith" and row["ability"] == "math"
            roles = [m["role"] for m in row["prompt"]]
            assert roles == ["system", "user"]
            assert all(isinstance(m["content"], str) and m["content"] for m in row["prompt"])
            assert row["reward_model"]["style"] == "rule"
            assert isinstance(row["reward_model"]["ground_truth"], str)
            assert row["extra_info"]["split"] == split and row["extra_info"]["index"] == i
    prompt = pq.read_schema(data / "train.parquet").field("prompt").type
    assert str(prompt) == "list<element: struct<role: string, content: string>>"


def test_train_and_test_problems_are_disjoint_and_the_ground_truth_is_the_answer(
    data: Path, task: Task
) -> None:
    train = pq.read_table(data / "train.parquet").to_pylist()
    test = pq.read_table(data / "test.parquet").to_pylist()
    user = [m["content"] for r in train for m in r["prompt"] if m["role"] == "user"]
    assert not set(user) & {m["content"] for r in test for m in r["prompt"] if m["role"] == "user"}
    for row in train[:100] + test:
        lines = task.demonstration(row).split("\n")
        assert lines[-1] == "#" + row["reward_model"]["ground_truth"]
        assert len(lines) - 1 == row["extra_info"]["steps"] <= task.module.MAX_STEPS


def test_the_split_is_the_tasks_test_split(data: Path, task: Task) -> None:
    rows = pq.read_table(data / "test.parquet").to_pylist()
    assert rows == task.test_records(40, seed=3)


# --- the reward: verl's compute_score -----------------------------------------------------------


def _compute_score() -> Callable[..., dict[str, float]]:
    """The function the data role imports (``data.reward``), loaded from its file."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("chat_compute_score", CHAT / "compute_score.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.compute_score


def test_compute_score_has_verls_signature_and_is_told_apart_as_verl() -> None:
    fn = _compute_score()
    params = inspect.signature(fn).parameters
    assert list(params) == ["data_source", "solution_str", "ground_truth", "extra_info"]
    assert params["extra_info"].default is None
    assert detect_kind(fn, "compute_score.py:compute_score") == "verl"
    source = (CHAT / "compute_score.py").read_text()
    assert "laminar" not in source.split('"""', 2)[2]  # nothing of Laminar below the docstring


def test_compute_score_scores_the_demonstration_and_flags_what_is_wrong(task: Task) -> None:
    fn = _compute_score()
    for row in task.test_records(30):
        demo = task.demonstration(row)
        truth = row["reward_model"]["ground_truth"]
        kwargs = {"data_source": row["data_source"], "extra_info": row["extra_info"]}
        right = fn(solution_str=demo, ground_truth=truth, **kwargs)
        assert right == {"score": 1.0, "acc": 1.0, "format_ok": 1.0, "shows_work": 1.0}
        direct = fn(solution_str=f"#{truth}", ground_truth=truth, **kwargs)
        assert direct == {"score": 1.0, "acc": 1.0, "format_ok": 1.0, "shows_work": 0.0}
        off = str((int(truth) + 1) % 10)
        wrong = fn(solution_str=demo[: -len(truth)] + off, ground_truth=truth, **kwargs)
        assert wrong["score"] == wrong["acc"] == 0.0 and wrong["format_ok"] == 1.0
        no_answer = fn(solution_str=demo.rsplit("\n", 1)[0], ground_truth=truth, **kwargs)
        assert no_answer["score"] == 0.0 and no_answer["format_ok"] == 0.0
    assert fn("clock_arith", "3a+4=7\nso #7", "7")["format_ok"] == 0.0
    assert fn("clock_arith", "", "8") == {
        "score": 0.0,
        "acc": 0.0,
        "format_ok": 0.0,
        "shows_work": 0.0,
    }
    assert task.reward(row, demo) == 1.0  # the recipe's reward is compute_score's score


# --- the recipe: a chat model, and the prompts the data role renders ----------------------------


def test_model_init_writes_a_chatml_model(model: Path) -> None:
    config = json.loads((model / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHATML_TEMPLATE
    assert config["eos_token"] == IM_END
    tok = load_tokenizer(model)
    eos = json.loads((model / "generation_config.json").read_text())["eos_token_id"]
    assert eos == [special_id(tok, IM_END), special_id(tok, EOS)]
    text = f"{IM_START}assistant\n7a+8=5\n#5{IM_END}"
    ids = tok.encode(text).ids
    assert ids[0] == special_id(tok, IM_START) and ids[-1] == special_id(tok, IM_END)
    assert len(ids) == len(text) - len(IM_START) - len(IM_END) + 2  # specials: one id each
    assert tok.decode(ids) == "assistant\n7a+8=5\n#5"


def test_the_recipe_encodes_prompts_as_the_data_role_does(
    task: Task, model: Path, data: Path
) -> None:
    from laminar.roles.data.config import DataConfig
    from laminar.roles.data.prompts import load_prompts

    config = DataConfig(
        prompts=str(data / "test.parquet"),
        tokenizer=str(model),
        reward=f"{CHAT / 'compute_score.py'}:compute_score",
        store=str(data / "store.sqlite"),
    )
    loaded = load_prompts(config)
    assert loaded.stop_warning is None  # <|im_end|> is among the ids the engine stops at
    assert loaded.prompts.rendered == 40
    tok = load_tokenizer(model)
    records = task.test_records(40, seed=3)
    for (_, record, ids), mine in zip(loaded.prompts.rows, records, strict=True):
        assert record == mine
        assert tok.encode(task.prompt_text(mine)).ids == ids


def test_sft_targets_end_with_the_end_of_turn(task: Task, model: Path) -> None:
    tok = load_tokenizer(model)
    batches = _batches(task, tok, SftConfig(steps=1, batch_size=16, pool_batches=4), lambda: 500)
    end, start = special_id(tok, IM_END), special_id(tok, IM_START)
    responses = []
    for _ in range(4):
        for ids, n_prompt in zip(*next(batches), strict=True):
            assert ids[-1] == end and end not in ids[n_prompt:-1]
            assert ids[:n_prompt].count(start) == 3  # system, user, and the assistant's turn
            responses.append(tok.decode(ids[n_prompt:]))
    direct = [r for r in responses if "\n" not in r]  # the task's sft_demonstration: "#answer"
    assert 0 < len(direct) < len(responses) and all(r[0] == "#" for r in direct)


def test_the_warm_start_answers_most_short_problems_without_the_working(task: Task) -> None:
    records = task.train_records(400, seed=2)
    targets = [task.sft_target(r) for r in records]
    demos = [task.demonstration(r) for r in records]
    direct = [t == d.rsplit("\n", 1)[1] for t, d in zip(targets, demos, strict=True)]
    assert all(short or t == d for short, t, d in zip(direct, targets, demos, strict=True))
    short = [r["extra_info"]["steps"] <= task.module.DIRECT_STEPS for r in records]
    assert not any(d and not s for d, s in zip(direct, short, strict=True))  # longer: all worked
    rate = sum(direct) / sum(short)
    assert abs(rate - task.module.DIRECT_RATE) < 0.1  # by a hash of the problem
    assert [task.sft_target(r) for r in records] == targets  # the same problem, the same way


def test_greedy_evaluation_stops_at_the_end_of_turn(
    task: Task, model: Path, tmp_path: Path
) -> None:
    """A few SFT steps on one record teach it; the evaluation then reads it as right."""
    import torch

    record = task.test_records(1, seed=5)[0]
    cfg = SftConfig(steps=60, batch_size=4, lr=1e-2, warmup=0.0, threads=1)
    demos = tmp_path / "demos.jsonl"
    demos.write_text(
        json.dumps({"prompt": record["prompt"], "response": task.demonstration(record)})
    )
    cfg.demos = str(demos)
    torch.manual_seed(0)
    trained = train_sft(task, model, tmp_path / "sft", cfg)
    lm, tok = load_model(trained.out)
    budget = greedy_budget(len(tok.encode(task.demonstration(record)).ids))
    rewards, responses, _ = task_rewards(task, lm, tok, [record], [budget])
    assert rewards == [1.0]
    assert tok.decode(responses[0]) == task.demonstration(record)  # stopped at <|im_end|>
    assert special_id(tok, PAD) not in responses[0]


def test_a_chat_task_refuses_a_model_without_its_template(task: Task, tmp_path: Path) -> None:
    plain = init_model(task.alphabet + "systemuserassistant", tmp_path / "plain", TINY, 0)
    with pytest.raises(ConfigError, match=r"chat task .* no chat template.*laminar model init"):
        train_sft(task, plain, tmp_path / "out", SftConfig(steps=1))


def test_a_malformed_chat_prompt_is_an_error_naming_the_record(task: Task) -> None:
    row = task.test_records(1)[0]
    bad = {**row, "prompt": [{"role": "robot", "content": "hi"}]}
    with pytest.raises(ConfigError, match=r"record .*message 0 must be an object with a role"):
        task.prompt_text(bad)
    with pytest.raises(ConfigError, match="the last message is the assistant's"):
        task.prompt_text({**row, "prompt": [{"role": "assistant", "content": "#1"}]})
