"""``laminar status`` and ``laminar repack``: a live cluster, through the manager (RPC) and its
admin HTTP API."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from laminar.runtime.config import ClusterConfig, LaminarConfig, load_config
from laminar.runtime.errors import ConfigError, LaminarError, PeerUnavailable

from .common import loop_runner, make_console

if TYPE_CHECKING:
    from laminar.runtime.membership import ClusterStatus

    from ..devmode.status import AdminClient


def _token(args: argparse.Namespace, cluster: ClusterConfig) -> bytes:
    token = os.environ.get(cluster.token_env, "").encode()
    info_file = Path(args.run_dir) / "cluster.json"
    if not token and info_file.is_file():
        info = json.loads(info_file.read_text())
        token = Path(info["token_file"]).read_text().strip().encode()
    return token or cluster.token()


class Found(NamedTuple):
    """A live cluster as the command found it."""

    manager: str  # the manager's RPC address
    token: bytes
    config: LaminarConfig
    run_file: Path | None  # the run directory's cluster.json the address came from, if it did


def _find_cluster(args: argparse.Namespace) -> Found:
    # here, not at the top: every `laminar` command imports this module, and the transport
    # (numpy, UCX's probe) only the ones that talk to a cluster over RPC
    from ..transport.base import MIN_TOKEN_BYTES

    config = load_config(args.config, args.set)
    cluster = config.cluster
    manager, run_file = args.join or cluster.manager, None
    info_file = Path(args.run_dir) / "cluster.json"
    if manager is None and info_file.is_file():
        manager, run_file = json.loads(info_file.read_text())["manager"], info_file
    if manager is None:
        raise ConfigError(f"no manager address: pass --join tcp://HOST:PORT (no {info_file})")
    token = _token(args, cluster)
    if len(token) < MIN_TOKEN_BYTES:  # no cluster's: its roles refuse one (and the handshake)
        raise ConfigError(
            f"the cluster token in {cluster.token_env} has {len(token)} characters, and a "
            f"cluster's has at least {MIN_TOKEN_BYTES}: set it to the token the cluster was "
            f"started with (`laminar run` keeps it in the run directory, which --run-dir names)"
        )
    return Found(manager, token, config, run_file)


def _fetch_status(found: Found, timeout: float) -> ClusterStatus:
    """The manager's view of the cluster. A manager found in a run directory that does not
    answer is most likely that run's, ended: said so."""
    from ..devmode.status import fetch_status

    try:
        return loop_runner(fetch_status(found.manager, found.token, found.config.cluster,
                                        timeout=timeout))  # fmt: skip
    except PeerUnavailable as exc:
        if found.run_file is None:
            raise
        raise LaminarError(
            f"no manager answers at {found.manager}, the address in {found.run_file}: that "
            f"run has ended, or this is not its machine (start one with `laminar run`, or name "
            f"a live one with --join or --run-dir) [{exc}]"
        ) from exc


def _admin(args: argparse.Namespace, status: ClusterStatus | None = None) -> AdminClient:
    """A client of the manager's admin HTTP API: ``--admin URL``, or the URL the manager
    published in its own member record (asked over RPC)."""
    from ..devmode.status import AdminClient, admin_url

    if args.admin:
        config = load_config(args.config, args.set)
        return AdminClient(args.admin, _token(args, config.cluster), timeout=args.timeout)
    found = _find_cluster(args)
    if status is None:
        status = _fetch_status(found, args.timeout)
    url = admin_url(status, found.manager)
    if url is None:
        raise LaminarError(
            "the manager serves no admin API (manager.admin is null); pass --admin URL"
        )
    return AdminClient(url, found.token, timeout=args.timeout)


def cmd_status(args: argparse.Namespace) -> int:
    from ..devmode.status import render_admin_summary, render_status

    if args.admin and not args.join:  # the admin API alone
        admin = _admin(args)
        summary = admin.get("/v1/status")
        if args.json:
            print(json.dumps(summary, indent=2))
        else:
            make_console().print(render_admin_summary(summary))
        return 0
    status = _fetch_status(_find_cluster(args), args.timeout)
    if args.json:
        print(status.model_dump_json(indent=2))
        return 0
    console = make_console()
    console.print(render_status(status))
    try:
        summary = _admin(args, status).get("/v1/status")
    except LaminarError as exc:
        print(f"laminar status: admin API: {exc}", file=sys.stderr)
    else:
        console.print(render_admin_summary(summary))
    return 0


def cmd_repack(args: argparse.Namespace) -> int:
    from ..devmode.status import render_outcome, render_plan

    admin = _admin(args)
    console = make_console()
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
    from ..devmode.status import render_policy

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
        make_console().print(("repack policy set: " if change else "repack policy: ")
                         + render_policy(policy))  # fmt: skip
    return 0


def connection(p: argparse.ArgumentParser, *, inherit: bool = False) -> None:
    """The options that find the cluster and its token (``--join``, ``--admin``, ``--run-dir``,
    ...). On a nested sub-command (``inherit``) the copies default to SUPPRESS, so they do not
    overwrite what was given before the sub-command's name."""

    def default(value: Any) -> Any:
        return argparse.SUPPRESS if inherit else value

    p.add_argument("--join", default=default(None),
                   help="the manager's address (default: from --run-dir)")  # fmt: skip
    p.add_argument(
        "--admin",
        default=default(None),
        help="the admin API's base URL (default: the one the manager publishes)",
    )
    p.add_argument("--config", default=default(None),
                   help="cluster config (YAML), for token_env and limits")  # fmt: skip
    p.add_argument(
        "--run-dir",
        default=default("runs/latest"),
        help="where `laminar run` wrote cluster.json (default: runs/latest)",
    )
    p.add_argument("--json", action="store_true", default=default(False),
                   help="print JSON instead of a table")  # fmt: skip
    p.add_argument("--timeout", type=float, default=default(30.0))
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override a config key (dotted path; value parsed as YAML)",
        default=default([]),
    )


def register(sub: Any) -> None:
    """``status``, ``repack`` and ``repack policy``."""
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
