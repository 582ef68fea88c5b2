"""Does trajectory-level asynchrony reach the synchronous run's accuracy sooner, in wall-clock time?

The paper's learning claim (its Fig. 13): on the same task, model and hardware, Laminar reaches
the accuracy the synchronous baseline ends at in less wall-clock time, and ends no lower. Here,
for each seed in ``--seeds`` and each schedule in ``--schedules`` (``laminar``, ``sync``,
``one_step``; ``cluster.schedule.kind``):

1. the example's warm start for that seed, made (and cached) as ``benchmarks/learning.py`` makes
   it, and its greedy held-out accuracy: every curve's point at time 0;
2. ``laminar run`` of the example for ``--minutes`` with that schedule and seed: real vLLM
   rollouts, the real trainer, its greedy held-out accuracy on ``--n`` problems every
   ``--eval-every-s`` seconds (the trainer's own evaluation, written to its metrics file);
3. the last checkpoint's accuracy, measured after the run with the same code.

Reported per seed: each schedule's curve (seconds since the run began -> accuracy, and the mean
reward of each version), ``sync_final`` (the last accuracy of the ``sync`` run),
``time_to_sync_final_s`` per schedule (the first evaluation at or above it; None if never), and
``speedup_vs_sync`` (sync's time over the schedule's). Over seeds: the median and spread of the
speed-ups and the mean final accuracies. The goal: ``laminar`` at sync's final accuracy in at most
1/1.77 of sync's time, and a final accuracy not lower.

Fairness: every run gets the same machine, the same roles (two vLLM rollouts and one trainer)
and the same placement (``run.cpus=auto``: the cores divided between rollouts and trainer). A
colocated synchronous system would give each phase every core in turn; on CPU that cannot be
emulated, since vLLM's CPU engines keep their threads spinning between steps and a trainer
sharing their cores (``--sync-cpus off``) is starved rather than helped.
Every schedule trains on every complete group (``data.drop_constant_groups=false``, whatever the
example's config says): a round schedule cannot drop groups after its round ends (the trainer
would wait for a batch no round fills), and the comparison keeps one data pipeline for all.
The order of the schedules rotates from seed to seed, so no schedule always runs first (on a cold
page cache) or last.

    python benchmarks/convergence.py --json runs/bench/convergence.json --seeds 0 1 2
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

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from learning import EXAMPLES, laminar, spread, warm_start  # noqa: E402

from laminar.recipe.evaluate import evaluate  # noqa: E402
from laminar.recipe.tasks import load_task  # noqa: E402

GOAL_SPEEDUP = 1.77
SCHEDULES = ("laminar", "sync", "one_step")


def run_schedule(schedule: str, seed: int, sft: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One timed run: its in-run evaluations as a curve, and its last checkpoint's accuracy."""
    config = ROOT / "examples" / args.example / "config.yaml"
    cpus = args.sync_cpus if schedule != "laminar" else "auto"
    cmd = laminar("run", str(config), "--duration", str(60 * args.minutes),
                  "--set", "run.display=lines", "--set", "run.progress_interval_s=30",
                  "--set", f"run.cpus='{cpus}'",  # quoted: YAML reads a bare off as false
                  "--set", f"cluster.schedule.kind={schedule}",
                  "--set", f"trainer.model={sft}", "--set", f"rollout.engine.model={sft}",
                  "--set", f"data.tokenizer={sft}", "--set", f"trainer.seed={seed}",
                  "--set", f"trainer.eval.n={args.n}",
                  "--set", f"trainer.eval.every_s={args.eval_every_s}",
                  "--set", "data.drop_constant_groups=false")  # fmt: skip
    if schedule != "laminar":  # a round is one global batch
        cmd += ["--set", f"cluster.schedule.round_prompts={round_prompts(config)}"]
    for item in args.set:
        cmd += ["--set", item]
    began = time.time()
    subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    run_dir = (ROOT / "runs" / "latest").resolve()
    records = [json.loads(x) for x in (run_dir / "trainer.jsonl").read_text().splitlines()]
    versions = [r for r in records if not r.get("eval")]
    start = min([r["time"] - r.get("train_s", 0.0) for r in versions[:1]] + [began])
    evals = [
        {"t": round(r["time"] - start, 1), "version": r["version"], "accuracy": r["accuracy"]}
        for r in records
        if r.get("eval")
    ]
    checkpoints = run_dir / "checkpoints"
    final = checkpoints / (checkpoints / "latest").read_text().strip()
    task = load_task(str(ROOT / "examples" / args.example))
    return {
        "schedule": schedule,
        "cpus": cpus,
        "evals": evals,
        "rewards": [
            {
                "t": round(v["time"] - start, 1),
                "version": v["version"],
                "reward": v.get("reward_generated", v.get("reward_mean")),
            }
            for v in versions
        ],
        "versions": len(versions),
        "final_accuracy": evaluate(task, final, n=args.n).accuracy,
        "run_dir": str(run_dir),
    }


def round_prompts(config: Path) -> int:
    """The example's global batch in prompt groups (``trainer.batch.prompts``)."""
    return int(yaml.safe_load(config.read_text())["trainer"]["batch"]["prompts"])


