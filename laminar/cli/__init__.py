"""The ``laminar`` command: ``serve`` one role, ``run`` a config on the local machine (after the
``doctor`` preflight), ``status``, ``repack`` (through the manager's admin HTTP API), ``plot`` a
run directory, ``simulate`` the paper's scale, and the recipe's ``model``, ``sft`` and ``eval``.

One module per group of sub-commands, each adding its parsers (``register``) and running its
commands; heavy imports (torch, vLLM, the dev mode) happen inside the commands, so building the
parser, ``laminar status`` and ``laminar repack`` load none of them."""

from __future__ import annotations

import argparse
import sys

from laminar.runtime.errors import ConfigError, LaminarError

from . import admin, run, serve, simulate


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="laminar", description=(__doc__ or "").split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve.register(sub)
    run.register(sub)
    simulate.register(sub)
    admin.register(sub)

    from ..recipe.cli import register as register_recipe  # model init, sft, eval (lazy imports)

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
