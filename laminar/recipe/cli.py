"""The recipe's sub-commands: ``laminar model init``, ``laminar sft``, ``laminar eval``.

Why here and lazily: ``laminar serve`` must start fast and must not import torch/transformers, so
:func:`register` only declares arguments; each command imports its module when it runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

DEFAULT_TASK = "examples/arith"
#: the default SFT budget; a step count (not minutes) so the warm start is reproducible
DEFAULT_SFT_STEPS = 3500


def cmd_model_init(args: argparse.Namespace) -> int:
    from .model import ModelShape, count_parameters, init_model, load_model
    from .tasks import load_task

    task = load_task(args.task)
    shape = ModelShape(
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        intermediate=args.intermediate,
        max_len=args.max_len,
        tie_embeddings=args.tie_embeddings,
    )
    out = init_model(task.alphabet, args.out, shape, seed=args.seed, chat=task.chat)
    model, tok = load_model(out)
    chat = "" if task.chat is None else f", chat template {task.chat.name}"
    print(
        f"wrote {out}: Qwen2 {count_parameters(model) / 1e6:.2f} M parameters, "
        f"vocab {tok.get_vocab_size()}, head dim {args.hidden // args.heads}{chat}"
    )
    return 0


def cmd_sft(args: argparse.Namespace) -> int:
    from .sft import SftConfig, train_sft
    from .tasks import load_task

    task = load_task(args.task)
    steps = args.steps
    if steps is None and args.minutes is None:
        steps = DEFAULT_SFT_STEPS
    cfg = SftConfig(
        steps=steps, minutes=args.minutes, seed=args.seed, threads=args.threads, demos=args.demos
    )
    for name in ("batch_size", "lr", "warmup", "eval_every", "near_every"):
        if getattr(args, name) is not None:
            setattr(cfg, name, getattr(args, name))
    cfg.confirm = not args.no_confirm
    cfg.stop_at = parse_stop_at(args.stop_at, getattr(task.module, "SFT_STOP_AT", None))
    cfg.stop_bucket, cfg.stop_bucket_at = parse_stop_bucket(
        args.stop_bucket, getattr(task.module, "SFT_STOP_BUCKET", None), cfg.stop_at
    )
    cfg.curriculum = not args.no_curriculum
    result = train_sft(task, args.model, args.out, cfg)
    val = f", val accuracy {result.evals[-1][2]:.2f}" if result.evals else ""
    print(
        f"wrote {result.out}: {result.steps} steps ({result.stopped_by}), {result.sequences} "
        f"sequences, {result.tokens} tokens in {result.seconds:.0f} s, final loss "
        f"{result.final_loss:.4f}{val}"
    )
    if not result.reached_target:
        best = max((acc for _, _, acc in result.evals), default=None)
        seen = "never checked" if best is None else f"best {best:.2f}"
        on = ""
        if cfg.stop_bucket:
            on = f" (and {cfg.stop_bucket_at:.2f} on {cfg.stop_bucket}-step problems)"
        print(
            f"sft MISSED its target: validation accuracy never reached {cfg.stop_at:.2f}{on} in "
            f"{result.steps} steps ({seen}). Nothing was written to {args.out}; the "
            f"model is in {result.out} for a look. Try a longer budget (--steps) or another "
            "--seed.",
            file=sys.stderr,
        )
        return 2
    return 0


def parse_stop_at(flag: str | None, task_default: float | None) -> float | None:
    """``--stop-at ACC`` ('off': none), else the task's ``SFT_STOP_AT``."""
    if flag is None:
        return None if task_default is None else float(task_default)
    if flag.lower() in ("off", "none", "no"):
        return None
    try:
        value = float(flag)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        from laminar.runtime.errors import ConfigError

        raise ConfigError(f"--stop-at takes an accuracy in (0, 1] or 'off', not {flag!r}")
    return value


def parse_stop_bucket(
    flag: str | None, task_default: Any, stop_at: float | None
) -> tuple[str | None, float | None]:
    """``--stop-bucket STEPS=ACC`` ('off': none), else the task's ``SFT_STOP_BUCKET``, which goes
    with the task's stop: none when the run has no ``stop_at`` (a flag without one is refused
    by :class:`SftConfig`)."""
    from laminar.runtime.errors import ConfigError

    if flag is None:
        if task_default is None or stop_at is None:
            return None, None
        bucket, acc = task_default
        return str(bucket), float(acc)
    if flag.lower() in ("off", "none", "no"):
        return None, None
    bucket, _, acc = flag.partition("=")
    try:
        value = float(acc)
    except ValueError:
        value = -1.0
    if not bucket or not 0 < value <= 1:
        raise ConfigError(
            f"--stop-bucket takes STEPS=ACC (a chain-length bucket and an accuracy in (0, 1], "
            f"e.g. 5-8=0.3) or 'off', not {flag!r}"
        )
    return bucket, value


