"""``laminar sft``: supervised warm start of a task model on the task's demonstrations.

Why a warm start: RL from a random model on a verifiable task never sees a reward. A short SFT run
teaches the response *format* and most of the per-step skill, so that after it the model solves
short problems and fails long ones, which is where RL has room to help (and where the long tail of
response lengths is).

What it does: draws training records from the task (an endless stream from the ``train`` split,
or a fixed ``demos.jsonl`` with ``prompt``/``response``), tokenizes ``prompt`` + ``response`` +
EOS (a chat task's prompt rendered with its template, the response ending with the end of turn:
:mod:`.chat`), and trains with the loss on response tokens only. Batches hold ``batch_size``
sequences of similar length (a pool is sorted by length, cut into batches, and the batches
shuffled), so the heavy-tailed lengths do not turn most of each batch into padding. AdamW,
linear warmup then cosine decay to ``min_lr_ratio``, gradient-norm clipping.

The budget is ``steps`` or ``minutes`` (whichever ends first when both are given). With a time
budget the learning-rate schedule follows the elapsed fraction of the budget, so a run of M
minutes always completes its schedule, on whatever machine; a step budget is reproducible.

Curriculum (``SFT_CURRICULUM`` in the task module, ``--no-curriculum`` to skip it): stages of
``(until_step, knobs)``; each pool of training records is drawn with the knobs of the stage the
run is in (passed to the task's ``generate``), and after the last stage from the task's own
distribution. Why: where the task gives no first-order signal (modular arithmetic: neither the
value nor the digit alone says anything about the result), a model trained on the whole
distribution sits on a loss plateau until noise breaks the symmetry, for a number of steps that
depends on the seed; easier stages first give the gradient a foothold (docs/benchmarks.md, *The
warm start*).

``stop_at``: RL needs a policy that is right on some problems but far from all, so the run stops
as soon as greedy accuracy on ``val_n`` training-split problems of the task's own distribution
(checked every ``eval_every`` steps) reaches ``stop_at``. Closer checks near the target
(``near``, ``near_every``), a reading repeated on other problems before it counts (``confirm``)
and an optional chain-length bucket that must reach ``stop_bucket_at`` too (``stop_bucket``)
make it land close to the target rather than wherever the next check falls: docs/training.md,
*The warm start*. A run whose budget ends first has *missed its target*: its model is written
beside ``out`` (``<out>.missed``), never to ``out``, and ``laminar sft`` exits 2, so a Makefile
rule or an RL config never picks up a broken warm start. The result is written atomically with
``sft.json`` (settings, steps, why it stopped, loss and validation curves) beside the weights.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from laminar.runtime.errors import ConfigError

from .model import check_model_dir, save_model_dir
from .tasks import Record, Task, check_chat_model, read_jsonl
from .ticker import Ticker
from .tokenizer import PAD, load_tokenizer, special_id

IGNORE = -100
#: where a run that missed its ``stop_at`` target writes its model (beside OUT, never OUT itself)
MISSED_SUFFIX = ".missed"
#: seed of the validation records of ``stop_at`` (training chunks use seed * 1_000_003 + chunk)
VAL_SEED = 999_983


@dataclass
class SftConfig:
    """Settings of one SFT run (the CLI flags of ``laminar sft``)."""

    steps: int | None = None
    minutes: float | None = None
    batch_size: int = 16
    lr: float = 3e-3
    min_lr_ratio: float = 0.05
    warmup: float = 0.03
    weight_decay: float = 0.01
    clip: float = 1.0
    seed: int = 0
    threads: int = 2
    pool_batches: int = 16
    max_len: int = 1024
    demos: str | None = None
    stop_at: float | None = None
    stop_bucket: str | None = None  # and a chain-length bucket ("5-8") must reach...
    stop_bucket_at: float | None = None  # ...this accuracy
    #: once the overall target is reached, both are checked this often (a bucket can jump from
    #: chance to nearly solved within a couple of hundred steps, so a check every 100 steps stops
    #: past the point RL gains most from: docs/benchmarks.md, *Learning*)
    bucket_every: int = 20
    curriculum: bool = True  # the task's SFT_CURRICULUM, if it has one
    eval_every: int = 100
    val_n: int = 100
    #: landing on ``stop_at`` (see the module docstring): once a check reads at least
    #: ``stop_at - near``, checks come every ``near_every`` steps (0: every ``eval_every``)...
    near: float = 0.15
    near_every: int = 20
    #: ...and a check that reaches ``stop_at`` is repeated on ``val_n`` other problems; the run
    #: stops only if the two together reach it
    confirm: bool = True

    def validate(self) -> None:
        if self.steps is None and self.minutes is None:
            raise ConfigError("give a budget: --steps N or --minutes M")
        if self.steps is not None and self.steps < 1:
            raise ConfigError(f"--steps must be >= 1, not {self.steps}")
        if self.minutes is not None and self.minutes <= 0:
            raise ConfigError(f"--minutes must be > 0, not {self.minutes}")
        if self.batch_size < 1 or self.lr <= 0 or not 0 <= self.warmup < 1:
            raise ConfigError("need batch size >= 1, lr > 0 and 0 <= warmup < 1")
        if self.stop_at is not None and (self.eval_every < 1 or self.val_n < 1):
            raise ConfigError("--stop-at needs eval_every >= 1 and val_n >= 1")
        if (self.stop_bucket is None) != (self.stop_bucket_at is None):
            raise ConfigError("stop_bucket and stop_bucket_at go together (--stop-bucket 5-8=0.3)")
        if self.stop_bucket is not None and self.stop_at is None:
            raise ConfigError("--stop-bucket needs a --stop-at target")
        if self.bucket_every < 1:
            raise ConfigError(f"bucket_every must be >= 1, not {self.bucket_every}")
        if self.near_every < 0 or not 0 <= self.near < 1:
            raise ConfigError(
                f"need near_every >= 0 (0: off) and 0 <= near < 1, not {self.near_every} and "
                f"{self.near}"
            )
        if self.stop_bucket_at is not None and not 0 < self.stop_bucket_at <= 1:
            raise ConfigError(f"stop_bucket_at is an accuracy in (0, 1], not {self.stop_bucket_at}")


@dataclass
class SftResult:
    """What a run did: written to ``OUT/sft.json``."""

    out: str
    steps: int
    seconds: float
    tokens: int
    sequences: int
    final_loss: float
    stopped_by: str = ""  # "steps", "minutes" or "stop_at"
    losses: list[tuple[int, float, float]] = field(default_factory=list)  # step, seconds, loss
    evals: list[tuple[int, float, float]] = field(default_factory=list)  # step, seconds, accuracy
    bucket_evals: list[tuple[int, float]] = field(default_factory=list)  # step, stop_bucket's acc
    confirm_evals: list[tuple[int, float]] = field(default_factory=list)  # step, the repeat's acc
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def reached_target(self) -> bool:
        """False iff a ``stop_at`` target was set and the budget ran out before it was reached."""
        return self.config.get("stop_at") is None or self.stopped_by == "stop_at"


def lr_factor(progress: float, warmup: float, min_ratio: float) -> float:
    """Learning-rate multiplier at ``progress`` in [0, 1]: linear warmup, cosine to min_ratio."""
    if warmup > 0 and progress < warmup:
        return max(progress / warmup, 1e-3)
    rest = (progress - warmup) / max(1e-9, 1 - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, rest)))


class _Validator:
    """Greedy accuracy on a fixed set of training-split records (the ``stop_at`` criterion; with
    ``bucket``, the ``stop_bucket`` one)."""

    def __init__(
        self, task: Task, tok: Any, n: int, bucket: str | None = None, seed: int = VAL_SEED
    ) -> None:
        self.task = task
        self.tok = tok
        self.records = validation_records(task, n, bucket, seed)
        demos = [task.demonstration(r) for r in self.records]
        from .evaluate import greedy_budget

        self.budgets = [greedy_budget(len(tok.encode(d).ids)) for d in demos]  # EOS not counted

    def accuracy(self, model: Any) -> float:
        from .evaluate import task_rewards

        model.eval()
        try:
            rewards, _, _ = task_rewards(
                self.task, model, self.tok, self.records, self.budgets, batch_size=64
            )
        finally:
            model.train()
        return sum(rewards) / len(rewards)


def _reached(
    acc: float, confirmer: _Validator | None, model: Any, cfg: SftConfig, result: SftResult
) -> bool:
    """Whether a check's reading ``acc`` reaches ``stop_at``: with a ``confirmer``, a reading
    that does is repeated on its other problems, and the mean of the two must reach it too."""
    assert cfg.stop_at is not None  # a validator exists only with a target
    if acc < cfg.stop_at:
        return False
    if confirmer is None:
        return True
    again = confirmer.accuracy(model)
    result.confirm_evals.append((result.steps, round(again, 4)))
    return (acc + again) / 2 >= cfg.stop_at


def _frontier_reached(
    frontier: _Validator | None, model: Any, cfg: SftConfig, result: SftResult
) -> bool:
    """The ``stop_bucket`` target, checked only once ``stop_at`` is reached (it costs nothing
    before)."""
    if frontier is None:
        return True
    acc = frontier.accuracy(model)
    result.bucket_evals.append((result.steps, round(acc, 4)))
    assert cfg.stop_bucket_at is not None  # a frontier exists only with a bucket target
    return acc >= cfg.stop_bucket_at


def validation_records(
    task: Task, n: int, bucket: str | None = None, seed: int = VAL_SEED
) -> list[Record]:
    """``n`` training-split records of the task's own distribution (seeded ``seed``); with
    ``bucket``, the first ``n`` whose chain length (``steps``) falls in it, from draws of growing
    size."""
    if bucket is None:
        return task.train_records(n, seed)
    from .evaluate import bucket_of, bucket_start

    size = 4 * n
    while True:
        pool = task.train_records(size, seed)
        if any("steps" not in r for r in pool):
            raise ConfigError(f"--stop-bucket {bucket}: the task's records carry no 'steps'")
        picked = [r for r in pool if bucket_of(int(r["steps"])) == bucket][:n]
        if len(picked) == n:
            return picked
        if size >= 256 * n:
            found = sorted({bucket_of(int(r["steps"])) for r in pool}, key=bucket_start)
            raise ConfigError(
                f"--stop-bucket {bucket}: {len(picked)} of {size} training problems fall in it "
                f"(buckets seen: {', '.join(found)})"
            )
        size *= 4


def curriculum_knobs(stages: list[tuple[int, dict[str, Any]]], step: int) -> dict[str, Any]:
    """The ``generate`` knobs of the curriculum stage that ``step`` falls in ({} after the last)."""
    for until, knobs in stages:
        if step < until:
            return knobs
    return {}


def _pairs(task: Task, cfg: SftConfig, step: Callable[[], int]) -> Iterator[tuple[str, str]]:
    """An endless stream of ``(prompt, response)`` pairs, in pools of ``pool_batches`` batches;
    each pool is drawn with the curriculum stage of the step it is drawn at (``step()``)."""
    pool = cfg.batch_size * cfg.pool_batches
    if cfg.demos:
        rows = read_jsonl(cfg.demos)
        if not rows or not all("prompt" in r and "response" in r for r in rows):
            raise ConfigError(f"{cfg.demos}: need rows with 'prompt' and 'response'")
        rng = random.Random(cfg.seed)
        while True:
            rng.shuffle(rows)
            for row in rows:
                yield task.prompt_text(row), row["response"]
    stages = task.sft_curriculum if cfg.curriculum else []
    chunk = 0
    while True:
        # One fresh stream per chunk; the chunk index is part of the seed, so no chunk repeats.
        knobs = curriculum_knobs(stages, step())
        records: list[Record] = task.train_records(pool, cfg.seed * 1_000_003 + chunk, **knobs)
        for record in records:
            yield task.prompt_text(record), task.sft_target(record)
        chunk += 1


def _batches(
    task: Task, tok: Any, cfg: SftConfig, step: Callable[[], int]
) -> Iterator[tuple[list[list[int]], list[int]]]:
    """Batches of ``(token ids, prompt lengths)``, of similar total length within a batch; each
    response ends with the task's end token (``<eos>``, a chat task's end of turn)."""
    eos = special_id(tok, task.end_token)
    rng = random.Random(cfg.seed + 1)
    pairs = _pairs(task, cfg, step)
    pool_size = cfg.batch_size * cfg.pool_batches
    while True:
        pool: list[tuple[list[int], int]] = []
        for prompt, response in pairs:
            p_ids = tok.encode(prompt).ids
            ids = (p_ids + tok.encode(response).ids + [eos])[: cfg.max_len]
            if len(ids) > len(p_ids):
                pool.append((ids, len(p_ids)))
            if len(pool) >= pool_size:
                break
        pool.sort(key=lambda item: len(item[0]))
        batches = [pool[i : i + cfg.batch_size] for i in range(0, len(pool), cfg.batch_size)]
        rng.shuffle(batches)
        for batch in batches:
            yield [ids for ids, _ in batch], [n for _, n in batch]


def collate(seqs: list[list[int]], prompt_lens: list[int], pad_id: int) -> dict[str, Any]:
    """Right-padded ``input_ids``/``attention_mask``/``labels``; labels only on response tokens."""
    import torch

    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    labels = torch.full((len(seqs), width), IGNORE, dtype=torch.long)
    for row, (seq, n_prompt) in enumerate(zip(seqs, prompt_lens, strict=True)):
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
        labels[row, n_prompt : len(seq)] = torch.tensor(seq[n_prompt:])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def train_sft(task: Task, model_dir: str | Path, out: str | Path, cfg: SftConfig) -> SftResult:
    """Run SFT from ``model_dir`` and save the result (model + tokenizer + sft.json) to ``out``."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg.validate()
    src = check_model_dir(model_dir)
    check_chat_model(src, task)
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    tok = load_tokenizer(src)
    pad = special_id(tok, PAD)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.train()
    cfg.max_len = min(cfg.max_len, int(model.config.max_position_embeddings))
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "embed" in n]
    optim = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.98),
    )
    budget_s = cfg.minutes * 60 if cfg.minutes is not None else math.inf
    result = SftResult(
        out=str(out),
        steps=0,
        seconds=0.0,
        tokens=0,
        sequences=0,
        final_loss=math.nan,
        config=asdict(cfg),
    )
    validator = _Validator(task, tok, cfg.val_n) if cfg.stop_at is not None else None
    confirmer = None
    if validator is not None and cfg.confirm:
        confirmer = _Validator(task, tok, cfg.val_n, seed=VAL_SEED + 1)
    frontier = _Validator(task, tok, cfg.val_n, cfg.stop_bucket) if cfg.stop_bucket else None
    ema: float | None = None
    acc = math.nan
    near = False  # the last check read within cfg.near of the target: checks every near_every
    armed = False  # the overall target was reached: the bucket's is checked every bucket_every
    start = time.monotonic()
    progress = 0.0
    with _Progress() as shown:
        for seqs, prompt_lens in _batches(task, tok, cfg, lambda: result.steps):
            elapsed = time.monotonic() - start
            by_steps = result.steps / cfg.steps if cfg.steps else 0.0
            progress = max(by_steps, elapsed / budget_s)
            out_of_budget = progress >= 1.0
            # The last step of the budget is checked too: a run that reached its target there
            # has not missed it.
            every = cfg.eval_every
            if armed:
                every = cfg.bucket_every
            elif near and cfg.near_every:
                every = cfg.near_every
            check = result.steps % every == 0 or out_of_budget
            if validator is not None and result.steps and check:
                with shown.checking(
                    result.steps, f"checking greedy accuracy on {cfg.val_n} problems"
                ):
                    acc = validator.accuracy(model)
                    result.evals.append((result.steps, round(elapsed, 2), round(acc, 4)))
                    near = cfg.stop_at is not None and acc >= cfg.stop_at - cfg.near
                    reached = _reached(acc, confirmer, model, cfg, result)
                    if reached:
                        armed = frontier is not None
                        reached = _frontier_reached(frontier, model, cfg, result)
                if reached:
                    result.stopped_by = "stop_at"
                    break
            if out_of_budget:
                result.stopped_by = "steps" if by_steps >= 1.0 else "minutes"
                break
            for group in optim.param_groups:
                group["lr"] = cfg.lr * lr_factor(progress, cfg.warmup, cfg.min_lr_ratio)
            batch = collate(seqs, prompt_lens, pad)
            loss = model(**batch).loss
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
            optim.step()
            value = float(loss.detach())
            ema = value if ema is None else 0.95 * ema + 0.05 * value
            result.steps += 1
            result.tokens += int(batch["attention_mask"].sum())
            result.sequences += len(seqs)
            if result.steps == 1 or result.steps % 10 == 0:
                result.losses.append((result.steps, round(elapsed, 2), round(value, 4)))
            now = time.monotonic() - start
            shown.update(progress, result.steps, ema, acc, result.tokens / max(1e-9, now), now)
    result.seconds = round(time.monotonic() - start, 2)
    result.final_loss = round(ema if ema is not None else math.nan, 4)
    model.eval()
    if not result.reached_target:
        # A warm start that missed its target is kept for a look, never where the next step (a
        # Makefile rule, an RL config) expects a usable model.
        out = Path(out).with_name(Path(out).name + MISSED_SUFFIX)
    summary = json.dumps(asdict(result), indent=1) + "\n"
    result.out = str(save_model_dir(model, src, out, extra={"sft.json": summary}))
    return result


