"""The ``laminar`` command: ``serve`` one role, ``run`` a config on this machine, ``status``."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

from rich.console import Console

from .config import ConfigError, LaminarConfig, load_config
from .errors import LaminarError


def _loop_runner(coro: object) -> int:
    import uvloop

    return uvloop.run(coro)  # type: ignore[arg-type]


def _console() -> Console:
    # Piped output (CI, log files) gets wide lines instead of rich's default 80 columns.
    return Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 160)


def cmd_serve(args: argparse.Namespace) -> int:
    from .log import configure_logging
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
    host = ServiceHost(
        role_cls,
        ctx,
        manager=manager,
        ready=print_ready,
        handle_signals=True,
    )
    _loop_runner(host.run())
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from .supervisor import Supervisor

    overrides = list(args.set)
    if args.duration is not None:
        overrides.append(f"run.duration_s={args.duration}")
    config = load_config(args.config, overrides)
    return _loop_runner(Supervisor(config, list(args.set), _console()).run())


def _find_cluster(args: argparse.Namespace) -> tuple[str, bytes, LaminarConfig]:
    config = load_config(args.config, args.set)
    cluster = config.cluster
    manager = args.join or cluster.manager
    token = os.environ.get(cluster.token_env, "").encode()
    info_file = Path(args.run_dir) / "cluster.json"
    if (manager is None or not token) and info_file.is_file():
        info = json.loads(info_file.read_text())
        manager = manager or info["manager"]
        if not token:
            token = Path(info["token_file"]).read_text().strip().encode()
    if manager is None:
        raise ConfigError(f"no manager address: pass --join tcp://HOST:PORT (no {info_file})")
    if not token:
        token = cluster.token()
    return manager, token, config


def cmd_status(args: argparse.Namespace) -> int:
    from .status import fetch_status, render_status

    manager, token, config = _find_cluster(args)
    status = _loop_runner(fetch_status(manager, token, config.cluster, timeout=args.timeout))
    if args.json:
        print(status.model_dump_json(indent=2))
    else:
        _console().print(render_status(status))
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
    common(run)
    run.set_defaults(fn=cmd_run)

    status = sub.add_parser("status", help="print the cluster as the manager sees it")
    status.add_argument("--join", help="the manager's address (default: from --run-dir)")
    status.add_argument("--config", help="cluster config (YAML), for token_env and limits")
    status.add_argument(
        "--run-dir",
        default="runs/latest",
        help="where `laminar run` wrote cluster.json (default: runs/latest)",
    )
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.add_argument("--timeout", type=float, default=5.0)
    common(status)
    status.set_defaults(fn=cmd_status)

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
