"""Repack migration between rollouts: the source's ``migrate`` and the destination's ``accept``.

The order of steps is what keeps a trajectory whole (nothing lost, one version, no duplicate):

1. **Export** (source). Every trajectory in flight leaves the engine (with its KV state where the
   engine exports it). The engine's snapshot is the truth: it holds every token the engine
   emitted, even those still queued for our output task, which then finds no flight and skips
   them. The source stops reporting these trajectories. Episodes waiting for the environment are
   in no engine: they leave as the flight table has them, without KV, and the destination asks
   the data role for the same turn's answer (:mod:`.turns`).
2. **Move the leases** (source → data role). From now on only the destination's reports are
   accepted for them. The data role holds back re-delivering them to the destination for a grace
   period, so a ``take`` racing the handoff cannot start them twice.
3. **Hand off** (source → destination ``accept``). The destination checks the version, records a
   flight per trajectory (assignment, tokens, the data role's acknowledged offset) and imports
   the sequences into its engine, which continues them: from the KV state, or by re-prefilling.
4. **Take back** what the destination refused or could not be reached for: the leases move back
   and the sequences go back into the source's engine (its version cannot have changed: a weight
   load waits for a migration in progress). If step 2 itself failed (the data role was down),
   the leases never left: the sequences go straight back into the engine. (Dropped there, they
   would be handed back by the data role after a weight load, to an engine of another version,
   which would refuse them for good.)

The source is ``migrating`` (:mod:`.state`) from step 1 to the end of step 4, so no weight load
starts in between; a destination accepts only while its version cannot change (not while starting
or loading). Migration sees the rollout through :class:`MigratingRollout`, not the service.

If the source dies between 2 and 3, the destination's grace period runs out and the data role
re-delivers the trajectories from their acknowledged tokens (the usual resume). If the
destination dies, the data role releases its leases like any dead rollout's.
"""

from __future__ import annotations

from typing import Any, Protocol

from laminar.engines import Engine
from laminar.engines.base import EngineError
from laminar.roles.data.api import DataApi, LeaseTransfer
from laminar.runtime.clock import Clock
from laminar.runtime.errors import RpcError

from .api import Handoff, HandoffReply, MigratedSequence, MigrateReport, MigrateRequest, RolloutApi
from .flights import Flight, FlightTable
from .state import RolloutPhases, TransitionError
from .turns import Turns

HANDOFF_TIMEOUT_S = 120.0  # the destination's accept: KV bytes in, import


class MigratingRollout(Protocol):
    """What a migration needs of a rollout, and no more (``RolloutService`` is one)."""

    @property
    def instance(self) -> str: ...

    @property
    def clock(self) -> Clock: ...

    @property
    def log(self) -> Any: ...

    @property
    def engine(self) -> Engine: ...

    @property
    def flights(self) -> FlightTable: ...

    @property
    def phases(self) -> RolloutPhases: ...

    @property
    def turns(self) -> Turns: ...

    async def data_api(self) -> DataApi: ...

    def peer(self, address: str) -> RolloutApi:
        """The rollout at ``address``."""
        ...


async def migrate_out(svc: MigratingRollout, req: MigrateRequest) -> MigrateReport:
    """The source side: steps 1-4 of the module docstring."""
    report = MigrateReport(source=svc.instance, destination=req.destination, version=req.version)
    t0 = svc.clock.time()
    if req.destination == svc.instance:
        report.error = "a rollout cannot migrate to itself"
        return report
    if svc.engine.version != req.version:
        report.error = f"holds version {svc.engine.version}, not {req.version}"
        return report
    try:
        svc.phases.begin_migration()
    except TransitionError as exc:
        report.error = str(exc)
        return report
    try:
        seqs = await svc.engine.export_sequences(svc.flights.snapshot(), with_kv=req.kv)
        seqs += [f.sequence(tid) for tid, f in svc.flights.items() if f.waiting]  # no engine
        report.export_s = svc.clock.time() - t0
        flights = svc.flights.pop_many([s.request_id for s in seqs])
        seqs = [s for s in seqs if s.request_id in flights]
        if not seqs:
            return report
        moving = [
            MigratedSequence(
                assignment=f.assignment,
                version=f.version,
                started_at=f.started_at,
                acked=f.acked,
                sequence=s,
                env_spans=f.env_spans,
                waiting=f.waiting,
            )
            for s in seqs
            for f in [flights[s.request_id]]
        ]
        t1 = svc.clock.time()
        accepted, refused, kept = await _hand_off(svc, req, moving)
        report.handoff_s = svc.clock.time() - t1
        report.moved = accepted
        back = [m for m in moving if m.sequence.request_id in refused]
        if back:
            report.error = refused[back[0].sequence.request_id]
            report.returned = await _take_back(svc, req.destination, back, flights)
        if kept:  # the leases never moved: straight back into our engine
            report.error = kept[next(iter(kept))]
            here = [m for m in moving if m.sequence.request_id in kept]
            report.returned += await _reimport(svc, here, flights)
        moved = [m for m in moving if m.sequence.request_id in set(accepted)]
        report.tokens = sum(
            len(m.sequence.prompt_token_ids) + len(m.sequence.response_token_ids) for m in moved
        )
        kv = [m.sequence.kv for m in moved if m.sequence.kv is not None]
        report.kv_tokens = sum(k.tokens for k in kv)
        report.kv_bytes = sum(k.nbytes for k in kv)
        report.mode = ("kv" if kv else "reprefill") if moved else "none"
        return report
    finally:
        svc.phases.end_migration()
        report.total_s = svc.clock.time() - t0
        if report.moved or report.error:
            svc.log.info(
                "migrated",
                destination=req.destination,
                moved=len(report.moved),
                returned=len(report.returned),
                mode=report.mode,
                kv_bytes=report.kv_bytes,
                total_s=round(report.total_s, 3),
                error=report.error or None,
            )


