"""Continuously generating systems: AReaL (partial rollout) and Laminar, on one event clock.

Rollouts keep up to ``max_in_flight`` trajectories each, taking whole prompt groups as room
allows; the trainer takes the first 8192 trajectories to complete (completion order) whenever it
is free, trains, and publishes. What happens at a publish is the difference:

* **AReaL**: every rollout stops at once: its in-flight trajectories are aborted, the new version
  is broadcast to all of them (a global NCCL broadcast), and the aborted trajectories continue
  under it with their KV recomputed (prompt and tokens so far prefilled again).
* **Laminar**: the version goes down the relay chain (:func:`.costs.chain_broadcast`) and each
  rollout takes it when *it* is free: a rollout holding trajectories of an older version takes no
  new prompts until they are done (one version per trajectory), then loads the version from its
  relay's host memory and takes prompts again. The manager repacks every ``period_s`` and after
  each publish with the real planner (:func:`laminar.repack.planner.plan_repack`, Algorithm 1):
  a draining rollout's trajectories move with their KV cache to a destination of the same
  version, and the source loads the new version at once.

Both bound what is generated ahead of the trainer (``max_ahead`` trajectories in flight or done
but not trained), as ``data.max_ahead`` does in the real data role.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from laminar.repack.planner import RepackPolicy, RolloutLoad, plan_repack

from .batches import Batches
from .costs import GPUS_PER_MACHINE, chain_broadcast, kv_transfer, ring_broadcast
from .engine import SimEngine
from .workload import BATCH, SAMPLES, Setup

#: A rollout loading a version from its relay's host memory: PCIe Gen5 x16 per GPU, effective.
PCIE_BPS = 40e9
#: The trainer's stall per publish: the copy into host memory (paper §8.3: 0.64 s for 32B,
#: 1.40 s for 72B, i.e. ~52 GB/s of weights).
STALL_BPS = 52e9


@dataclass
class Rollout:
    engine: SimEngine
    version: int = 0
    ready_at: float = 0.0  # loading a version until then
    stamp: int = 0  # bumps whenever its next event may have changed
    kv_prev: float = 0.0
    sources: dict[int, int] = field(default_factory=dict)  # sequence id -> its version


@dataclass
class Outcome:
    updates: list[float]  # when each actor update completed
    tokens: list[int]  # each update's tokens (prompt + response)
    staleness: list[int]  # per trained trajectory: trainer version - generating version
    recompute_tokens: int  # prefilled again (aborts, preemptions)
    migrated: int  # trajectories moved by repack
    trained: list[int] = field(default_factory=list)  # trajectory ids, in training order
    issued: int = 0  # trajectories started (ids 0 .. issued - 1)
    in_flight: int = 0  # at the end: in the engines (counted there)
    queued: int = 0  # at the end: finished, not trained yet


def run_continuous(
    system: str,
    setup: Setup,
    iterations: int,
    seed: int,
    max_in_flight: int = 1024,
    max_ahead: int | None = None,
    repack: RepackPolicy | None = None,
    batch: int = BATCH,
) -> Outcome:
    """Run ``system`` (``areal`` or ``laminar``) until ``iterations`` actor updates."""
    if system not in ("areal", "laminar"):
        raise ValueError(f"not a continuous system: {system}")
    roofline, place, cost = setup.roofline, setup.place, setup.cost
    policy = repack or RepackPolicy(batch_limit=min(roofline.roofline_batch(), max_in_flight))
    max_ahead = 2 * batch if max_ahead is None else max_ahead
    rollouts = [
        Rollout(SimEngine(roofline, max_running=max_in_flight)) for _ in range(place.engines)
    ]
    batches = Batches(setup.lengths, seed)
    weights = roofline.model.weight_bytes
    load_s = cost(weights / (PCIE_BPS * roofline.tp))
    relays = max(1, place.rollout // GPUS_PER_MACHINE)
    heap: list[tuple[float, int, int]] = []
    done: deque[tuple[int, int, int]] = deque()  # (id, tokens, version) in completion order
    lengths_of: dict[int, int] = {}
    outcome = Outcome([], [], [], 0, 0)
    newest = 0  # newest version at the relays (laminar) or everywhere (areal)
    pending: list[tuple[float, int]] = []  # (time, version) arrivals at the relays
    trainer_free, trainer_version = 0.0, 0
    training: tuple[float, int] | None = None  # (done at, tokens)
    next_repack = policy.period_s
    outstanding = 0  # in flight everywhere

    def push(i: int) -> None:
        r = rollouts[i]
        r.stamp += 1
        t = max(r.engine.next_finish(), r.ready_at) if r.engine.running else math.inf
        if t < math.inf:
            heapq.heappush(heap, (t, i, r.stamp))

    def refill(i: int, now: float) -> None:
        nonlocal outstanding
        r = rollouts[i]
        if system == "laminar" and r.version < newest:
            return  # one version per trajectory: finish these, then load
        room = max_in_flight - r.engine.in_flight
        while room >= SAMPLES and outstanding + len(done) + SAMPLES <= max_ahead:
            group = batches.groups(1)[0]
            for s in group:
                lengths_of[s.id] = s.prompt + s.target
                r.sources[s.id] = r.version
            r.engine.add(group, at=max(now, r.ready_at))
            outstanding += SAMPLES
            room -= SAMPLES

    def advance(i: int, t: float) -> None:
        """Run rollout ``i`` up to ``t``; what finished joins the trainer's queue."""
        nonlocal outstanding
        r = rollouts[i]
        for sid, _, _ in r.engine.run_until(t):
            done.append((sid, lengths_of.pop(sid), r.sources.pop(sid)))
            outstanding -= 1

    def load(i: int, now: float, version: int, seconds: float) -> None:
        r = rollouts[i]
        r.engine.busy_until(max(now, r.engine.now) + seconds)
        r.ready_at = r.engine.now
        r.version = version

    def catch_up(i: int, now: float) -> bool:
        """Laminar: a rollout with nothing in flight loads the newest version (True if so)."""
        r = rollouts[i]
        if system != "laminar" or r.engine.in_flight or r.version >= newest:
            return False
        load(i, now, newest, load_s)
        return True

    for i in range(len(rollouts)):
        refill(i, 0.0)
        push(i)

    now = 0.0
    while len(outcome.updates) < iterations:
        events = [heap[0][0] if heap else math.inf]
        if training is not None:
            events.append(training[0])
        if pending:
            events.append(pending[0][0])
        if system == "laminar":
            events.append(next_repack)
        if training is None and len(done) >= batch:
            events.append(trainer_free)
        now = min(events)
        if now == math.inf:
            raise RuntimeError("the simulation stalled: nothing to wait for")
        if training is not None and training[0] <= now:  # an update completes: publish
            outcome.updates.append(training[0])
            outcome.tokens.append(training[1])
            training = None
            trainer_version += 1
            if system == "areal":
                sync = cost(ring_broadcast(weights, place.rollout))
                for i, r in enumerate(rollouts):
                    back = r.engine.take(at=now)  # aborted: tokens kept, KV recomputed
                    load(i, now, trainer_version, sync)
                    for s in back:
                        r.sources[s.id] = trainer_version  # AReaL: continues under the new one
                    r.engine.add(back, at=r.ready_at)
                    push(i)
                newest = trainer_version
                trainer_free = now + sync
            else:
                stall = cost(weights / STALL_BPS)
                arrival = now + stall + cost(chain_broadcast(weights, relays + 1))
                pending.append((arrival, trainer_version))
                trainer_free = now + stall
        elif pending and pending[0][0] <= now:  # a version reached the relays
            newest = pending.pop(0)[1]
            for i in range(len(rollouts)):
                if catch_up(i, now):
                    refill(i, now)
                    push(i)
            next_repack = min(next_repack, now) if policy.on_publish else next_repack
        elif system == "laminar" and next_repack <= now:
            outcome.migrated += _repack(rollouts, policy, newest, now, setup, advance, push)
            for i in range(len(rollouts)):
                if catch_up(i, now):
                    refill(i, now)
                    push(i)
            next_repack = now + policy.period_s
        elif heap and heap[0][0] <= now:  # a rollout's next finish
            t, i, stamp = heapq.heappop(heap)
            r = rollouts[i]
            if stamp != r.stamp:
                continue
            advance(i, t)
            catch_up(i, now)
            refill(i, now)
            push(i)
        if training is None and len(done) >= batch and now >= trainer_free:
            taken = [done.popleft() for _ in range(batch)]
            outcome.trained.extend(sid for sid, _, _ in taken)
            outcome.staleness += [trainer_version - v for _, _, v in taken]
            tokens = sum(n for _, n, _ in taken)
            training = (max(now, trainer_free) + setup.train_time(tokens), tokens)
            for i in range(len(rollouts)):  # room under max_ahead again
                if rollouts[i].engine.in_flight < max_in_flight:
                    refill(i, now)
                    push(i)
    outcome.recompute_tokens = sum(r.engine.stats.recompute_tokens for r in rollouts)
    outcome.issued = batches.next_id
    outcome.in_flight = sum(r.engine.in_flight for r in rollouts)
    outcome.queued = len(done)
    return outcome


