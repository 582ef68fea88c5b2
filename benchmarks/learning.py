"""Does RL improve the warm-started model, and by how much within the run's budget, on any seed?

One invocation, for each seed in ``--seeds``:

1. prepares the example task as ``make run`` does, with that seed: the data (shared by all
   seeds), ``laminar model init --seed S`` and the SFT warm start ``laminar sft --seed S``, cached
   under ``runs/bench/learning/seed<S>/`` (``learning-tool/`` for arith_tool; a warm start that
   misses its target is reported in ``sft_missed`` and not trained on; the means are over the
   other seeds);
2. measures ``acc_before``: greedy accuracy of the warm start on ``--n`` held-out problems;
3. runs the dev mode, ``laminar run examples/arith/config.yaml``, for ``--minutes`` (every role
   on this machine: manager, data, relay, trainer, 2 vLLM rollouts) on that warm start, with the
   trainer's seed set to S, in a fresh run directory;
4. measures ``acc_after``: the same held-out problems, greedy, with the last checkpoint the
   trainer wrote (it checkpoints every version before publishing it).

The goal (issue 14): the mean of ``acc_after - acc_before`` over the seeds is >= 0.15 within 15
minutes on a 2-core machine. Accuracy is measured outside the timed run, with the same code
(``laminar eval``'s) for both models, so the difference is RL's alone. ``max_staleness`` is the
largest trainer version minus generating version of any trajectory trained on.

    python benchmarks/learning.py --json runs/bench/learning.json --seeds 0 1 2

``--sft-stop-at ACC`` / ``--sft-stop-bucket STEPS=ACC`` make the warm starts with those ``laminar
sft`` flags instead of the task's defaults (a warm start cached for another stop is kept beside,
renamed, and made again).

``--example arith_tool`` measures the agentic example instead (``examples/arith_tool``: multi-turn
episodes with a calculator, ``make run-tool``'s preparation); its figures add the greedy tool
calls per episode before and after (``tool_calls_before`` / ``tool_calls_after``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from laminar.recipe.cli import parse_stop_at, parse_stop_bucket  # noqa: E402
from laminar.recipe.evaluate import evaluate  # noqa: E402
from laminar.recipe.sft import SftConfig  # noqa: E402
from laminar.recipe.tasks import load_task  # noqa: E402

GOAL = 0.15
#: example -> (its data's Makefile target, where its seeds' warm starts are cached)
EXAMPLES = {
    "arith": ("runs/arith/train.jsonl", ROOT / "runs" / "bench" / "learning"),
    "arith_tool": ("runs/arith_tool/train.jsonl", ROOT / "runs" / "bench" / "learning-tool"),
}


def laminar(*args: str) -> list[str]:
    return [sys.executable, "-m", "laminar", *args]


def warm_start(
    seed: int, example: str, stop_at: str | None = None, stop_bucket: str | None = None
) -> tuple[Path | None, dict[str, Any]]:
    """The data (the Makefile's rule) and this seed's initial model and SFT warm start: stopped
    by the task's ``SFT_STOP_AT`` (and ``SFT_STOP_BUCKET``), or by ``laminar sft``'s
    ``--stop-at`` / ``--stop-bucket`` given here."""
    target, cache = EXAMPLES[example]
    subprocess.run(["make", "-s", target], cwd=ROOT, check=True)
    base = cache / f"seed{seed}"
    init, sft = base / "init", base / "sft"
    task = f"examples/{example}"
    if not (init / "config.json").is_file():
        subprocess.run(laminar("model", "init", "--task", task, "--out", str(init),
                               "--seed", str(seed)), cwd=ROOT, check=True)  # fmt: skip
    target_stop = _target_stop(load_task(str(ROOT / task)).module, stop_at, stop_bucket)
    cached_stop = _stop(sft) if (sft / "config.json").is_file() else target_stop
    if cached_stop != target_stop:
        # cached for another stop: kept beside, and the warm start made again
        label = "-".join(str(x) for x in cached_stop if x is not None)
        sft.rename(base / f"sft.stop{label}.{int(time.time())}")
    if not (sft / "config.json").is_file():
        started = time.monotonic()
        sft_cmd = laminar("sft", "--task", task, "--model", str(init),
                          "--out", str(sft), "--seed", str(seed))  # fmt: skip
        if stop_at is not None:
            sft_cmd += ["--stop-at", stop_at]
        if stop_bucket is not None:
            sft_cmd += ["--stop-bucket", stop_bucket]
        done = subprocess.run(sft_cmd, cwd=ROOT)
        if done.returncode != 0:
            return None, {"missed": True, "seconds": time.monotonic() - started}
        print(f"seed {seed}: warm start in {time.monotonic() - started:.0f} s")
    return sft, json.loads((sft / "sft.json").read_text())


#: stop_at, stop_bucket, stop_bucket_at, bucket_every (the last three None without a bucket), and
#: the landing: near_every, confirm (0 and False for a warm start made before there was one)
Stop = tuple[float | None, str | None, float | None, int | None, int, bool]


def _stop(sft: Path) -> Stop:
    """What stopped a cached warm start (its ``sft.json``)."""
    config = json.loads((sft / "sft.json").read_text())["config"]
    bucket = config.get("stop_bucket")
    every = config.get("bucket_every") if bucket is not None else None
    landing = config.get("near_every", 0), config.get("confirm", False)
    return config.get("stop_at"), bucket, config.get("stop_bucket_at"), every, *landing


def _target_stop(module: Any, stop_at: str | None, stop_bucket: str | None) -> Stop:
    """What ``laminar sft`` will stop on: the flags given here, else the task's defaults."""
    acc = parse_stop_at(stop_at, getattr(module, "SFT_STOP_AT", None))
    bucket, bucket_acc = parse_stop_bucket(
        stop_bucket, getattr(module, "SFT_STOP_BUCKET", None), acc
    )
    landing = SftConfig().near_every, SftConfig().confirm
    if bucket is None:
        return acc, None, None, None, *landing
    return acc, bucket, bucket_acc, SftConfig().bucket_every, *landing


def one_seed(seed: int, args: argparse.Namespace) -> dict[str, Any]:
    task = load_task(str(ROOT / "examples" / args.example))
    sft, sft_summary = warm_start(seed, args.example, args.sft_stop_at, args.sft_stop_bucket)
    if sft is None:
        print(f"seed {seed}: the SFT warm start missed its target; no RL run on it")
        return {"seed": seed, "sft_missed": True}
    before = evaluate(task, sft, n=args.n)
    print(f"seed {seed}: acc_before {before.accuracy:.3f} ({before.n} held-out problems)")
    config = ROOT / "examples" / args.example / "config.yaml"
    cmd = laminar("run", str(config), "--duration", str(60 * args.minutes),
                  "--set", "run.display=lines", "--set", "run.progress_interval_s=30",
                  "--set", f"trainer.model={sft}", "--set", f"rollout.engine.model={sft}",
                  "--set", f"data.tokenizer={sft}", "--set", f"trainer.seed={seed}")  # fmt: skip
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
        "seed": seed,
        "acc_before": before.accuracy,
        "acc_after": after.accuracy,
        "gain": round(after.accuracy - before.accuracy, 3),
        "minutes": round(minutes, 2),
        "sft_steps": sft_summary["steps"],
        "sft_stop": list(_stop(sft)),
        "sft_seconds": sft_summary["seconds"],
        "max_staleness": max((int(v["staleness_max"]) for v in versions), default=0),
        "versions": len(versions),
        "trained_tokens": sum(int(v["tokens"]) for v in versions),
        "tool_calls_before": before.tool_calls,
        "tool_calls_after": after.tool_calls,
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
        f"seed {seed}: acc_before {result['acc_before']:.3f}  acc_after "
        f"{result['acc_after']:.3f}  gain {result['gain']:+.3f}  in {minutes:.1f} min  "
        f"versions {len(versions)}  max_staleness {result['max_staleness']}"
    )
    return result


