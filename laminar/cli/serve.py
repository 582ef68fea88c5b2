"""``laminar serve``: one role in this process, until it is stopped; and how the process ends.

A configuration refused before the role is ready (a bad value, a prompt file with a bad record,
a missing model: a :class:`~laminar.runtime.errors.ConfigError`, raised while loading the config or
by
the role's ``on_start``) ends the process with one line, ``laminar serve: <the error>``, and
status :data:`~laminar.proc.exits.EX_CONFIG` (78): started again, it would be refused again, and
``laminar run`` ends the run at once on that status instead of restarting the role
(``docs/deploy.md``, *When a role fails*). After the role was ready, an error is a crash like any
other: its traceback, status 1."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from laminar.runtime.config import load_config
from laminar.runtime.errors import ConfigError

from ..proc.exits import EX_CONFIG
from .common import add_set, loop_runner

if TYPE_CHECKING:
    from laminar.runtime.loopwatch import LoopWatch


def cmd_serve(args: argparse.Namespace) -> int:
    ready_seen: list[bool] = []  # whether the role became ready: a refusal is a start's only
    try:
        _serve(args, ready_seen)
    except (ConfigError, BaseExceptionGroup) as exc:
        refused = None if ready_seen else refused_config(exc)
        if refused is None:
            raise
        print(f"laminar serve: {refused}", file=sys.stderr)
        exit_without_final_collection(EX_CONFIG)
    exit_without_final_collection(0)


def refused_config(exc: BaseException) -> ConfigError | None:
    """The configuration error ``exc`` is, or that every error of an exception group (a start
    that failed in the host's task group) is; None if it is, or holds, anything else."""
    if isinstance(exc, ConfigError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        found = [refused_config(e) for e in exc.exceptions]
        if found and all(f is not None for f in found):
            return found[0]
    return None


def _serve(args: argparse.Namespace, ready_seen: list[bool]) -> None:
    from laminar.runtime.context import ServiceContext, transport_options
    from laminar.runtime.log import configure_logging
    from laminar.runtime.service import ServiceHost, print_ready

    from ..proc.placement import give_way, keep_off_bound_cores, niceness_for
    from ..roles_registry import load_role

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
        ready_seen.append(True)
        print_ready(info)

    host = ServiceHost(role_cls, ctx, manager=manager, ready=ready, handle_signals=True)
    try:
        loop_runner(host.run())
    finally:
        for watch in watches:
            watch.close()


def exit_without_final_collection(code: int) -> NoReturn:
    """End this process as the interpreter would, minus its final garbage collection and module
    teardown: join the non-daemon threads (an executor's running call finishes), run the atexit
    handlers, flush the standard streams, ``os._exit``.

    Why: a stopped role's work is done, and what is left of its exit is freeing what its imports
    made. After the rollout's imports (vLLM) or the trainer's (torch, transformers) that final
    collection lasts seconds, against a fraction of one for the CLI alone (docs/benchmarks.md,
    *Stopping*): seconds of every ``laminar run`` stop, restart and test teardown, counted against
    the role's stop grace. Only after a clean stop: a crash takes the interpreter's ordinary path,
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
    from laminar.runtime.loopwatch import LoopWatch, Stall

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


def register(sub: Any) -> None:
    """``serve``."""
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
    add_set(serve)
    serve.set_defaults(fn=cmd_serve)
