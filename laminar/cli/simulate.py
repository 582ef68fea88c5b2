"""``laminar simulate``: the paper's scale on cost models, or a cluster config on virtual time, in
one process (:mod:`laminar.simulate`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from laminar.runtime.config import load_config


def counts(text: str) -> list[int]:
    """An argparse type: comma-separated positive counts (``2,4``); anything else is a usage
    error naming the value, not a traceback."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated whole numbers: {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"counts must be at least 1: {text!r}")
    return values


def cmd_simulate(args: argparse.Namespace) -> int:
    from ..simulate.cells import run_cell
    from ..simulate.sweep import describe, plot, sweep

    if args.simulate_command == "run":
        return _simulate_run(args)
    if args.simulate_command == "rollmux":
        return _simulate_rollmux(args)
    if args.simulate_command == "cell":
        cell = run_cell(args.system, args.model, args.gpus, seed=args.seed)
        print(json.dumps(cell.__dict__, indent=2))
        return 0
    models = tuple(args.models.split(","))
    systems = tuple(args.systems.split(","))
    only = tuple(args.gpus) if args.gpus else None
    result = sweep(
        models, systems, seed=args.seed, warmup=args.warmup, measured=args.measured, gpus_only=only
    )
    for line in describe(result):
        print(line)
    print(f"{result['wall_s']:.0f} s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.plot:
        print(plot(result, args.plot))
    return 0


def _simulate_run(args: argparse.Namespace) -> int:
    from laminar.runtime.log import configure_logging

    from ..simulate.cluster import describe_runs, plan

    config = load_config(args.config, args.set)
    # every member logs in this one process; members stopping at the end warn of peers gone
    configure_logging(role="simulate", instance="simulate", level=args.log_level)
    duration = args.duration or config.run.duration_s or 120.0
    rows = plan(
        config,
        rollouts=args.rollouts,
        schedules=args.schedules.split(",") if args.schedules else None,
        duration_s=duration,
        warmup_s=args.warmup,
        seed=args.seed,
    )
    for line in describe_runs(rows):
        print(line)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


def _simulate_rollmux(args: argparse.Namespace) -> int:
    from ..simulate.cells import run_cell
    from ..simulate.multiplex import run_multiplexed
    from ..simulate.workload import SCALES

    scales = [args.gpus] if args.gpus else SCALES[args.model]
    print(
        f"{'GPUs':>5}  {'one job':>9}  {'two jobs (RollMux)':>18}  {'gain':>5}  "
        f"{'laminar, one job':>16}   tokens/s x1e5, same GPUs"
    )
    rows = []
    for gpus in scales:
        mux = run_multiplexed(args.model, gpus, seed=args.seed)
        lam = run_cell("laminar", args.model, gpus, seed=args.seed).tokens_per_s
        rows.append({**mux.__dict__, "laminar_tokens_per_s": lam})
        print(
            f"{gpus:>5}  {mux.solo_tokens_per_s / 1e5:>9.2f}  "
            f"{mux.multiplexed_tokens_per_s / 1e5:>18.2f}  {mux.efficiency_gain:>5.2f}  "
            f"{lam / 1e5:>16.2f}"
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


def register(sub: Any) -> None:
    """``simulate sweep``, ``cell``, ``rollmux`` and ``run``."""
    simulate = sub.add_parser(
        "simulate", help="the paper's scale on cost models, one process (laminar/simulate)"
    )
    simulate_sub = simulate.add_subparsers(dest="simulate_command", required=True)
    sweep = simulate_sub.add_parser("sweep", help="every system at every scale (Fig. 11)")
    sweep.add_argument("--json", help="write the figures here")
    sweep.add_argument("--plot", help="draw the Fig. 11-style figure here (PNG)")
    sweep.add_argument("--models", default="7B,32B,72B")
    sweep.add_argument("--systems", default="verl,one_step,stream,areal,rollpacker,laminar")
    sweep.add_argument(
        "--gpus",
        type=counts,
        help="only these of each model's Table 2 scales, comma-separated (e.g. 16,256)",
    )
    sweep.add_argument("--warmup", type=int, default=2, help="updates run before measuring")
    sweep.add_argument("--measured", type=int, default=4, help="updates averaged per cell")
    sweep.add_argument("--seed", type=int, default=0)
    cell = simulate_sub.add_parser("cell", help="one system, model and GPU count")
    cell.add_argument("--system", required=True)
    cell.add_argument("--model", required=True, help="7B, 32B or 72B")
    cell.add_argument("--gpus", type=int, required=True, help="a Table 2 scale")
    cell.add_argument("--seed", type=int, default=0)
    mux = simulate_sub.add_parser(
        "rollmux",
        help="two synchronous jobs sharing one pair of pools (RollMux) vs one job, vs Laminar",
    )
    mux.add_argument("--model", default="7B", help="7B, 32B or 72B")
    mux.add_argument("--gpus", type=int, help="a Table 2 scale (default: every scale)")
    mux.add_argument("--seed", type=int, default=0)
    mux.add_argument("--json", help="write one row per scale here")
    run = simulate_sub.add_parser(
        "run",
        help="your cluster config: every role's real code in one process, on virtual time",
        description="Run the config's run.roles (sim rollouts, sim_trainer) in one process on "
        "virtual time and print trained tokens/s, how busy the trainer is, rollout and KV use "
        "and staleness; --rollouts and --schedules make a table of one run per combination.",
    )
    run.add_argument("--config", required=True, help="a cluster YAML (as for laminar run)")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    run.add_argument(
        "--rollouts", type=counts, help="comma-separated rollout counts (default: the config's)"
    )
    run.add_argument("--schedules", help="comma-separated cluster.schedule.kind values")
    run.add_argument(
        "--duration", type=float, help="virtual seconds measured (default: run.duration_s, or 120)"
    )
    run.add_argument("--warmup", type=float, default=30.0, help="virtual seconds before measuring")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--json", help="write one row per run here")
    run.add_argument(
        "--log-level",
        default="error",
        choices=("debug", "info", "warning", "error"),
        help="the members' log level (all log to this process's stderr)",
    )
    simulate.set_defaults(fn=cmd_simulate)