async def _hand_off(
    svc: MigratingRollout, req: MigrateRequest, moving: list[MigratedSequence]
) -> tuple[list[str], dict[str, str], dict[str, str]]:
    """Steps 2-3: returns (accepted ids, refused id -> why, id whose lease never moved -> why)."""
    ids = [m.sequence.request_id for m in moving]
    try:
        moved = await _transfer(svc, ids, svc.instance, req.destination)
    except RpcError as exc:
        # A timeout could hide a transfer the data role did make; then our later reports of
        # these trajectories are refused and the data role re-delivers them from their
        # acknowledged tokens when the destination's grace period ends: nothing is lost.
        return [], {}, {i: f"data role: {exc}" for i in ids}
    # A lease the data role no longer gives us (reassigned meanwhile) is not ours to move.
    lost = [i for i in ids if i not in moved]
    if lost:
        svc.log.warning("not moving trajectories the data role reassigned", ids=lost)
    sending = [m for m in moving if m.sequence.request_id in moved]
    if not sending:
        return [], {}, {}
    try:
        dest = svc.peer(req.address)
        reply = await dest.accept.options(timeout=HANDOFF_TIMEOUT_S).call(
            Handoff(source=svc.instance, version=req.version, sequences=sending)
        )
    except RpcError as exc:
        reply = HandoffReply(refused=f"destination: {exc}")
    accepted = set(reply.accepted)
    why = reply.refused or "refused by the destination"
    refused = {m.sequence.request_id: why for m in sending if m.sequence.request_id not in accepted}
    return sorted(accepted), refused, {}


async def _take_back(
    svc: MigratingRollout,
    destination: str,
    back: list[MigratedSequence],
    flights: dict[str, Flight],
) -> list[str]:
    """Step 4: leases back from ``destination``, sequences back into our engine."""
    ids = [m.sequence.request_id for m in back]
    try:
        ours = await _transfer(svc, ids, destination, svc.instance)
    except RpcError as exc:
        # The leases stay with the destination; the data role re-delivers them from their
        # acknowledged tokens when the handoff grace period ends. Nothing is lost.
        svc.log.warning("could not take leases back", ids=ids, error=str(exc))
        return []
    return await _reimport(svc, [m for m in back if m.sequence.request_id in ours], flights)


async def _reimport(
    svc: MigratingRollout, returning: list[MigratedSequence], flights: dict[str, Flight]
) -> list[str]:
    """Sequences whose leases are ours back into our engine (without KV: re-prefilled); waiting
    episodes back to waiting for the environment."""
    for m in returning:
        svc.flights.add(m.sequence.request_id, flights[m.sequence.request_id])
    generating = [m for m in returning if not m.waiting]
    try:
        await svc.engine.import_sequences(
            [m.sequence.model_copy(update={"kv": None}) for m in generating]
        )
    except EngineError:
        for m in generating:
            svc.flights.pop(m.sequence.request_id)
        raise
    for m in returning:
        if m.waiting:
            svc.turns.wait(m.sequence.request_id, flights[m.sequence.request_id])
    return [m.sequence.request_id for m in returning]


async def _transfer(
    svc: MigratingRollout, ids: list[str], source: str, destination: str
) -> set[str]:
    data = await svc.data_api()
    request = LeaseTransfer(trajectory_ids=ids, source=source, destination=destination)
    return set((await data.transfer.call(request)).moved)


async def accept_in(svc: MigratingRollout, req: Handoff) -> HandoffReply:
    """The destination side of step 3."""
    if not svc.phases.accepting:  # starting, or loading a version: it would change under them
        return HandoffReply(refused=f"not accepting: {svc.phases.phase.value}")
    if svc.engine.version != req.version:
        return HandoffReply(refused=f"holds version {svc.engine.version}, not {req.version}")
    here = [m for m in req.sequences if m.sequence.request_id in svc.flights]
    new = [m for m in req.sequences if m.sequence.request_id not in svc.flights]
    for m in new:
        seq = m.sequence
        tokens, logprobs = list(seq.response_token_ids), list(seq.response_logprobs)
        acked = min(m.acked, len(tokens))
        flight = Flight(m.assignment, m.version, m.started_at, tokens, logprobs, acked,
                        env_spans=list(m.env_spans))  # fmt: skip
        svc.flights.add(seq.request_id, flight)
    try:
        await svc.engine.import_sequences([m.sequence for m in new if not m.waiting])
    except EngineError as exc:
        for m in new:
            svc.flights.pop(m.sequence.request_id)
        return HandoffReply(
            accepted=[m.sequence.request_id for m in here], refused=f"import failed: {exc}"
        )
    for m in new:  # episodes waiting for the environment: ask for the same turn's answer
        if m.waiting:
            svc.turns.wait(m.sequence.request_id, svc.flights[m.sequence.request_id])
    svc.flights.changed()
    return HandoffReply(accepted=[m.sequence.request_id for m in req.sequences])
