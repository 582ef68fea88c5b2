"""What a rollout is doing, as a state machine with no I/O: the one place its phase changes.

Why a machine: the rules that keep a trajectory on one weight version (take nothing while a newer
version waits; load only when nothing is in flight and no migration can hand trajectories back;
accept migrated trajectories only while the version cannot change under them) used to live in half a
dozen flags that three tasks and four endpoints set by hand. Here each rule is a guard on a named
transition, an illegal step raises :class:`TransitionError`, and the whole thing is tested without
an engine, a socket or an event loop. The service owns the I/O: it calls a transition when an
endpoint, a stream or the engine says something happened, and waits on ``on_change`` for the guards
it needs.

The weight phase (one at a time)::

    from                 transition              to                   guard
    STARTING             started()               GENERATING
    GENERATING           newer_version()         PAUSED_FOR_WEIGHTS
    PAUSED_FOR_WEIGHTS   load(in_flight)         LOADING              in_flight == 0, not migrating
    PAUSED_FOR_WEIGHTS   switched()              GENERATING           (gave up: no version, error)
    LOADING              switched()              GENERATING           (loaded, or the load failed)

Two facts orthogonal to the phase (any combination with it is real):

* ``operator_drain`` -- an operator's ``drain`` (set) and ``resume`` (cleared), in any phase: the
  rollout finishes what it has and takes nothing new.
* ``migrating`` -- ``begin_migration()`` / ``end_migration()``, a repack moving our trajectories
  out. Not in ``LOADING`` (nothing is in flight there, and a migration could hand sequences back
  into an engine that is changing version) and never two at once.

``starved`` records whether the last ``take`` found the prompt pool dry (``took``); the repack
planner reads it as "ramping down".

Derived answers the service relies on: ``may_take`` (GENERATING and no operator drain),
``may_load(n)``, ``drained(n)`` (nothing in flight and no migration that could hand some back) and
``accepting`` (a destination's version is stable: GENERATING or PAUSED_FOR_WEIGHTS).
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from .api import RolloutPhase


class Phase(enum.Enum):
    STARTING = "starting"  # the engine is not up yet
    GENERATING = "generating"  # taking prompts on the engine's current version
    PAUSED_FOR_WEIGHTS = "paused_for_weights"  # a newer version waits: flights finish or move
    LOADING = "loading"  # nothing in flight: the engine loads the newer version


class TransitionError(RuntimeError):
    """A transition the current state does not allow (the message says which and why)."""


def _nothing() -> None:
    pass


class RolloutPhases:
    """The rollout's phase and its two orthogonal facts; ``on_change`` runs after every change."""

    def __init__(self, on_change: Callable[[], None] = _nothing) -> None:
        self._phase = Phase.STARTING
        self._operator_drain = False
        self._migrating = False
        self._starved = False
        self._on_change = on_change

    # -- reading -----------------------------------------------------------------------------

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def operator_drain(self) -> bool:
        return self._operator_drain

    @property
    def migrating(self) -> bool:
        return self._migrating

    @property
    def starved(self) -> bool:
        return self._starved

    @property
    def paused_for_weights(self) -> bool:
        """A newer version is being switched to: waiting for flights or loading."""
        return self._phase in (Phase.PAUSED_FOR_WEIGHTS, Phase.LOADING)

    @property
    def may_take(self) -> bool:
        return self._phase is Phase.GENERATING and not self._operator_drain

    @property
    def accepting(self) -> bool:
        """Migrated trajectories may come in: the engine is up and its version cannot change."""
        return self._phase in (Phase.GENERATING, Phase.PAUSED_FOR_WEIGHTS)

    def drained(self, in_flight: int) -> bool:
        return in_flight == 0 and not self._migrating

    def may_load(self, in_flight: int) -> bool:
        return self._phase is Phase.PAUSED_FOR_WEIGHTS and self.drained(in_flight)

    def public(self) -> RolloutPhase:
        """The phase every other reader sees: ``switching`` while a newer version waits or a
        repack moves trajectories out, ``draining`` under an operator's drain, else ``running``
        (starting included: it takes nothing until the engine is up either way)."""
        if self.paused_for_weights or self._migrating:
            return RolloutPhase.SWITCHING
        if self._operator_drain:
            return RolloutPhase.DRAINING
        return RolloutPhase.RUNNING

    def stats(self) -> dict[str, float]:
        """The heartbeat keys other roles read: the public phase, and the facts the repack
        planner reads beside it."""
        return {
            "phase": float(self.public().code),
            "paused_for_weights": float(self.paused_for_weights),
            "operator_drain": float(self._operator_drain),
            "migrating": float(self._migrating),
            "starved": float(self._starved),
        }

    # -- transitions -------------------------------------------------------------------------

    def started(self) -> None:
        self._move(Phase.STARTING, Phase.GENERATING)

    def newer_version(self) -> None:
        self._move(Phase.GENERATING, Phase.PAUSED_FOR_WEIGHTS)

    def load(self, in_flight: int) -> None:
        if self._phase is Phase.PAUSED_FOR_WEIGHTS and not self.drained(in_flight):
            raise TransitionError(
                f"cannot load with {in_flight} in flight"
                + (" and a migration under way" if self._migrating else "")
            )
        self._move(Phase.PAUSED_FOR_WEIGHTS, Phase.LOADING)

    def switched(self) -> None:
        self._move((Phase.PAUSED_FOR_WEIGHTS, Phase.LOADING), Phase.GENERATING)

    def drain(self) -> bool:
        """Operator drain on; True if it was off."""
        return self._flag("_operator_drain", True)

    def resume(self) -> bool:
        """Operator drain off; True if it was on."""
        return self._flag("_operator_drain", False)

    def begin_migration(self) -> None:
        if self._migrating:
            raise TransitionError("a migration is already under way")
        if self._phase is Phase.LOADING:
            raise TransitionError("loading a newer version")
        self._flag("_migrating", True)

    def end_migration(self) -> None:
        if not self._migrating:
            raise TransitionError("no migration is under way")
        self._flag("_migrating", False)

    def took(self, count: int) -> None:
        """A ``take`` came back with ``count`` prompts (0: the pool is dry)."""
        self._flag("_starved", count == 0)

    # -- internals ---------------------------------------------------------------------------

    def _move(self, source: Phase | tuple[Phase, ...], target: Phase) -> None:
        allowed = source if isinstance(source, tuple) else (source,)
        if self._phase not in allowed:
            names = " or ".join(p.name for p in allowed)
            raise TransitionError(f"{self._phase.name} -> {target.name}: only from {names}")
        self._phase = target
        self._on_change()

    def _flag(self, name: str, value: bool) -> bool:
        changed = getattr(self, name) != value
        setattr(self, name, value)
        self._on_change()
        return changed