def time_to(curve: list[dict[str, Any]], target: float) -> float | None:
    """Seconds until the first evaluation at or above ``target`` (None: never reached)."""
    return next((point["t"] for point in curve if point["accuracy"] >= target), None)


def one_seed(seed: int, order: list[str], args: argparse.Namespace) -> dict[str, Any]:
    sft, _ = warm_start(seed, args.example)
    if sft is None:
        return {"seed": seed, "sft_missed": True}
    task = load_task(str(ROOT / "examples" / args.example))
    before = evaluate(task, sft, n=args.n).accuracy
    runs = {schedule: run_schedule(schedule, seed, sft, args) for schedule in order}
    for run in runs.values():
        run["evals"].insert(0, {"t": 0.0, "version": 0, "accuracy": before})
    result: dict[str, Any] = {"seed": seed, "order": order, "acc_before": before, "runs": runs}
    if "sync" in runs:
        target = runs["sync"]["evals"][-1]["accuracy"]
        times = {s: time_to(r["evals"], target) for s, r in runs.items()}
        result["sync_final"] = target
        result["time_to_sync_final_s"] = times
        sync_time = times["sync"]
        result["speedup_vs_sync"] = {
            s: (round(sync_time / t, 3) if sync_time and t else None) for s, t in times.items()
        }
    print(f"seed {seed}: " + json.dumps({k: result.get(k) for k in ("sync_final",
          "time_to_sync_final_s", "speedup_vs_sync")}))  # fmt: skip
    return result


def plot(summary: dict[str, Any], path: Path) -> None:
    """Held-out accuracy against wall-clock, one panel per seed, one line per schedule; a cross
    at the run's end marks its last checkpoint's accuracy, measured after the run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = [r for r in summary["per_seed"] if not r.get("sft_missed")]
    fig, axes = plt.subplots(1, len(seeds), figsize=(5.5 * len(seeds), 3.6), squeeze=False)
    for ax, result in zip(axes[0], seeds, strict=True):
        for schedule, run in result["runs"].items():
            ts = [p["t"] / 60 for p in run["evals"]]
            (line,) = ax.plot(ts, [p["accuracy"] for p in run["evals"]], marker="o", label=schedule)
            end = max([ts[-1]] + [p["t"] / 60 for p in run["rewards"]])
            colour = line.get_color()
            ax.plot([end], [run["final_accuracy"]], marker="x", markersize=9, color=colour)
        if "sync_final" in result:
            ax.axhline(result["sync_final"], color="grey", linestyle=":", label="sync's final")
        ax.set_title(f"seed {result['seed']}")
        ax.set_xlabel("minutes")
        ax.set_ylabel("held-out accuracy")
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    ap.add_argument("--example", choices=sorted(EXAMPLES), default="arith")
    ap.add_argument("--minutes", type=float, default=10.0, help="each run's budget")
    ap.add_argument("--n", type=int, default=200, help="held-out problems per evaluation")
    ap.add_argument("--eval-every-s", type=float, default=60.0, help="in-run evaluation period")
    ap.add_argument(
        "--sync-cpus",
        choices=("off", "auto"),
        default="auto",
        help="run.cpus for sync and one_step (off: nothing pinned; the engines' spinning "
        "threads then starve the trainer)",
    )
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--plot", help="draw the curves here (PNG)")
    ap.add_argument("--replot", metavar="JSON", help="only draw --plot from an earlier --json")
    ap.add_argument("--set", action="append", default=[], help="config overrides for every run")
    args = ap.parse_args()
    if args.replot:
        if not args.plot:
            ap.error("--replot needs --plot")
        plot(json.loads(Path(args.replot).read_text()), Path(args.plot))
        return

    per_seed = []
    for i, seed in enumerate(args.seeds):
        order = (
            args.schedules[i % len(args.schedules) :] + args.schedules[: i % len(args.schedules)]
        )
        per_seed.append(one_seed(seed, order, args))
    ran = [r for r in per_seed if not r.get("sft_missed")]
    summary: dict[str, Any] = {"goal_speedup": GOAL_SPEEDUP, "example": args.example,
                               "minutes": args.minutes, "n_heldout": args.n,
                               "seeds": args.seeds, "per_seed": per_seed}  # fmt: skip
    for schedule in args.schedules:
        finals = [r["runs"][schedule]["final_accuracy"] for r in ran]
        summary.setdefault("final_accuracy", {})[schedule] = round(statistics.mean(finals), 3)
        speedups = [s for r in ran if (s := r.get("speedup_vs_sync", {}).get(schedule)) is not None]
        if speedups:
            summary.setdefault("speedup_vs_sync", {})[schedule] = {
                "median": round(statistics.median(speedups), 3),
                **spread(speedups),
                "seeds_reaching": len(speedups),
            }
        times = [
            t for r in ran if (t := r.get("time_to_sync_final_s", {}).get(schedule)) is not None
        ]
        if times:
            summary.setdefault("time_to_sync_final_s", {})[schedule] = round(
                statistics.median(times), 1
            )
    print(json.dumps({k: summary.get(k) for k in ("final_accuracy", "time_to_sync_final_s",
                                                  "speedup_vs_sync")}, indent=2))  # fmt: skip
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(summary, indent=2))
    if args.plot:
        plot(summary, Path(args.plot))


if __name__ == "__main__":
    main()
