"""The ``laminar`` command: ``serve`` one role, ``run`` a config on this machine (after the
``doctor`` preflight), ``status``, ``repack`` (through the manager's admin HTTP API), ``plot`` a
run directory."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from rich.console import Console

from .config import ConfigError, LaminarConfig, load_config
from .errors import LaminarError

if TYPE_CHECKING:
    from .devmode.status import AdminClient
    from .loopwatch import LoopWatch

#: what `laminar doctor` checks when no config is given (and it exists)
DEFAULT_EXAMPLE = "examples/arith/config.yaml"


def _loop_runner(coro: object) -> int:
    import uvloop

    return uvloop.run(coro)  # type: ignore[arg-type]


def _console() -> Console:
    # Piped output (CI, log files) gets wide lines instead of rich's default 80 columns.
    return Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 160)


def cmd_serve(args: argparse.Namespace) -> int:
    from .log import configure_logging
    from .proc.placement import give_way, keep_off_bound_cores, niceness_for
    from .roles_registry import load_role
    from .service import ServiceContext, ServiceHost, print_ready, transport_options

    config = load_config(args.config, args.set)
    base = Path(config.source).parent if config.source else None
    role_cls = load_role(args.role, base)
    section = args.section or role_cls.role
    role_config = config.role_config(section, role_cls.config_model)
    if args.bind:
        role_config.bind = args.bind
    instance = (
        args.instance or role_config.instance or f"{section}-{socket.gethostname()}-{os.getpid()}"
    )
    cluster = config.cluster
    manager = args.join or cluster.manager
    if role_cls.role == "manager" or args.standalone:
        manager = None
    elif manager is None:
        raise ConfigError(
            f"role {section} needs the manager's address: --join tcp://HOST:PORT "
            "(or --standalone to serve without joining a cluster)"
        )
    configure_logging(
        role=section, instance=instance, fmt=cluster.log_format, level=cluster.log_level
    )
    ctx = ServiceContext(
        role=section,
        instance=instance,
        cluster=cluster,
        config=role_config,
        options=transport_options(cluster, cluster.token()),
    )
    watches: list[LoopWatch] = []

    def ready(info: dict[str, Any]) -> None:
        # Once on_start has run, so the engine processes a rollout started there keep their
        # priority and their cores (laminar.proc.placement); not for the trainer.
        if not role_cls.computes:
            placed = keep_off_bound_cores()
            nice = niceness_for(
                cluster.nice,
                computes=role_cls.computes,
                feeds_engine=role_cls.feeds_engine,
                placed=placed,
            )
            if nice:
                give_way(nice)
            ctx.log.info("placed", nice=nice, cores=list(placed.cores) or "unchanged")
        if cluster.loop_stall_s is not None:  # from now: on_start may block the loop on purpose
            # and not once stopping: on_stop may too (vLLM's shutdown joins its processes)
            watches.append(watch_loop(ctx.log, cluster.loop_stall_s, lambda: host.stopping))
        print_ready(info)

    host = ServiceHost(role_cls, ctx, manager=manager, ready=ready, handle_signals=True)
    try:
        _loop_runner(host.run())
    finally:
        for watch in watches:
            watch.close()
    exit_without_final_collection(0)


def exit_without_final_collection(code: int) -> NoReturn:
    """End this process as the interpreter would, minus its final garbage collection and module
    teardown: join the non-daemon threads (an executor's running call finishes), run the atexit
    handlers, flush the standard streams, ``os._exit``.

    Why: a stopped role's work is done, and what is left of its exit is freeing what its imports
    made. Measured here, the interpreter's exit took 3.8 s after importing the rollout's modules
    (vLLM) and 2.1 s after the trainer's (torch, transformers), against 0.2 s for the CLI alone:
    seconds of every ``laminar run`` stop, restart and test teardown, counted against the
    role's stop grace. Only after a clean stop: a crash takes the interpreter's ordinary path,
    with its traceback."""
    import atexit
    import threading

    threading._shutdown()  # type: ignore[attr-defined]  # what Py_FinalizeEx does first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def watch_loop(log: Any, threshold_s: float, stopping: Callable[[], bool]) -> LoopWatch:
    """Start a :class:`LoopWatch` on the running loop that logs each stall to ``log``, but for
    those seen once ``stopping()`` is true."""
    from .loopwatch import LoopWatch, Stall

    def say(stall: Stall) -> None:
        if stopping():
            return
        if stall.ended:
            log.warning("event loop turns again", blocked_s=round(stall.seconds, 2), at=stall.where)
        elif stall.idle:
            log.warning(
                "event loop blocked: no Python code of the role holds it (this process waited "
                "for a CPU, or a call without Python frames, such as a C callback, runs on it)",
                blocked_s=round(stall.seconds, 2),
                at=stall.where,
            )
        else:
            log.warning(
                "event loop blocked: code on it does not yield (see `at`); nothing else this "
                "role does (heartbeats, calls) runs until it does",
                blocked_s=round(stall.seconds, 2),
                at=stall.where,
                frames=stall.stack,  # not `stack`: structlog's renderers take that for a traceback
            )

    watch = LoopWatch(asyncio.get_running_loop(), threshold_s, say)
    watch.start()
    return watch


def cmd_run(args: argparse.Namespace) -> int:
    if args.launcher == "ray":  # Ray is imported only for this launcher
        from .devmode.ray_launch import RaySupervisor as Supervisor
    else:
        from .devmode.supervisor import Supervisor

    overrides = list(args.set)
    if args.duration is not None:
        overrides.append(f"run.duration_s={args.duration}")
    config = load_config(args.config, overrides)
    if not args.skip_doctor and not _preflight(config):
        return 1
    resume = args.resume if args.resume is not None else False
    return _loop_runner(Supervisor(config, list(args.set), _console(), resume=resume).run())


def _preflight(config: LaminarConfig) -> bool:
    """``laminar doctor`` before a run: print its problems; False (refuse) on a blocker.
    A doctor that fails itself (not the config: that error is the run's too) is a warning: a
    preflight must never be the reason a run cannot start."""
    from .doctor import blockers, doctor

    console = _console()
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
    from .doctor import blockers, doctor, findings_json, summary

    path = args.config
    if path is None and Path(DEFAULT_EXAMPLE).is_file():
        path = DEFAULT_EXAMPLE
    machine_only = path is None and not args.set and not args.serve
    config = None if machine_only else load_config(path, args.set)
    mode = "serve" if args.serve else "run"
    findings = doctor(config, mode, args.serve)
    if args.json:
        print(json.dumps({"config": path, "mode": mode, **findings_json(findings, mode)}, indent=2))
        return 1 if blockers(findings) else 0
    console = _console()
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
    from .devmode.plots import plot_run

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: no such run directory")
    for path in plot_run(run_dir, args.trainer_metrics):
        print(path)
    return 0


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
    from .simulate.cells import run_cell
    from .simulate.sweep import describe, plot, sweep

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
    from .log import configure_logging
    from .simulate.cluster import describe_runs, plan

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
    from .simulate.cells import run_cell
    from .simulate.multiplex import run_multiplexed
    from .simulate.workload import SCALES

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


def _token(args: argparse.Namespace, cluster: object) -> bytes:
    token = os.environ.get(cluster.token_env, "").encode()  # type: ignore[attr-defined]
    info_file = Path(args.run_dir) / "cluster.json"
    if not token and info_file.is_file():
        info = json.loads(info_file.read_text())
        token = Path(info["token_file"]).read_text().strip().encode()
    return token or cluster.token()  # type: ignore[attr-defined]


def _find_cluster(args: argparse.Namespace) -> tuple[str, bytes, LaminarConfig]:
    config = load_config(args.config, args.set)
    cluster = config.cluster
    manager = args.join or cluster.manager
    info_file = Path(args.run_dir) / "cluster.json"
    if manager is None and info_file.is_file():
        manager = json.loads(info_file.read_text())["manager"]
    if manager is None:
        raise ConfigError(f"no manager address: pass --join tcp://HOST:PORT (no {info_file})")
    return manager, _token(args, cluster), config


def _admin(args: argparse.Namespace, status: object = None) -> AdminClient:
    """A client of the manager's admin HTTP API: ``--admin URL``, or the URL the manager
    published in its own member record (asked over RPC)."""
    from .devmode.status import AdminClient, admin_url, fetch_status

    if args.admin:
        config = load_config(args.config, args.set)
        return AdminClient(args.admin, _token(args, config.cluster), timeout=args.timeout)
    manager, token, config = _find_cluster(args)
    if status is None:
        status = _loop_runner(fetch_status(manager, token, config.cluster, timeout=args.timeout))
    url = admin_url(status, manager)  # type: ignore[arg-type]
    if url is None:
        raise LaminarError(
            "the manager serves no admin API (manager.admin is null); pass --admin URL"
        )
    return AdminClient(url, token, timeout=args.timeout)


def cmd_status(args: argparse.Namespace) -> int:
    from .devmode.status import fetch_status, render_admin_summary, render_status

    if args.admin and not args.join:  # the admin API alone
        admin = _admin(args)
        summary = admin.get("/v1/status")
        if args.json:
            print(json.dumps(summary, indent=2))
        else:
            _console().print(render_admin_summary(summary))
        return 0
    manager, token, config = _find_cluster(args)
    status = _loop_runner(fetch_status(manager, token, config.cluster, timeout=args.timeout))
    if args.json:
        print(status.model_dump_json(indent=2))
        return 0
    console = _console()
    console.print(render_status(status))
    try:
        summary = _admin(args, status).get("/v1/status")
    except LaminarError as exc:
        print(f"laminar status: admin API: {exc}", file=sys.stderr)
    else:
        console.print(render_admin_summary(summary))
    return 0


def cmd_repack(args: argparse.Namespace) -> int:
    from .devmode.status import render_outcome, render_plan

    admin = _admin(args)
    console = _console()
    if args.dry_run:
        view = admin.get("/v1/repack/plan")
        if args.json:
            print(json.dumps(view, indent=2))
        else:
            console.print(render_plan(view))
        return 0
    outcome = admin.post("/v1/repack")
    if args.json:
        print(json.dumps(outcome, indent=2))
    else:
        console.print(render_outcome(outcome))
    return 0


def cmd_repack_policy(args: argparse.Namespace) -> int:
    from .devmode.status import render_policy

    admin = _admin(args)
    change = {
        key: value
        for key, value in (
            ("period_s", args.period),
            ("c_max", args.c_max),
            ("batch_limit", args.batch_limit),
            ("enabled", args.enabled),
            ("on_publish", args.on_publish),
            ("require_draining", args.require_draining),
        )
        if value is not None
    }
    policy = admin.put("/v1/repack/policy", change) if change else admin.get("/v1/repack/policy")
    if args.json:
        print(json.dumps(policy, indent=2))
    else:
        _console().print(("repack policy set: " if change else "repack policy: ")
                         + render_policy(policy))  # fmt: skip
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="laminar", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a config key (dotted path; value parsed as YAML)",
        )

    serve = sub.add_parser("serve", help="start one role in this process")
    serve.add_argument("--role", required=True, help="manager, ..., or module:Class")
    serve.add_argument("--config", help="cluster config (YAML)")
    serve.add_argument("--join", help="the manager's address (tcp://HOST:PORT)")
    serve.add_argument("--instance", help="instance id (default: ROLE-HOST-PID)")
    serve.add_argument("--section", help="config section of this role (default: the role name)")
    serve.add_argument("--bind", help="RPC listen address, e.g. tcp://0.0.0.0:7420")
    serve.add_argument(
        "--standalone",
        action="store_true",
        help="serve without joining a manager (tests, debugging)",
    )
    common(serve)
    serve.set_defaults(fn=cmd_serve)

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
    common(run)
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
    common(doctor)
    doctor.set_defaults(fn=cmd_doctor)

    plot = sub.add_parser("plot", help="draw a run directory's plots (PNG, in RUN_DIR/plots)")
    plot.add_argument("run_dir", nargs="?", default="runs/latest", help="default: runs/latest")
    plot.add_argument(
        "--trainer-metrics", help="the trainer's JSONL (default: RUN_DIR/trainer.jsonl)"
    )
    plot.set_defaults(fn=cmd_plot)

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

    def connection(p: argparse.ArgumentParser, *, inherit: bool = False) -> None:
        # On a nested sub-command the copies default to SUPPRESS, so they do not overwrite what
        # was given before the sub-command's name.
        d = {"default": argparse.SUPPRESS} if inherit else {}
        p.add_argument("--join", help="the manager's address (default: from --run-dir)",
                       **({"default": None} | d))  # fmt: skip
        p.add_argument(
            "--admin",
            help="the admin API's base URL (default: the one the manager publishes)",
            **({"default": None} | d),
        )
        p.add_argument("--config", help="cluster config (YAML), for token_env and limits",
                       **({"default": None} | d))  # fmt: skip
        p.add_argument(
            "--run-dir",
            help="where `laminar run` wrote cluster.json (default: runs/latest)",
            **({"default": "runs/latest"} | d),
        )
        p.add_argument("--json", action="store_true", help="print JSON instead of a table",
                       **({"default": False} | d))  # fmt: skip
        p.add_argument("--timeout", type=float, **({"default": 30.0} | d))
        p.add_argument(
            "--set",
            action="append",
            metavar="KEY=VALUE",
            help="override a config key (dotted path; value parsed as YAML)",
            **({"default": []} | d),
        )

    status = sub.add_parser("status", help="print the cluster as the manager sees it")
    connection(status)
    status.set_defaults(fn=cmd_status, timeout=5.0)

    repack = sub.add_parser(
        "repack",
        help="repack now, show what a repack would do (--dry-run), or show/change the policy",
    )
    repack.add_argument("--dry-run", action="store_true", help="only plan: nothing moves")
    connection(repack)
    repack.set_defaults(fn=cmd_repack)
    repack_sub = repack.add_subparsers(dest="repack_command")
    policy = repack_sub.add_parser(
        "policy", help="print the repack policy; with flags, change it (live)"
    )
    policy.add_argument("--period", type=float, metavar="S", help="seconds between checks")
    policy.add_argument("--c-max", type=float, metavar="F", help="KV use a destination may reach")
    policy.add_argument("--batch-limit", type=int, metavar="B", help="roofline batch size")
    policy.add_argument("--enable", dest="enabled", action="store_const", const=True)
    policy.add_argument("--disable", dest="enabled", action="store_const", const=False)
    policy.add_argument("--on-publish", dest="on_publish", action="store_const", const=True)
    policy.add_argument("--no-on-publish", dest="on_publish", action="store_const", const=False)
    policy.add_argument(
        "--require-draining", dest="require_draining", action="store_const", const=True
    )
    policy.add_argument(
        "--no-require-draining", dest="require_draining", action="store_const", const=False
    )
    connection(policy, inherit=True)
    policy.set_defaults(fn=cmd_repack_policy)

    from .recipe.cli import register as register_recipe  # model init, sft, eval (lazy imports)

    register_recipe(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ConfigError, LaminarError) as exc:
        print(f"laminar {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
