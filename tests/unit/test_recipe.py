"""The model recipe (tokenizer, ``model init``, ``sft``, ``eval``) and the ``examples/arith`` task.

Everything runs on a tiny model on CPU; the whole module takes well under 30 s.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from laminar.cli import main
from laminar.recipe.evaluate import bucket_of, length_stats
from laminar.recipe.model import ModelShape, init_model
from laminar.recipe.sft import IGNORE, collate, lr_factor
from laminar.recipe.tasks import Task, load_task
from laminar.recipe.tokenizer import EOS, PAD, build_tokenizer, load_tokenizer, special_id
from laminar.runtime.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
ARITH = str(ROOT / "examples" / "arith")
TINY = [
    "--hidden",
    "64",
    "--layers",
    "2",
    "--heads",
    "2",
    "--kv-heads",
    "1",
    "--intermediate",
    "128",
    "--max-len",
    "512",
]


@pytest.fixture(scope="module")
def task():  # type: ignore[no-untyped-def]
    return load_task(ARITH)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, task):  # type: ignore[no-untyped-def]
    out = tmp_path_factory.mktemp("models") / "init"
    assert main(["model", "init", "--task", ARITH, "--out", str(out), *TINY]) == 0
    return out


# --- tokenizer ---------------------------------------------------------------------------------


def test_tokenizer_one_id_per_char_and_round_trip(task) -> None:  # type: ignore[no-untyped-def]
    tok = build_tokenizer(task.alphabet)
    text = "37a+8-5=\n37a+8=45\n45b-5=40\n#40"
    ids = tok.encode(text).ids
    assert len(ids) == len(text)
    assert len(set(ids)) == len(set(text))
    assert tok.decode(ids) == text
    assert tok.get_vocab_size() % 16 == 0
    eos = special_id(tok, EOS)
    assert tok.decode([*ids, eos, special_id(tok, PAD)]) == text  # specials decode to nothing
    assert len(tok.encode("x?").ids) == 2  # outside the alphabet: <unk>, still one per char


def test_autotokenizer_agrees_with_tokenizer(tiny_model, task) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(tiny_model)
    tok = load_tokenizer(tiny_model)
    for record in task.test_records(20):
        text = record["prompt"] + task.demonstration(record)
        assert auto(text).input_ids == tok.encode(text).ids
        assert auto.decode(auto(text).input_ids) == text
    assert auto.eos_token_id == special_id(tok, EOS)
    assert auto.pad_token_id == special_id(tok, PAD)


# --- model init --------------------------------------------------------------------------------


def test_model_init_writes_a_loadable_qwen2(tiny_model) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (tiny_model / name).is_file(), name
    config = json.loads((tiny_model / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["hidden_size"] // config["num_attention_heads"] in (32, 64)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    tok = load_tokenizer(tiny_model)
    assert model.config.vocab_size == tok.get_vocab_size()
    assert model.config.eos_token_id == special_id(tok, EOS)
    assert not list(tiny_model.parent.glob(".init.*"))  # no temp dirs left behind


def test_model_init_rejects_bad_shapes(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="head dim"):
        init_model("0123", tmp_path / "m", ModelShape(hidden=96, heads=2, kv_heads=1))
    with pytest.raises(ConfigError, match="kv-heads"):
        init_model("0123", tmp_path / "m", ModelShape(hidden=128, heads=4, kv_heads=3))
    assert not (tmp_path / "m").exists()


def test_cli_reports_missing_task_and_model(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["model", "init", "--task", str(tmp_path / "nope"), "--out", str(tmp_path)]) == 2
    assert "nope" in capsys.readouterr().err
    args = [
        "sft",
        "--task",
        ARITH,
        "--model",
        str(tmp_path / "none"),
        "--out",
        str(tmp_path / "o"),
        "--steps",
        "1",
    ]
    assert main(args) == 2
    assert "does not exist" in capsys.readouterr().err


# --- task --------------------------------------------------------------------------------------


def test_task_loads_by_file_dir_and_module(task) -> None:  # type: ignore[no-untyped-def]
    by_file = load_task(str(Path(ARITH) / "task.py"))
    assert by_file.module is task.module
    sys.path.insert(0, str(ROOT))
    try:
        by_name = load_task("examples.arith.task")
    finally:
        sys.path.remove(str(ROOT))
    assert by_name.module.generate(5, 3) == task.module.generate(5, 3)
    with pytest.raises(ConfigError):
        load_task("no.such.module")


def test_task_without_splits_keeps_test_prompts_out_of_training(tmp_path: Path) -> None:
    (tmp_path / "task.py").write_text(
        "import random\n"
        "ALPHABET = '0123456789'\n"
        "SPACE = 10**6\n"
        "def generate(n, seed):\n"
        "    rng = random.Random(seed)\n"
        "    return [{'id': str(i), 'prompt': str(rng.randrange(SPACE)), 'answer': 0}"
        " for i in range(n)]\n"
        "def demonstration(record):\n    return '0'\n"
        "def reward(record, response):\n    return 1.0\n"
    )
    task = load_task(str(tmp_path))
    assert not task.has_splits
    held_out = {r["prompt"] for r in task.test_records(5000)}
    train = task.train_records(200, seed=3)
    assert len(train) == 200
    assert not held_out & {r["prompt"] for r in train}
    task.module.SPACE = 300  # every possible prompt is held out: a clear error, not a hang
    with pytest.raises(ConfigError, match="test prompt"):
        Task(task.spec, task.module).train_records(10, seed=4)
    with pytest.raises(ConfigError, match="lacks"):
        (tmp_path / "bad.py").write_text("ALPHABET = '01'\n")
        load_task(str(tmp_path / "bad.py"))


def test_generator_is_deterministic_and_splits_are_disjoint(task) -> None:  # type: ignore[no-untyped-def]
    gen = task.module.generate
    assert gen(50, 7) == gen(50, 7)
    assert gen(50, 7) != gen(50, 8)
    assert gen(20, 7) == gen(50, 7)[:20]  # prefix-stable
    train = gen(3000, 1)
    assert len({r["id"] for r in train}) == len(train)
    test_prompts = {r["prompt"] for r in task.test_records(500)}
    assert not test_prompts & {r["prompt"] for r in train}
    assert set(task.alphabet) >= set("".join(r["prompt"] + task.demonstration(r) for r in train))


def test_steps_are_heavy_tailed(task) -> None:  # type: ignore[no-untyped-def]
    steps = sorted(r["steps"] for r in task.module.generate(5000, 0))
    median = statistics.median(steps)
    p99 = steps[int(0.99 * len(steps)) - 1]
    assert p99 / median >= 5, (median, p99)
    assert min(steps) >= 1


def test_reward_of_demonstration_and_corruptions(task) -> None:  # type: ignore[no-untyped-def]
    for record in task.module.generate(200, 0):
        demo = task.demonstration(record)
        assert task.reward(record, demo) == 1.0
        head, _, answer = demo.rpartition("#")
        assert task.reward(record, f"{head}#{int(answer) + 1}") == 0.0
        assert task.reward(record, demo.replace("#", "")) == 0.0
        assert task.reward(record, f"{head}#x#{answer}") == 0.0  # first '#' counts


@settings(max_examples=200, deadline=None)
@given(
    response=st.one_of(st.text(), st.none(), st.integers(), st.binary()),
    answer=st.one_of(st.integers(), st.text(), st.none()),
)
def test_reward_never_raises(task, response, answer) -> None:  # type: ignore[no-untyped-def]
    assert task.reward({"answer": answer}, response) in (0.0, 1.0)
    assert task.reward({}, "#12") == 0.0


# --- sft and eval ------------------------------------------------------------------------------


def test_collate_masks_prompt_and_padding() -> None:
    batch = collate([[5, 6, 7, 1], [5, 7]], [2, 1], pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 1], [5, 7, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert batch["labels"].tolist() == [[IGNORE, IGNORE, 7, 1], [IGNORE, 7, IGNORE, IGNORE]]


def test_lr_schedule_warms_up_then_decays() -> None:
    assert lr_factor(0.0, 0.1, 0.05) < 0.01
    assert lr_factor(0.1, 0.1, 0.05) == pytest.approx(1.0)
    assert lr_factor(0.5, 0.1, 0.05) < 1.0
    assert lr_factor(1.0, 0.1, 0.05) == pytest.approx(0.05)


def test_sft_reduces_loss_and_saves_a_loadable_model(tiny_model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    out = tmp_path / "sft"
    args = [
        "sft",
        "--task",
        ARITH,
        "--model",
        str(tiny_model),
        "--out",
        str(out),
        "--steps",
        "20",
        "--batch-size",
        "8",
        "--lr",
        "3e-3",
        "--threads",
        "1",
        "--stop-at",
        "off",  # 20 steps reach no accuracy target: this test is about the loss
    ]
    assert main(args) == 0
    summary = json.loads((out / "sft.json").read_text())
    assert summary["steps"] == 20
    losses = [loss for _, _, loss in summary["losses"]]
    assert losses[-1] < 0.7 * losses[0], losses
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == "qwen2"
    assert (out / "tokenizer.json").read_bytes() == (tiny_model / "tokenizer.json").read_bytes()
    assert not list(tmp_path.glob(".sft.*"))


def test_eval_reports_buckets(tiny_model, task, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    # Short chains of two lengths (``--data``): an untrained model writes to its budget, twice the
    # longest demonstration, and this keeps that budget small.
    short = [r for r in task.test_records(200, 0) if r["steps"] <= 2][:6]
    assert {r["steps"] for r in short} == {1, 2}
    data = tmp_path / "short.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in short))
    argv = ["eval", "--task", ARITH, "--model", str(tiny_model), "--data", str(data), "--n", "6"]
    assert main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["n"] == 6
    assert 0.0 <= result["accuracy"] <= 1.0
    assert set(result["buckets"]) == {"1", "2"}
    assert sum(b["n"] for b in result["buckets"].values()) == 6
    assert result["demo_length"]["max"] >= result["demo_length"]["median"]


def stop_after(asks: int) -> tuple[list[int], Callable[[], bool]]:
    """A ``stop`` that says stop from its ``asks``-th question on, and the count of questions."""
    asked = [0]

    def stop() -> bool:
        asked[0] += 1
        return asked[0] >= asks

    return asked, stop


def test_a_stopped_evaluation_ends_inside_its_generate_call(tiny_model, task) -> None:  # type: ignore[no-untyped-def]
    """A trainer that stops mid-evaluation asks it to stop (``stop``): the batch's ``generate``
    ends at its next decoding step, not at its 200-token budget, and the evaluation raises."""
    from laminar.recipe.episodes import EvalStopped
    from laminar.recipe.evaluate import greedy_responses
    from laminar.recipe.model import load_model

    model, tok = load_model(tiny_model)
    prompts = [r["prompt"] for r in task.test_records(4, 0)]
    asked, stop = stop_after(5)
    with pytest.raises(EvalStopped):
        greedy_responses(model, tok, prompts, [200] * 4, batch_size=4, stop=stop)
    assert 5 <= asked[0] <= 8, asked  # once a decoding step, and once after the call
    assert len(greedy_responses(model, tok, prompts[:1], [3], stop=lambda: False)[0]) <= 3


def test_greedy_decoding_with_the_kv_heads_left_grouped_gives_the_same_tokens(
    tiny_model, task, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """Evaluation decodes with the key/value heads left grouped (``fast_attention``): the same
    greedy tokens, on a left-padded batch, as transformers' ``sdpa`` that copies them out; the
    same logits; and the model's own attention implementation is back afterwards."""
    import contextlib

    import torch

    from laminar.recipe import evaluate
    from laminar.recipe.attention import NAME, fast_attention
    from laminar.recipe.episodes import left_padded
    from laminar.recipe.evaluate import greedy_responses
    from laminar.recipe.model import load_model

    model, tok = load_model(tiny_model)
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped
    prompts = [r["prompt"] for r in task.test_records(8, 0)]
    assert len({len(p) for p in prompts}) > 1  # rows of different lengths: a padded batch
    grouped = greedy_responses(model, tok, prompts, [48] * 8, batch_size=8)
    assert model.config._attn_implementation == "sdpa"
    monkeypatch.setattr(evaluate, "fast_attention", lambda model: contextlib.nullcontext())
    assert greedy_responses(model, tok, prompts, [48] * 8, batch_size=8) == grouped

    ids, mask = left_padded([tok.encode(p).ids for p in prompts], special_id(tok, PAD))
    with torch.inference_mode():
        plain = model(input_ids=ids, attention_mask=mask).logits
        with fast_attention(model):
            assert model.config._attn_implementation == NAME
            left = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert torch.allclose(plain[real], left[real], atol=1e-5)

    # a compiled layer guards on the config: switching would recompile it at every evaluation
    model.model.layers[0].compile()  # nothing compiles until it runs
    with fast_attention(model):
        assert model.config._attn_implementation == "sdpa"