class _Progress:
    """What SFT shows while it runs: a rich bar on a terminal; when the output is piped (CI,
    ``make run`` in a log) a plain line every ``every_s`` seconds instead, so a long warm start
    never looks hung; during a validation check too (:meth:`checking`)."""

    def __init__(self, every_s: float = 10.0, console: Any = None) -> None:
        from rich.console import Console

        self.console = console or Console(highlight=False)
        self.every_s = every_s
        self.bar: Any = None
        self._last = -math.inf  # the training clock (update's elapsed) at the last line
        self._ticker = Ticker(self.console.print, every_s)

    @contextmanager
    def checking(self, step: int, what: str) -> Iterator[None]:
        """Lines on while a check blocks the training loop (:mod:`.ticker`); a terminal's bar
        shows its elapsed time by itself."""
        if self.bar is not None:
            yield
            return
        with self._ticker.during(f"sft: step {step}, {what}"):
            yield

    def __enter__(self) -> _Progress:
        if self.console.is_terminal:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(
                TextColumn("[bold]sft"),
                BarColumn(),
                TextColumn("{task.percentage:>3.0f}%"),
                TextColumn("loss {task.fields[loss]:.4f}"),
                TextColumn("val acc {task.fields[acc]:.2f}"),
                TextColumn("{task.fields[tps]:.0f} tok/s"),
                TimeElapsedColumn(),
                console=self.console,
                transient=False,
            )
            self.bar.__enter__()
            self._task = self.bar.add_task("sft", total=1000, loss=math.nan, tps=0.0, acc=math.nan)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def update(
        self, progress: float, step: int, loss: float, acc: float, tps: float, elapsed: float
    ) -> None:
        if self.bar is not None:
            self.bar.update(self._task, completed=int(1000 * progress), loss=loss, acc=acc, tps=tps)
            return
        if elapsed - self._last >= self.every_s:
            self._last = elapsed
            self._ticker.said()
            val = "" if math.isnan(acc) else f", val acc {acc:.2f}"
            self.console.print(
                f"sft: step {step} ({100 * progress:.0f}% of the budget), {elapsed:.0f} s, "
                f"loss {loss:.4f}{val}, {tps:.0f} tok/s"
            )
