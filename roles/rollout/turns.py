"""Multi-turn episodes on a rollout: a turn that ends at a stop token waits for the environment.

Why its own module: an episode's turn leaves the engine (its KV cache released) while the data
role steps the environment, and comes back with the observation appended; the generation loop
should not know how. The rules:

* **The engine never waits.** The waiting episode is out of the engine; the others decode on.
  It stays in the flight table (``waiting``), so the one-version rule holds: no weight load
  while it waits, and it continues on the version it started with.
* **Re-prefilled, not kept.** Its KV cache is freed while it waits (a tool call may take minutes)
  and its context is prefilled again when it returns; an engine with prefix caching (vLLM's
  default) finds most of that prefix still cached. Repack moves waiting episodes like the others
  (:mod:`.migration`): the destination asks the data role for the same turn's answer, which it
  gets from the step already made (steps are idempotent there).
* **The observation is context.** Its tokens are appended with logprob 0 and recorded in the
  flight's ``env_spans``; they are reported like generated tokens, so a rollout killed after
  this point hands the episode on with them (``Assignment.resume_env_spans``).
* **Failure stays local.** The data role unreachable: ask again until it answers (the episode
  waits, nothing is lost). An answer that the episode is over (done, or the environment failed)
  completes the trajectory as it is; the data role scores it (or records why not). An episode the
  data role gave to another rollout meanwhile (``dropped``) is dropped here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from laminar.engines import Engine
from laminar.engines.base import EngineError
from laminar.roles.data.api import DataApi, EnvStepRequest
from laminar.runtime.clock import Clock
from laminar.runtime.errors import RpcError
from laminar.runtime.peers import Peer, RetryPolicy
from laminar.tools.env import add_span, awaits_step
from laminar.trajectory import Trajectory

from .flights import Flight, FlightTable

#: The data role answers a step after the environment's own timeout plus its queue: be patient.
STEP_CALL_TIMEOUT_S = 900.0
#: asked until answered, for as long as the episode still waits here (the data role may be
#: restarting; its answer is what the episode waits for)
STEP_RETRY = RetryPolicy(backoff_s=0.5, retry_on=(RpcError,))


class Turns:
    """Sends waiting episodes' turns to the environment and puts them back in the engine."""

    def __init__(
        self,
        instance: str,
        flights: FlightTable,
        engine: Engine,
        data: Peer[DataApi],
        clock: Clock,
        log: Any,
        *,
        spawn: Callable[..., object],  # Service.spawn: (coro, *, name)
        finish: Callable[[str, Trajectory], None],
        fail: Callable[[str, str], None],
    ) -> None:
        self.instance, self.flights, self.engine, self.data = instance, flights, engine, data
        self.clock, self.log = clock, log
        self._spawn, self._finish, self._fail = spawn, finish, fail
        self.steps = 0  # environment answers received (since start)
        self.env_wait_s = 0.0  # total seconds episodes waited here for them

    @property
    def waiting(self) -> int:
        return sum(1 for f in self.flights.values() if f.waiting)

    def ended_turn(self, flight: Flight, finish_reason: str | None) -> bool:
        """Whether ``flight``'s engine request ended a turn the environment must answer (it
        stopped at one of its stop tokens) rather than the episode."""
        return finish_reason == "stop" and self.resumed_waiting(flight)

    def resumed_waiting(self, flight: Flight) -> bool:
        """Whether an episode's response ends with a turn still owed the environment's answer
        (a turn just ended, or a resumed or handed-over episode)."""
        a = flight.assignment
        return a.episode and awaits_step(
            flight.tokens, flight.env_spans, frozenset(a.params.stop_token_ids)
        )

    def wait(self, tid: str, flight: Flight) -> None:
        """``flight`` (not in the engine) waits for the environment's answer to its last turn."""
        flight.waiting = True
        flight.asked += 1
        self._spawn(self._turn(tid, flight, flight.asked), name=f"env-step {tid}")

    def _current(self, tid: str, flight: Flight, asked: int) -> bool:
        """Still ours, still waiting, and this is its newest ask (not moved, dropped or
        handed back and asked again meanwhile)."""
        return self.flights.get(tid) is flight and flight.waiting and flight.asked == asked

    async def _turn(self, tid: str, flight: Flight, asked: int) -> None:
        req = EnvStepRequest(
            rollout=self.instance,
            trajectory_id=tid,
            version=flight.version,
            response_token_ids=list(flight.tokens),
            env_spans=list(flight.env_spans),
        )
        t0 = self.clock.time()
        if not self._current(tid, flight, asked):
            return  # moved (repack) or dropped meanwhile
        try:
            reply = await self.data.call(
                lambda data: data.env_step.options(timeout=STEP_CALL_TIMEOUT_S).call(req),
                STEP_RETRY,
                give_up=lambda: not self._current(tid, flight, asked),
            )
        except RpcError:
            return  # no longer wanted: moved (repack) or dropped meanwhile
        if not self._current(tid, flight, asked):
            return
        flight.waiting = False
        self.steps += 1
        self.env_wait_s += self.clock.time() - t0
        if reply.dropped:
            self.flights.pop(tid)
            self.log.warning("dropped an episode the data role reassigned", trajectory=tid)
            return
        if reply.done:
            self.flights.pop(tid)
            self._finish(tid, flight.trajectory("stop", self.clock.wall(), self.instance))
            return
        start = len(flight.tokens)
        flight.tokens += reply.observation_token_ids
        flight.logprobs += [0.0] * len(reply.observation_token_ids)
        add_span(flight.env_spans, start, len(flight.tokens))
        await self.resubmit(tid, flight)

    async def resubmit(self, tid: str, flight: Flight) -> None:
        """Put ``flight`` back in the engine, its whole response so far as context."""
        try:
            await self.engine.import_sequences([flight.sequence(tid)])
        except EngineError as exc:
            self._fail(tid, str(exc))