def cmd_eval(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from .evaluate import evaluate, render
    from .tasks import load_task
    from .ticker import Ticker

    task = load_task(args.task)
    # on stderr, so that --json's stdout stays one JSON document
    ticker = Ticker(lambda line: print(line, file=sys.stderr, flush=True))
    with ticker.during(f"eval: {args.model}"):
        result = evaluate(
            task,
            args.model,
            n=args.n,
            seed=args.seed,
            data=args.data,
            batch_size=args.batch_size,
            threads=args.threads,
        )
    print(json.dumps(asdict(result), indent=2) if args.json else render(result))
    return 0


def register(sub: Any) -> None:
    """Add ``model`` (``init``), ``sft`` and ``eval`` to ``laminar``'s sub-command parsers.

    Imports nothing heavy (the recipe modules import torch, transformers and tokenizers inside
    their functions). SFT flags left unset take ``SftConfig``'s defaults when the command runs.
    """
    from .model import ModelShape

    def task_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--task",
            default=DEFAULT_TASK,
            help="task module: path/to/task.py, a directory with task.py, or a module name "
            f"(default: {DEFAULT_TASK})",
        )

    def threads_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument("--threads", type=int, default=2, help="torch CPU threads (0 = default)")

    model = sub.add_parser("model", help="create task models (HF format)")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    init = model_sub.add_parser(
        "init", help="a small random Qwen2 model + char tokenizer (a chat task's: + its template)"
    )
    task_arg(init)
    init.add_argument("--out", required=True, help="model directory to write")
    shape = ModelShape()
    init.add_argument("--hidden", type=int, default=shape.hidden)
    init.add_argument("--layers", type=int, default=shape.layers)
    init.add_argument(
        "--heads", type=int, default=shape.heads, help="attention heads (hidden/heads: 32 or 64)"
    )
    init.add_argument("--kv-heads", type=int, default=shape.kv_heads)
    init.add_argument("--intermediate", type=int, default=shape.intermediate, help="MLP width")
    init.add_argument("--max-len", type=int, default=shape.max_len, help="max positions")
    init.add_argument("--tie-embeddings", action="store_true", help="tie input/output embeddings")
    init.add_argument("--seed", type=int, default=0)
    init.set_defaults(fn=cmd_model_init)

    sft = sub.add_parser("sft", help="supervised warm start on the task's demonstrations")
    task_arg(sft)
    sft.add_argument("--model", required=True, help="model directory to start from")
    sft.add_argument("--out", required=True, help="model directory to write (atomically)")
    budget = sft.add_argument_group(f"budget (default: --steps {DEFAULT_SFT_STEPS})")
    budget.add_argument("--minutes", type=float, help="train for this long (schedule by time)")
    budget.add_argument("--steps", type=int, help="train for this many steps")
    sft.add_argument("--batch-size", type=int, help="sequences per step (default 16)")
    sft.add_argument("--lr", type=float, help="peak learning rate")
    sft.add_argument("--warmup", type=float, help="warmup fraction of the budget")
    sft.add_argument("--seed", type=int, default=0)
    sft.add_argument(
        "--stop-at",
        metavar="ACC",
        help="stop once greedy accuracy on training-split problems reaches ACC (checked every "
        "100 steps, every 20 near it), so the warm start leaves RL room; 'off' to disable "
        "(default: the task's SFT_STOP_AT, if any)",
    )
    sft.add_argument(
        "--stop-bucket",
        metavar="STEPS=ACC",
        help="with --stop-at, also require accuracy ACC on problems of this chain-length bucket "
        "(e.g. 5-8=0.3: RL's frontier begun on); 'off' to disable (default: the task's "
        "SFT_STOP_BUCKET, if any)",
    )
    sft.add_argument(
        "--no-curriculum",
        action="store_true",
        help="draw from the task's own distribution from the first step (ignore SFT_CURRICULUM)",
    )
    sft.add_argument("--eval-every", type=int, help="steps between accuracy checks (default 100)")
    sft.add_argument(
        "--near-every",
        type=int,
        help="steps between checks once one reads within 0.15 of --stop-at (default 20; 0: "
        "every --eval-every)",
    )
    sft.add_argument(
        "--no-confirm",
        action="store_true",
        help="stop at the first check that reaches --stop-at (default: repeat it on as many other "
        "problems and stop if the two together reach it)",
    )
    sft.add_argument("--demos", help="JSONL of prompt/response rows (default: from the task)")
    threads_arg(sft)
    sft.set_defaults(fn=cmd_sft)

    ev = sub.add_parser("eval", help="greedy accuracy on held-out test records")
    task_arg(ev)
    ev.add_argument("--model", required=True, help="model directory")
    ev.add_argument("--n", type=int, default=500, help="number of test records")
    ev.add_argument("--seed", type=int, default=0, help="seed of the test records")
    ev.add_argument("--data", help="JSONL of test records instead of generating them")
    ev.add_argument("--batch-size", type=int, default=64)
    ev.add_argument("--json", action="store_true", help="print JSON")
    threads_arg(ev)
    ev.set_defaults(fn=cmd_eval)
