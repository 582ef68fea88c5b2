"""Does RL improve the warm-started model, and by how much within the run's budget?

One invocation:

1. prepares the example task exactly as ``make run`` does (data, model init, the SFT warm start;
   reused when they already exist under ``runs/``);
2. measures ``acc_before``: greedy accuracy of the warm start on ``--n`` held-out problems;
3. runs the dev mode, ``laminar run examples/arith/config.yaml``, for ``--minutes`` (every role
   on this machine: manager, data, relay, trainer, 2 vLLM rollouts), in a fresh run directory;
4. measures ``acc_after``: the same held-out problems, greedy, with the last checkpoint the
   trainer wrote (it checkpoints every version before publishing it).

The goal (issue 6): ``acc_after - acc_before >= 0.15`` within 15 minutes on a 2-core machine.
Accuracy is measured outside the timed run, with the same code (``laminar eval``'s) for both
models, so the difference is RL's alone. ``max_staleness`` is the largest trainer version minus
generating version of any trajectory trained on.

    python benchmarks/learning.py --json runs/bench/learning.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from laminar.recipe.evaluate import evaluate  # noqa: E402
from laminar.recipe.tasks import load_task  # noqa: E402

CONFIG = ROOT / "examples" / "arith" / "config.yaml"


def laminar(*args: str) -> list[str]:
    return [sys.executable, "-m", "laminar", *args]


def prepare() -> Path:
    """The example's data and warm start (the Makefile's ``run`` prerequisites)."""
    subprocess.run(["make", "-s", "runs/arith/train.jsonl", "runs/models/arith-sft/config.json"],
                   cwd=ROOT, check=True)  # fmt: skip
    return ROOT / "runs" / "models" / "arith-sft"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--minutes",
        type=float,
        default=14.5,
        help="the RL run's budget (run.duration_s); start-up and shutdown come on top, and "
        "`minutes` in the JSON is the whole run's wall time",
    )
    ap.add_argument("--n", type=int, default=500, help="held-out problems (the test split)")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--set", action="append", default=[], help="config overrides for the run")
    args = ap.parse_args()

    sft = prepare()
    task = load_task(str(ROOT / "examples" / "arith"))
    before = evaluate(task, sft, n=args.n)
    print(
        f"acc_before {before.accuracy:.3f} ({before.n} held-out problems, {before.seconds:.0f} s)"
    )

    cmd = laminar("run", str(CONFIG), "--duration", str(60 * args.minutes),
                  "--set", "run.display=lines", "--set", "run.progress_interval_s=30")  # fmt: skip
    for item in args.set:
        cmd += ["--set", item]
    started = time.monotonic()
    subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    minutes = (time.monotonic() - started) / 60

    run_dir = (ROOT / "runs" / "latest").resolve()
    checkpoints = run_dir / "checkpoints"
    final = checkpoints / (checkpoints / "latest").read_text().strip()
    records = [json.loads(x) for x in (run_dir / "trainer.jsonl").read_text().splitlines()]
    versions = [r for r in records if not r.get("eval")]
    after = evaluate(task, final, n=args.n)
    result = {
        "acc_before": before.accuracy,
        "acc_after": after.accuracy,
        "gain": round(after.accuracy - before.accuracy, 3),
        "goal_gain": 0.15,
        "minutes": round(minutes, 2),
        "budget_minutes": args.minutes,
        "max_staleness": max((int(v["staleness_max"]) for v in versions), default=0),
        "versions": len(versions),
        "trained_tokens": sum(int(v["tokens"]) for v in versions),
        "n_heldout": after.n,
        "buckets_before": before.buckets,
        "buckets_after": after.buckets,
        "checkpoint": str(final),
        "run_dir": str(run_dir),
        "in_run_evals": [
            {k: r[k] for k in ("version", "time", "accuracy", "n")}
            for r in records
            if r.get("eval")
        ],
    }
    print(
        f"acc_before {result['acc_before']:.3f}  acc_after {result['acc_after']:.3f}  "
        f"gain {result['gain']:+.3f} (goal +0.15)  in {minutes:.1f} min  "
        f"versions {len(versions)}  max_staleness {result['max_staleness']}"
    )
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
