"""When a role instance that exited is started again: one policy for every launcher.

``laminar run`` starts role instances in two ways, as children of its own process
(:mod:`laminar.proc.children`) or inside Ray actors (:mod:`laminar.devmode.ray_launch`), and a
user must get the same behaviour from both: the role's ``restart`` policy (``never``,
``on-failure``: any non-zero exit or a signal, kill -9 included; ``always``), at most
``max_restarts`` restarts, a growing pause between them (so a role that dies at start does not
spin), the same words said about each decision, and a child given up on reported to the
supervisor. So the decision and the loop that applies it live here, and each launcher brings only
what differs: how one incarnation is run (``life``) and how its processes are killed when
supervising it fails (``kill``).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from laminar.proc.children import Child

#: The first pause before a restart (seconds); it doubles with each restart, up to the cap.
FIRST_PAUSE_S = 0.5
MAX_PAUSE_S = 5.0


def describe(code: int | None) -> str:
    """An exit status in words: ``code 3``, ``signal 9 (SIGKILL)``, ``unknown status``."""
    if code is None:
        return "unknown status"
    if code >= 0:
        return f"code {code}"
    with contextlib.suppress(ValueError):
        return f"signal {-code} ({signal.Signals(-code).name})"
    return f"signal {-code}"


def decide(child: Child, code: int | None, say: Callable[[str, str], None]) -> bool:
    """Whether ``child`` is started again after exiting with ``code`` (negative: the signal;
    None: unknown, which counts as a failure), by its role's policy; counts the restart and says
    which way it went."""
    how = describe(code)
    policy = child.spec.restart
    wanted = policy == "always" or (policy == "on-failure" and code != 0)
    if not wanted or child.restarts >= child.spec.max_restarts:
        say(
            f"{child.name} exited with {how}; not restarting "
            f"(policy {policy}, {child.restarts} restarts)",
            "bold red",
        )
        return False
    child.restarts += 1
    say(
        f"{child.name} exited with {how}; restarting ({child.restarts}/{child.spec.max_restarts})",
        "bold yellow",
    )
    return True


def restart_pause(restarts: int) -> float:
    """Seconds to wait before restart number ``restarts`` (1, 2, ...): 0.5, 1, 2, 4, then 5."""
    return min(FIRST_PAUSE_S * 2 ** (restarts - 1), MAX_PAUSE_S)


async def keep_running(
    child: Child,
    life: Callable[[Child], Awaitable[bool]],
    *,
    stopping: asyncio.Event,
    say: Callable[[str, str], None],
    gave_up: Callable[[Child], None],
    kill: Callable[[Child], Awaitable[None]],
) -> None:
    """Own ``child`` for the whole run: one incarnation after another (``life`` runs one and
    returns whether to start it again, having called :func:`decide`), the growing pause between
    them, until the run stops. A child not restarted while the run goes on is reported to
    ``gave_up``. Supervising never dies silently: an unexpected error is said, the child's
    processes killed (``kill``), and the child given up on."""
    try:
        while await life(child):
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(restart_pause(child.restarts)):
                    await stopping.wait()
            if stopping.is_set():
                return
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        say(
            f"{child.name}: supervising it failed ({type(exc).__name__}: {exc}); "
            "killing its processes",
            "bold red",
        )
        await kill(child)
    if not stopping.is_set():
        gave_up(child)
