"""When a role instance that exited is started again, and when its end ends the run: one
policy for every launcher.

``laminar run`` starts role instances in two ways, as children of its own process
(:mod:`laminar.proc.children`) or inside Ray actors (:mod:`laminar.devmode.ray_launch`), and a
user must get the same behaviour from both: the role's ``restart`` policy (``never``,
``on-failure``: any non-zero exit or a signal, kill -9 included; ``always``), at most
``max_restarts`` restarts, a growing pause between them (so a role that dies at start does not
spin), the same words said about each decision (the exit status with the child's own error line,
:mod:`laminar.proc.exits`), and a child given up on reported to the supervisor. So the decision
and the loop that applies it live here, and each launcher brings only what differs: how one
incarnation is run (``life``, which reports its :class:`~laminar.proc.exits.Exit`) and how its
processes are killed when supervising it fails (``kill``).

**A failure that will repeat is not retried** (``docs/deploy.md``, *When a role fails*): the child
is given up on at once, marked as ending the run (``Child.fatal``), when

* it exited with :data:`~laminar.proc.exits.EX_CONFIG`: ``laminar serve`` refused its
  configuration before it was ready, and would refuse it again;
* it failed the same way as its previous incarnation (the same exit status and the same reason,
  numbers aside: :meth:`~laminar.proc.exits.Exit.signature`), this time before it became ready or
  within :data:`EARLY_S` of it. Its configuration, its model or its data fail it at every start,
  and further restarts would only spend ``max_restarts`` on the same line (each a whole start of
  the role, its engine's included) while the run idles. The previous failure may have
  come at any time (a rollout that dies at its first weight update did so minutes in, then at
  once after its restart: the update was waiting for it). Two in a row is enough: the second
  shows that a fresh start changed nothing. A failure without a known reason (no error line, a
  SIGKILL that was not the OOM killer's) is never "the same way": its cause may well be outside.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from laminar.proc.exits import EX_CONFIG, Exit, describe
from laminar.runtime.config import RoleSpec


class Restartable(Protocol):
    """What the policy reads and marks of a supervised process (``children.Child`` is one; this
    module does not import it, so the child owns its policy and not the other way round)."""

    name: str
    spec: RoleSpec
    restarts: int
    last_exit: Exit | None
    dead: str | None
    fatal: str | None
    done: bool


C = TypeVar("C", bound=Restartable)

__all__ = ["EARLY_S", "decide", "describe", "keep_running", "repeats", "restart_pause"]

#: The first pause before a restart (seconds); it doubles with each restart, up to the cap.
FIRST_PAUSE_S = 0.5
MAX_PAUSE_S = 5.0
#: A failure this soon after the instance became ready still counts as failing at its start.
EARLY_S = 60.0


def repeats(previous: Exit | None, current: Exit) -> bool:
    """Whether ``current`` fails the same way as ``previous`` did, at its start (see the module
    docstring)."""
    if previous is None or current.signature() is None:
        return False
    early = current.ready_s is None or current.ready_s < EARLY_S
    return early and previous.signature() == current.signature()


def _final(child: Restartable, previous: Exit | None, exit: Exit) -> str | None:
    """Why restarting ``child`` cannot help after ``exit`` (None: it may)."""
    if exit.code == EX_CONFIG:
        child.fatal = f"{child.name}'s configuration was refused"
        return "its configuration was refused (a restart would be refused the same way)"
    if repeats(previous, exit):
        child.fatal = f"{child.name} fails the same way at every start"
        when = (
            "before it was ready"
            if exit.ready_s is None
            else f"{exit.ready_s:.0f} s after it was ready"
        )
        return f"it failed the same way twice in a row, {when} (a restart would fail again)"
    return None


def decide(child: Restartable, exit: Exit | int | None, say: Callable[[str, str], None]) -> bool:
    """Whether ``child`` is started again after ``exit`` (an exit status alone is taken as an
    :class:`Exit` without a reason; None: unknown, which counts as a failure), by its role's
    policy and the rule for failures that repeat; counts the restart, says which way it went
    with the child's error line, and records why a child not restarted ended dead
    (``child.dead``) and whether that ends the run (``child.fatal``)."""
    if not isinstance(exit, Exit):
        exit = Exit(exit)
    how = exit.words()
    previous, child.last_exit = child.last_exit, exit
    if exit.failed:
        final = _final(child, previous if previous and previous.failed else None, exit)
        if final is not None:
            child.dead = f"exited with {how}"
            say(f"{child.name} exited with {how}; not restarting: {final}", "bold red")
            return False
    policy = child.spec.restart
    wanted = policy == "always" or (policy == "on-failure" and exit.failed)
    if not wanted or child.restarts >= child.spec.max_restarts:
        if exit.failed:
            child.dead = f"exited with {how}"
        say(
            f"{child.name} exited with {how}; not restarting "
            f"(policy {policy}, {child.restarts} restarts)",
            "bold red" if exit.failed else "bold",
        )
        _hint(child, exit, say)
        return False
    child.restarts += 1
    say(
        f"{child.name} exited with {how}; restarting ({child.restarts}/{child.spec.max_restarts})",
        "bold yellow",
    )
    _hint(child, exit, say)
    return True


def _hint(child: Restartable, exit: Exit, say: Callable[[str, str], None]) -> None:
    hint = exit.hint()
    if hint is not None:
        say(f"{child.name}: {hint}", "yellow")


def restart_pause(restarts: int) -> float:
    """Seconds to wait before restart number ``restarts`` (1, 2, ...): 0.5, 1, 2, 4, then 5."""
    return min(FIRST_PAUSE_S * 2 ** (restarts - 1), MAX_PAUSE_S)


async def keep_running(
    child: C,
    life: Callable[[C], Awaitable[bool]],
    *,
    stopping: asyncio.Event,
    say: Callable[[str, str], None],
    gave_up: Callable[[C], None],
    kill: Callable[[C], Awaitable[None]],
) -> None:
    """Own ``child`` for the whole run: one incarnation after another (``life`` runs one and
    returns whether to start it again, having called :func:`decide`), the growing pause between
    them, until the run stops. A child not restarted while the run goes on is marked ``done``
    and reported to ``gave_up``. Supervising never dies silently: an unexpected error is said,
    the child's processes killed (``kill``), and the child given up on, dead."""
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
        why = f"supervising it failed ({type(exc).__name__}: {exc})"
        say(f"{child.name}: {why}; killing its processes", "bold red")
        await kill(child)
        child.dead = why
    if not stopping.is_set():
        child.done = True
        gave_up(child)
