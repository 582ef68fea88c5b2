"""``laminar run`` (every role of a config on the local machine, after the ``doctor`` preflight),
``laminar doctor`` and ``laminar plot``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from laminar.runtime.config import LaminarConfig, load_config
from laminar.runtime.errors import ConfigError, LaminarError

from .common import add_set, loop_runner, make_console

#: what `laminar doctor` checks when no config is given (and it exists)
DEFAULT_EXAMPLE = "examples/arith/config.yaml"


def cmd_run(args: argparse.Namespace) -> int:
    overrides = list(args.set)
    if args.duration is not None:
        overrides.append(f"run.duration_s={args.duration}")
    config = load_config(args.config, overrides)
    if not args.skip_doctor and not _preflight(config):
        return 1
    resume = args.resume if args.resume is not None else False
    console = make_console()
    if args.launcher == "ray":  # Ray is imported only for this launcher
        from ..devmode.ray_launch import RaySupervisor

        return loop_runner(RaySupervisor(config, list(args.set), console, resume=resume).run())
    from ..devmode.supervisor import Supervisor

    return loop_runner(Supervisor(config, list(args.set), console, resume=resume).run())


def _preflight(config: LaminarConfig) -> bool:
    """``laminar doctor`` before a run: print its problems; False (refuse) on a blocker.
    A doctor that fails itself (not the config: that error is the run's too) is a warning: a
    preflight must never be the reason a run cannot start."""
    from ..doctor import blockers, doctor

    console = make_console()
    try:
        findings = doctor(config, "run", preflight=True)
    except LaminarError:
        raise  # an invalid config: `laminar run` reports it as the supervisor would
    except Exception as exc:
        console.print(
            f"doctor failed: {type(exc).__name__}: {exc}; starting anyway",
            style="yellow", markup=False,
        )  # fmt: skip
        return True
    for finding in findings:
        if finding.severity != "ok":
            style = "bold red" if finding.severity == "blocker" else "yellow"
            console.print(f"doctor | {finding.line()}", style=style, markup=False)
    stopped = blockers(findings)
    if stopped:
        names = ", ".join(dict.fromkeys(f.name for f in stopped))
        print(
            f"laminar run: refusing to start: {len(stopped)} blocker(s) ({names}); fix them, "
            "see `laminar doctor`, or pass --skip-doctor to start anyway",
            file=sys.stderr,
        )
    return not stopped


def cmd_doctor(args: argparse.Namespace) -> int:
    from ..doctor import blockers, doctor, findings_json, summary
    from ..doctor.findings import Mode

    path = args.config
    if path is None and Path(DEFAULT_EXAMPLE).is_file():
        path = DEFAULT_EXAMPLE
    machine_only = path is None and not args.set and not args.serve
    config = None if machine_only else load_config(path, args.set)
    mode: Mode = "serve" if args.serve else "run"
    findings = doctor(config, mode, args.serve)
    if args.json:
        print(json.dumps({"config": path, "mode": mode, **findings_json(findings, mode)}, indent=2))
        return 1 if blockers(findings) else 0
    console = make_console()
    purpose = f"laminar serve --role {', '.join(args.serve)}" if args.serve else "laminar run"
    what = f"{path or 'default config'} (for {purpose})"
    if machine_only:
        what = "this machine only (no config)"
    console.print(f"laminar doctor: {what}", style="bold", markup=False)
    styles = {"blocker": "bold red", "warning": "yellow", "ok": "green"}
    for finding in findings:
        console.print(finding.line(), style=styles[finding.severity], markup=False)
    console.print(summary(findings, mode), style="bold", markup=False)
    return 1 if blockers(findings) else 0


def cmd_plot(args: argparse.Namespace) -> int:
    from ..devmode.plots import plot_run

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: no such run directory")
    for path in plot_run(run_dir, args.trainer_metrics):
        print(path)
    return 0


def register(sub: Any) -> None:
    """``run``, ``doctor`` and ``plot``."""
    run = sub.add_parser("run", help="start every role of a config on this machine (dev mode)")
    run.add_argument("config", help="cluster config (YAML)")
    run.add_argument("--duration", type=float, help="stop after this many seconds")
    run.add_argument(
        "--resume",
        nargs="?",
        const=True,
        metavar="RUN_DIR",
        help="continue the run run.run_dir links to (or RUN_DIR): checkpoints, data, metrics",
    )
    run.add_argument(
        "--skip-doctor",
        action="store_true",
        help="start even when `laminar doctor` finds a blocker (it is not run at all)",
    )
    run.add_argument(
        "--launcher",
        choices=("local", "ray"),
        default="local",
        help="local: every role a child process of this one (default); ray: each role in a Ray "
        "actor, on the cluster RAY_ADDRESS names or a local one (docs/deploy.md)",
    )
    add_set(run)
    run.set_defaults(fn=cmd_run)

    doctor = sub.add_parser(
        "doctor",
        help="check this machine against what a config needs; exit 1 on a blocker",
    )
    doctor.add_argument(
        "config",
        nargs="?",
        help=f"cluster config (YAML); default: {DEFAULT_EXAMPLE} if it exists, else only the "
        "machine",
    )
    doctor.add_argument(
        "--serve",
        action="append",
        default=[],
        metavar="ROLE",
        help="check for `laminar serve --role ROLE` on this machine instead of `laminar run` "
        "(repeatable; the cluster token must then be set)",
    )
    doctor.add_argument("--json", action="store_true", help="print the findings as JSON")
    add_set(doctor)
    doctor.set_defaults(fn=cmd_doctor)

    plot = sub.add_parser("plot", help="draw a run directory's plots (PNG, in RUN_DIR/plots)")
    plot.add_argument("run_dir", nargs="?", default="runs/latest", help="default: runs/latest")
    plot.add_argument(
        "--trainer-metrics", help="the trainer's JSONL (default: RUN_DIR/trainer.jsonl)"
    )
    plot.set_defaults(fn=cmd_plot)