def _repack(
    rollouts: list[Rollout],
    policy: RepackPolicy,
    newest: int,
    now: float,
    setup: Setup,
    advance: Callable[[int, float], None],
    push: Callable[[int], None],
) -> int:
    """One repack round with the real planner; returns the trajectories moved."""
    loads = []
    for i, r in enumerate(rollouts):
        advance(i, now)
        used = r.engine.kv_used
        loads.append(
            RolloutLoad(
                rollout=str(i),
                version=r.version,
                kv_used=min(used, 1.0),
                kv_prev=min(r.kv_prev, 1.0),
                n_reqs=r.engine.in_flight,
                waiting=len(r.engine.waiting),
                draining=r.version < newest,
                accepting=r.ready_at <= now,
            )
        )
        r.kv_prev = used
    plan = plan_repack(loads, policy)
    moved = 0
    for move in plan.moves:
        src, dst = rollouts[int(move.source)], rollouts[int(move.destination)]
        seqs = src.engine.take(at=now, keep_kv=True)
        tokens = sum(s.context for s in seqs)
        for s in seqs:
            dst.sources[s.id] = src.sources.pop(s.id)
        transfer = setup.cost(kv_transfer(tokens, setup.roofline.model))
        dst.engine.busy_until(max(now, dst.engine.now) + transfer)
        dst.engine.add(seqs, at=dst.engine.now)
        moved += len(seqs)
        push(int(move.destination))
        push(int(move.source))
    return moved