def spread(values: list[float]) -> dict[str, float]:
    return {
        "min": round(min(values), 3),
        "max": round(max(values), 3),
        "stdev": round(statistics.stdev(values), 3) if len(values) > 1 else 0.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="one run each")
    ap.add_argument("--example", choices=sorted(EXAMPLES), default="arith", help="which task")
    ap.add_argument(
        "--minutes",
        type=float,
        default=14.5,
        help="each RL run's budget (run.duration_s); start-up and shutdown come on top, and "
        "`minutes` in the JSON is the mean whole run's wall time",
    )
    ap.add_argument("--n", type=int, default=500, help="held-out problems (the test split)")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--set", action="append", default=[], help="config overrides for the runs")
    ap.add_argument("--sft-stop-at", metavar="ACC", help="the warm starts' `laminar sft --stop-at`")
    ap.add_argument(
        "--sft-stop-bucket", metavar="STEPS=ACC", help="`laminar sft --stop-bucket` for the seeds"
    )
    args = ap.parse_args()

    per_seed = [one_seed(seed, args) for seed in args.seeds]
    ran = [r for r in per_seed if not r.get("sft_missed")]
    if not ran:
        raise SystemExit("every seed's warm start missed its target: nothing to measure")
    gains = [r["gain"] for r in ran]
    result = {
        "acc_before": round(statistics.mean(r["acc_before"] for r in ran), 3),
        "acc_after": round(statistics.mean(r["acc_after"] for r in ran), 3),
        "gain": round(statistics.mean(gains), 3),
        "gain_spread": spread(gains),
        "goal_gain": GOAL,
        "sft_missed": [r["seed"] for r in per_seed if r.get("sft_missed")],
        "minutes": round(statistics.mean(r["minutes"] for r in ran), 2),
        "budget_minutes": args.minutes,
        "n_heldout": args.n,
        "seeds": args.seeds,
        "example": args.example,
        "per_seed": per_seed,
    }
    print(
        f"mean over seeds {args.seeds}: acc_before {result['acc_before']:.3f}  acc_after "
        f"{result['acc_after']:.3f}  gain {result['gain']:+.3f} (goal +{GOAL}; per seed "
        f"{', '.join(f'{g:+.3f}' for g in gains)})  {result['minutes']:.1f} min per run"
    )
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
