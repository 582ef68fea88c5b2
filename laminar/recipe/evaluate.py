"""``laminar eval``: greedy accuracy of a model directory on a task's held-out records.

Why greedy and per bucket: the warm start must leave RL room to help, which means "right on short
problems, wrong on long ones". One overall number hides that, so accuracy is also reported per
bucket of the record's ``steps`` (powers of two: 1, 2, 3-4, 5-8, ...), together with the
response-length distribution (in tokens) of the demonstrations and of what the model wrote.

Generation is HF ``generate`` with the KV cache, batched over records sorted by prompt length
(left padding), so a batch's sequences finish at similar times. Each batch may write at most
``2 x`` its longest demonstration + 16 tokens: a model that never stops costs bounded time and
is simply wrong.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from laminar.runtime.errors import ConfigError

from .attention import fast_attention
from .episodes import check_stop, greedy_episodes, left_padded, stopping_criteria
from .model import load_model
from .tasks import Record, Task, check_chat_model, read_jsonl
from .tokenizer import EOS, PAD, special_id


@dataclass
class EvalResult:
    """Accuracy overall and per steps bucket, plus length statistics (tokens)."""

    model: str
    n: int
    accuracy: float
    seconds: float
    buckets: dict[str, dict[str, float]] = field(default_factory=dict)
    demo_length: dict[str, float] = field(default_factory=dict)
    response_length: dict[str, float] = field(default_factory=dict)
    tool_calls: float | None = None  # multi-turn tasks: mean tool calls per episode


def demo_lengths(tok: Any, demos: list[str]) -> list[int]:
    """Token lengths of demonstrations, EOS included."""
    return [len(tok.encode(d).ids) + 1 for d in demos]


def greedy_budget(demo_length: int) -> int:
    """Response tokens a greedy evaluation allows a record whose demonstration is
    ``demo_length`` tokens: twice that, plus slack (an environment's tokens count too)."""
    return 2 * demo_length + 16


def record_steps(record: Record) -> int | None:
    """A record's chain length for per-bucket reports: its ``steps``, or in verl's layout its
    ``extra_info.steps``; None if it has neither."""
    steps = record.get("steps")
    if steps is None and isinstance(record.get("extra_info"), dict):
        steps = record["extra_info"].get("steps")
    return None if steps is None else int(steps)


def bucket_of(steps: int) -> str:
    """Power-of-two bucket label: 1, 2, 3-4, 5-8, 9-16, ..."""
    if steps <= 2:
        return str(steps)
    hi = 1 << (steps - 1).bit_length()
    return f"{hi // 2 + 1}-{hi}"


def bucket_start(label: str) -> int:
    """The shortest chain of a :func:`bucket_of` label (its sort key): ``"5-8"`` -> 5."""
    return int(label.split("-")[0])


def length_stats(lengths: list[int]) -> dict[str, float]:
    """Mean, median, p90, p99 and max of a list of lengths (nearest-rank percentiles)."""
    if not lengths:
        return {}
    ordered = sorted(lengths)

    def pct(q: float) -> float:
        return float(ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))])

    return {
        "mean": round(sum(ordered) / len(ordered), 1),
        "median": pct(0.5),
        "p90": pct(0.9),
        "p99": pct(0.99),
        "max": float(ordered[-1]),
    }


def greedy_responses(
    model: Any,
    tok: Any,
    prompts: list[str],
    budgets: list[int],
    batch_size: int = 32,
    synced: bool = False,
    stop: Callable[[], bool] | None = None,
    end: str = EOS,
) -> list[list[int]]:
    """Greedy response token ids (the end token ``end`` and padding stripped) of each prompt, in
    input order; a response ends at ``end`` (a chat task's end of turn: :attr:`Task.end_token`).

    ``synced``: the model is sharded (FSDP) and every rank generates the same prompts; each keeps
    stepping until all are done, so their all-gathers stay paired (HF's ``synced_gpus``).
    ``stop``: asked at every decoding step; true raises :class:`EvalStopped`."""
    import torch

    eos, pad = special_id(tok, end), special_id(tok, PAD)
    encoded = [tok.encode(p).ids for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: (len(encoded[i]), budgets[i]))
    out: list[list[int]] = [[] for _ in prompts]
    limit = int(model.config.max_position_embeddings)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        ids, mask = left_padded([encoded[i] for i in idx], pad)
        width = ids.shape[1]
        new = max(1, min(max(budgets[i] for i in idx), limit - width))
        with torch.inference_mode(), fast_attention(model):
            gen = model.generate(
                input_ids=ids.to(model.device),  # a trainer's policy may be on a GPU
                attention_mask=mask.to(model.device),
                max_new_tokens=new,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=pad,
                synced_gpus=synced,
                stopping_criteria=stopping_criteria(stop),
            )
        check_stop(stop)
        for row, i in enumerate(idx):
            resp = gen[row, width:].tolist()
            if eos in resp:
                resp = resp[: resp.index(eos)]
            out[i] = [t for t in resp if t != pad]
    return out


