"""What the ``laminar`` sub-commands share: the console they print to, the event loop they run,
and the ``--set`` option."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

from rich.console import Console

T = TypeVar("T")


def loop_runner(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to its end on a uvloop event loop; its result."""
    import uvloop

    return uvloop.run(coro)


def make_console() -> Console:
    # Piped output (CI, log files) gets wide lines instead of rich's default 80 columns.
    return Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 160)


def add_set(p: argparse.ArgumentParser) -> None:
    """``--set KEY=VALUE`` (repeatable): a config override."""
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key (dotted path; value parsed as YAML)",
    )