def test_a_shared_stop_ends_the_evaluation_when_its_ranks_agree() -> None:
    """Between ``generate`` calls a stop that ranks share decides with them all (``agreed``, a
    collective every rank asks at the same point), not from its own rank's reading: a rank that
    read the stop late still leaves with the others, and one that read it alone stays."""
    from laminar.recipe.episodes import EvalStopped, SharedStop, check_stop

    class Shared:
        def __init__(self, mine: bool, group: bool) -> None:
            self.mine, self.group = mine, group

        def __call__(self) -> bool:
            return self.mine

        def agreed(self) -> bool:
            return self.group

    assert isinstance(Shared(False, False), SharedStop)
    assert not isinstance(lambda: True, SharedStop)
    with pytest.raises(EvalStopped):
        check_stop(Shared(mine=False, group=True))
    check_stop(Shared(mine=True, group=False))
    check_stop(None)
    with pytest.raises(EvalStopped):
        check_stop(lambda: True)


def test_buckets_and_length_stats() -> None:
    assert [bucket_of(k) for k in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [
        "1",
        "2",
        "3-4",
        "3-4",
        "5-8",
        "5-8",
        "9-16",
        "9-16",
        "17-32",
    ]
    stats = length_stats(list(range(1, 101)))
    assert (stats["median"], stats["p90"], stats["p99"], stats["max"]) == (50, 90, 99, 100)


def test_sft_stops_once_validation_accuracy_reaches_stop_at(
    tiny_model, task, tmp_path: Path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    from laminar.recipe import sft

    seen: list[int] = []

    def fake_accuracy(self, model) -> float:  # type: ignore[no-untyped-def]
        seen.append(1)
        return 0.2 * len(seen)  # 0.2, 0.4, 0.6: crosses 0.5 at the third check

    monkeypatch.setattr(sft._Validator, "accuracy", fake_accuracy)
    cfg = sft.SftConfig(
        steps=100, batch_size=4, threads=1, stop_at=0.5, eval_every=3, val_n=4, near_every=0,
        confirm=False,
    )  # fmt: skip
    result = sft.train_sft(task, tiny_model, tmp_path / "out", cfg)
    assert result.stopped_by == "stop_at"
    assert result.steps == 9
    assert [acc for _, _, acc in result.evals] == [0.2, 0.4, 0.6]
    assert json.loads((tmp_path / "out" / "sft.json").read_text())["stopped_by"] == "stop_at"


def test_sft_checks_its_target_at_the_last_step_of_the_budget(
    tiny_model, task, tmp_path: Path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    from laminar.recipe import sft

    seen: list[int] = []

    def fake_accuracy(self, model) -> float:  # type: ignore[no-untyped-def]
        seen.append(1)
        return 0.9 if len(seen) == 3 else 0.1  # reached at the third check: step 10, the last

    monkeypatch.setattr(sft._Validator, "accuracy", fake_accuracy)
    cfg = sft.SftConfig(
        steps=10, batch_size=4, threads=1, stop_at=0.5, eval_every=4, val_n=4, confirm=False
    )
    result = sft.train_sft(task, tiny_model, tmp_path / "out", cfg)
    assert [step for step, _, _ in result.evals] == [4, 8, 10]
    assert result.stopped_by == "stop_at" and result.reached_target


def test_sft_lands_on_its_target_checking_closer_near_it_and_confirming_a_reading(
    tiny_model, task, tmp_path: Path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    from laminar.recipe import sft

    # (the records a validator reads) -> readings, in order: the main set rises, and its first
    # reading over the target is a lucky one that the other set does not confirm
    readings = {"main": [0.2, 0.42, 0.48, 0.56, 0.46, 0.6], "other": [0.38, 0.58]}
    made: dict[int, str] = {}

    def fake_init(self, task, tok, n, bucket=None, seed=sft.VAL_SEED):  # type: ignore[no-untyped-def]
        made[id(self)] = "main" if seed == sft.VAL_SEED else "other"

    def fake_accuracy(self, model) -> float:  # type: ignore[no-untyped-def]
        return readings[made[id(self)]].pop(0)

    monkeypatch.setattr(sft._Validator, "__init__", fake_init)
    monkeypatch.setattr(sft._Validator, "accuracy", fake_accuracy)
    cfg = sft.SftConfig(
        steps=200, batch_size=4, threads=1, stop_at=0.5, eval_every=10, val_n=4, near=0.1,
        near_every=2,
    )  # fmt: skip
    result = sft.train_sft(task, tiny_model, tmp_path / "out", cfg)
    # every 10 steps while far (0.2 at 10), every 2 once within 0.1 (0.42 at 20 is; on from 22)
    assert [step for step, _, _ in result.evals] == [10, 20, 22, 24, 26, 28]
    # 0.56 at 24 is repeated (0.38: together 0.47, no stop); 0.6 at 28 too (0.58: a stop)
    assert result.confirm_evals == [(24, 0.38), (28, 0.58)]
    assert result.stopped_by == "stop_at" and result.steps == 28


def test_sft_that_misses_its_target_says_so_and_writes_nothing_where_expected(
    tiny_model, tmp_path: Path, monkeypatch, capsys
) -> None:  # type: ignore[no-untyped-def]
    from laminar.recipe import sft

    monkeypatch.setattr(sft._Validator, "accuracy", lambda self, model: 0.125)
    out = tmp_path / "sft"
    args = ["sft", "--task", ARITH, "--model", str(tiny_model), "--out", str(out),
            "--steps", "8", "--batch-size", "4", "--threads", "1", "--stop-at", "0.5",
            "--eval-every", "2"]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "MISSED its target" in err and "best 0.12" in err and str(out) in err
    assert not out.exists()  # `make run` must not find a warm start and train on it
    missed = tmp_path / f"sft{sft.MISSED_SUFFIX}"
    assert json.loads((missed / "sft.json").read_text())["stopped_by"] == "steps"


def test_sft_prints_progress_lines_when_piped() -> None:
    from io import StringIO

    from rich.console import Console

    from laminar.recipe.sft import _Progress

    out = StringIO()
    with _Progress(every_s=10.0, console=Console(file=out, width=200)) as shown:
        for second in range(0, 35):  # one update a second for 35 s of (pretend) training
            shown.update(second / 35, 10 * second, 0.5, float("nan"), 1000.0, float(second))
        shown.update(1.0, 350, 0.25, 0.75, 1000.0, 40.0)
    lines = out.getvalue().splitlines()
    assert len(lines) == 5, lines  # at 0, 10, 20, 30 and 40 s: never more than 10 s apart
    assert lines[1].startswith("sft: step 100 (29% of the budget), 10 s, loss 0.5000")
    assert lines[-1].endswith("loss 0.2500, val acc 0.75, 1000 tok/s")


def test_sft_prints_progress_lines_while_a_check_blocks_training() -> None:
    """A validation check blocks the loop (an agentic task's took 15-35 s): lines go on."""
    from io import StringIO

    from rich.console import Console

    from laminar.recipe.sft import _Progress

    out = StringIO()
    with _Progress(every_s=0.01, console=Console(file=out, width=200)) as shown:
        with shown.checking(100, "checking greedy accuracy on 100 problems"):
            deadline = time.monotonic() + 60  # waits for the lines; asserts no timing
            while out.getvalue().count("\n") < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
        after = out.getvalue()
    lines = after.splitlines()
    assert len(lines) >= 3, lines
    assert all(
        line.startswith("sft: step 100, checking greedy accuracy on 100 problems (")
        for line in lines
    )
    time.sleep(0.05)
    assert out.getvalue() == after  # the ticker ended with the check


def test_the_ticker_says_how_long_and_counts_from_the_callers_last_line() -> None:
    from laminar.recipe.ticker import Ticker

    lines: list[str] = []
    ticker = Ticker(lines.append, every_s=3600.0)
    with ticker.during("eval: m"):
        pass
    assert lines == []  # nothing due within the hour
    ticker = Ticker(lines.append, every_s=0.01)
    with ticker.during("eval: m"):
        deadline = time.monotonic() + 60  # waits for the lines; asserts no timing
        while len(lines) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    said = list(lines)
    assert len(said) >= 2 and all(
        x.startswith("eval: m (") and x.endswith(" s so far)") for x in said
    )
    time.sleep(0.05)
    assert lines == said  # the thread ended with the block
    ticker.every_s = 3600.0
    ticker.said_at = time.monotonic() - 3600.0  # as if the caller last printed an hour ago
    with ticker.during("late"):
        deadline = time.monotonic() + 60
        while len(lines) == len(said) and time.monotonic() < deadline:
            time.sleep(0.01)
    assert lines[len(said)].startswith("late (")  # due at once: the hour since the caller's line


def test_stop_at_flag() -> None:
    from laminar.recipe.cli import parse_stop_at

    assert parse_stop_at(None, 0.5) == 0.5
    assert parse_stop_at("off", 0.5) is None
    assert parse_stop_at("0.3", None) == 0.3
    with pytest.raises(ConfigError):
        parse_stop_at("2", None)


def test_stop_bucket_validates_on_that_chain_length_only(task) -> None:  # type: ignore[no-untyped-def]
    from laminar.recipe.cli import parse_stop_bucket
    from laminar.recipe.sft import VAL_SEED, SftConfig, validation_records

    records = validation_records(task, 60, "5-8")
    assert len(records) == 60 and {bucket_of(r["steps"]) for r in records} == {"5-8"}
    assert len({r["id"] for r in records}) == 60
    assert validation_records(task, 60, "5-8") == records  # the same problems at every check
    assert validation_records(task, 60) == task.train_records(60, VAL_SEED)  # no bucket: as before
    with pytest.raises(ConfigError, match="65-128: 0 of"):  # arith chains stop at 48 steps
        validation_records(task, 5, "65-128")
    with pytest.raises(ConfigError, match="needs a --stop-at"):
        SftConfig(steps=10, stop_bucket="5-8", stop_bucket_at=0.3).validate()
    with pytest.raises(ConfigError, match="go together"):
        SftConfig(steps=10, stop_at=0.5, stop_bucket="5-8").validate()
    with pytest.raises(ConfigError, match="bucket_every"):
        SftConfig(steps=10, bucket_every=0).validate()
    assert parse_stop_bucket("5-8=0.3", None, 0.5) == ("5-8", 0.3)
    assert parse_stop_bucket(None, ("9-16", 0.2), 0.5) == ("9-16", 0.2)
    assert parse_stop_bucket("off", ("9-16", 0.2), 0.5) == (None, None)
    assert parse_stop_bucket(None, ("9-16", 0.2), None) == (None, None)  # no stop: no bucket
    for bad in ("5-8", "5-8=2", "=0.3"):
        with pytest.raises(ConfigError, match="STEPS=ACC"):
            parse_stop_bucket(bad, None, 0.5)


def test_sft_stops_once_both_targets_are_reached(
    tiny_model, task, tmp_path: Path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    from laminar.recipe import sft

    checks: list[str] = []

    def accuracy(self, model) -> float:  # type: ignore[no-untyped-def]
        on_bucket = {bucket_of(r["steps"]) for r in self.records} == {"5-8"}
        checks.append("5-8" if on_bucket else "all")
        if on_bucket:  # the bucket's target is reached at the third look at it
            return 0.5 if checks.count("5-8") == 3 else 0.1
        return 0.2 if len(checks) == 1 else 0.6  # the overall one from the second check on

    monkeypatch.setattr(sft._Validator, "accuracy", accuracy)
    cfg = sft.SftConfig(steps=100, batch_size=4, threads=1, stop_at=0.5, eval_every=4, val_n=4,
                        stop_bucket="5-8", stop_bucket_at=0.3, bucket_every=2, near_every=0,
                        confirm=False)  # fmt: skip
    result = sft.train_sft(task, tiny_model, tmp_path / "out", cfg)
    # the bucket is looked at only once the overall target is reached, and from then on both
    # every bucket_every steps
    assert checks == ["all", "all", "5-8", "all", "5-8", "all", "5-8"]
    assert [step for step, _, _ in result.evals] == [4, 8, 10, 12]
    assert result.stopped_by == "stop_at" and result.steps == 12
    assert result.bucket_evals == [(8, 0.1), (10, 0.1), (12, 0.5)]


def test_stop_bucket_flag_and_task_default(tiny_model, tmp_path: Path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    from laminar.recipe import sft

    monkeypatch.setattr(sft._Validator, "accuracy", lambda self, model: 0.6)  # 5-8 too
    args = ["sft", "--task", ARITH, "--model", str(tiny_model), "--steps", "2",
            "--batch-size", "4", "--threads", "1", "--stop-at", "0.5", "--eval-every", "2"]  # fmt: skip
    assert main([*args, "--out", str(tmp_path / "a"), "--stop-bucket", "5-8=0.7"]) == 2
    assert "never reached 0.50 (and 0.70 on 5-8-step problems)" in capsys.readouterr().err
    missed = json.loads((tmp_path / f"a{sft.MISSED_SUFFIX}" / "sft.json").read_text())
    assert (missed["config"]["stop_bucket"], missed["config"]["stop_bucket_at"]) == ("5-8", 0.7)
    assert missed["bucket_evals"] == [[2, 0.6]]
    assert main([*args, "--out", str(tmp_path / "b")]) == 0  # arith sets no SFT_STOP_BUCKET
    no_stop = [*args[:-4], "--stop-at", "off", "--out", str(tmp_path / "c")]
    assert main([*no_stop, "--stop-bucket", "5-8=0.3"]) == 2  # a bucket without a target
    assert "--stop-bucket needs a --stop-at target" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()
    done = json.loads((tmp_path / "b" / "sft.json").read_text())
    assert done["config"]["stop_bucket"] is None and done["bucket_evals"] == []