def evaluate(
    task: Task,
    model_dir: str | Path,
    n: int = 200,
    seed: int = 0,
    data: str | None = None,
    batch_size: int = 32,
    threads: int = 2,
) -> EvalResult:
    """Greedy accuracy of ``model_dir`` on ``n`` test records (or the records of ``data``)."""
    import torch

    if threads > 0:
        torch.set_num_threads(threads)
    model, tok = load_model(model_dir)
    check_chat_model(Path(model_dir), task)
    records = eval_records(task, n, seed, data)
    return evaluate_model(task, model, tok, records, batch_size, name=str(model_dir))


def eval_records(task: Task, n: int, seed: int = 0, data: str | None = None) -> list[Record]:
    """The first ``n`` records of ``data`` (a JSONL file), or ``n`` of the task's test split."""
    return read_jsonl(data)[:n] if data else task.test_records(n, seed)


def evaluate_model(
    task: Task,
    model: Any,
    tok: Any,
    records: list[Record],
    batch_size: int = 32,
    name: str = "model",
    synced: bool = False,
    stop: Callable[[], bool] | None = None,
) -> EvalResult:
    """Greedy accuracy of an in-memory HF causal LM (the trainer evaluates its live policy with
    this); the model is put in eval mode for the duration and its previous mode restored.
    ``stop``: asked at every decoding step; true gives up with :class:`EvalStopped`."""
    was_training = model.training
    model.eval()
    try:
        demos = [task.demonstration(r) for r in records]
        demo_lens = demo_lengths(tok, demos)
        budgets = [greedy_budget(length) for length in demo_lens]
        start = time.monotonic()
        rewards, responses, calls = task_rewards(task, model, tok, records, budgets, batch_size,
                                                 synced, stop)  # fmt: skip
        seconds = time.monotonic() - start
    finally:
        model.train(was_training)
    groups: dict[str, list[float]] = {}
    for record, reward in zip(records, rewards, strict=True):
        steps = record_steps(record)
        if steps is not None:
            groups.setdefault(bucket_of(steps), []).append(reward)
    buckets = {
        label: {"n": len(vals), "accuracy": round(sum(vals) / len(vals), 3)}
        for label, vals in sorted(groups.items(), key=lambda kv: bucket_start(kv[0]))
    }
    return EvalResult(
        model=name,
        n=len(records),
        accuracy=round(sum(rewards) / max(1, len(rewards)), 3),
        seconds=round(seconds, 1),
        buckets=buckets,
        demo_length=length_stats(demo_lens),
        response_length=length_stats([len(r) + 1 for r in responses]),
        tool_calls=None if calls is None else round(sum(calls) / max(1, len(calls)), 3),
    )


def task_rewards(
    task: Task,
    model: Any,
    tok: Any,
    records: list[Record],
    budgets: list[int],
    batch_size: int = 32,
    synced: bool = False,
    stop: Callable[[], bool] | None = None,
) -> tuple[list[float], list[list[int]], list[int] | None]:
    """Greedy rewards of ``records``, their responses' token ids, and (multi-turn tasks: greedy
    episodes, :mod:`.episodes`) each episode's tool calls."""
    if task.environment is not None:
        if task.chat is not None:
            raise ConfigError(
                f"task {task.spec!r}: the recipe evaluates multi-turn tasks on text prompts only, "
                "not chat ones (CHAT_TEMPLATE with an ENVIRONMENT)"
            )
        episodes = greedy_episodes(model, tok, task.environment, records, budgets,
                                   max_turns=task.max_turns, batch_size=batch_size,
                                   synced=synced, stop=stop)  # fmt: skip
        return (
            [e.reward for e in episodes],
            [e.response for e in episodes],
            [e.calls for e in episodes],
        )
    prompts = [task.prompt_text(r) for r in records]
    responses = greedy_responses(
        model, tok, prompts, budgets, batch_size, synced, stop, end=task.end_token
    )
    rewards = [
        float(task.reward(r, tok.decode(ids))) for r, ids in zip(records, responses, strict=True)
    ]
    return rewards, responses, None


def render(result: EvalResult) -> str:
    """A short human-readable report of an :class:`EvalResult`."""
    lines = [
        f"{result.model}: accuracy {result.accuracy:.3f} on {result.n} test records "
        f"({result.seconds:.0f} s)",
    ]
    if result.buckets:
        lines.append("  steps      n  accuracy")
        for label, row in result.buckets.items():
            lines.append(f"  {label:>6} {int(row['n']):>6}  {row['accuracy']:.3f}")
    for name, stats in (("demo", result.demo_length), ("model", result.response_length)):
        if stats:
            lines.append(
                f"  {name} response tokens: median {stats['median']:.0f}, p90 {stats['p90']:.0f}, "
                f"p99 {stats['p99']:.0f}, max {stats['max']:.0f}"
            )
    if result.tool_calls is not None:
        lines.append(f"  tool calls per episode: {result.tool_calls:.2f}")
    return "\n".join(lines)


def to_json(result: EvalResult) -> str:
    return json.dumps(asdict(result), indent=2)
