"""Greedy held-out evaluation: transformers' ``sdpa`` attention against the key/value heads left
grouped (:mod:`laminar.recipe.attention`).

Both sides run the same evaluation in this process (``laminar.recipe.evaluate.evaluate_model``:
the trainer's in-run evaluation, ``laminar eval`` and SFT's stop checks) on the same model, the
same ``--n`` held-out problems, ``--batch-size`` at a time, on ``--threads`` torch threads:

* ``sdpa`` (the baseline): the model's own attention, which copies the keys and values out to
  one head per query head at every decoding step of a masked batch;
* ``grouped``: :func:`~laminar.recipe.attention.fast_attention`, as evaluation now decodes.

The figure is the evaluation's CPU seconds (this process's: one thread does the work);
``speedup = sdpa / grouped``, the median of ``--pairs`` alternating pairs
(``benchmarks/pairs.py``), after ``--warmup`` untimed runs of each side (the baseline's first
runs here took 41, then 29, then 24 s: its large copies are slower while the allocator grows).
The two sides must give the same accuracy and the same responses.

The model is ``--model`` (default the example's warm start, ``runs/models/arith-sft``, made by
``make run``); without one, an untrained model of the example's shape, which writes every response
to its budget.

    python benchmarks/evaluation.py --json runs/bench/evaluation.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import pairs  # noqa: E402  (benchmarks/pairs.py)

from laminar.recipe import episodes, evaluate  # noqa: E402
from laminar.recipe.attention import fast_attention  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--task", default=str(ROOT / "examples" / "arith"))
    ap.add_argument("--model", default=str(ROOT / "runs" / "models" / "arith-sft"))
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs of each side first")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import torch

    from laminar.recipe.model import ModelShape, init_model, load_model
    from laminar.recipe.tasks import load_task

    torch.set_num_threads(args.threads)
    task = load_task(args.task)
    model_dir = Path(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        if not (model_dir / "config.json").is_file():
            print(f"no model at {model_dir}: an untrained one of the example's shape")
            model_dir = init_model(task.alphabet, Path(tmp) / "init", ModelShape(), seed=0)
        model, tok = load_model(str(model_dir))
        records = evaluate.eval_records(task, args.n, 0)
        results: dict[str, list[Any]] = {"sdpa": [], "grouped": []}

        def run(side: str) -> float:
            # the baseline: the evaluation's own call sites, with the switch made a no-op
            switch = fast_attention if side == "grouped" else _unchanged
            evaluate.fast_attention = episodes.fast_attention = switch  # type: ignore[assignment]
            start = time.process_time()
            result = evaluate.evaluate_model(task, model, tok, records, args.batch_size)
            seconds = time.process_time() - start
            results[side].append((result.accuracy, result.response_length))
            print(f"{side:8s} {seconds:7.2f} CPU-s  accuracy {result.accuracy:.3f}", flush=True)
            return seconds

        for _ in range(args.warmup):  # the allocator's first large copies, not the method
            run("sdpa"), run("grouped")
        for side in results.values():
            side.clear()
        summary = pairs.alternate(
            lambda: run("sdpa"), lambda: run("grouped"), pairs=args.pairs, higher_is_better=False
        )
        evaluate.fast_attention = episodes.fast_attention = fast_attention  # type: ignore[assignment]
    same = all(r == results["sdpa"][0] for side in results.values() for r in side)
    out = {
        "model": str(model_dir),
        "n": args.n,
        "batch_size": args.batch_size,
        "threads": args.threads,
        "same_accuracy_and_lengths": same,
        "speedup": summary["ratio_median"],
        **summary,
    }
    print(
        f"speedup (sdpa / grouped CPU-s) {summary['ratio_median']:.2f} "
        f"(pairs {min(summary['ratios']):.2f}-{max(summary['ratios']):.2f}); "
        f"same results: {same}"
    )
    print(json.dumps(out))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))
    if not same:
        raise SystemExit("the two sides gave different results")


def _unchanged(model: Any) -> contextlib.nullcontext[None]:
    return contextlib.nullcontext()


if __name__ == "__main__":
    main()
