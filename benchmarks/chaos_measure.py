"""What the chaos benchmark measures, and how: samples of the running cluster, throughput windows,
recovery times, and the end-of-run accounting of every trajectory.

**Generation throughput** is the rollouts' own count of generated tokens (``generated_tokens`` in
the stats each rollout heartbeats to the manager; the manager's ``status`` has the latest of every
member), summed over rollout processes (a restarted process starts from zero: counts are kept per
(instance, pid)). It is read every ``interval`` seconds; while the manager is down there are no
samples and the counts are interpolated across the gap (the tokens made meanwhile are still
counted, once the rollouts heartbeat to the new manager).

**Training throughput** is the trainer's own record of each version (``metrics_file``, one JSON
line per version, appended by every trainer incarnation): its batch's tokens, spread evenly over
that version's training interval (``train_start`` .. ``train_end``).

**Recovery** of either after a fault at ``f``: the pre-fault level is the mean rate over
``[f - pre_s, f)``; a window is the mean rate over ``window_s`` seconds; throughput is back at
the start ``r`` of the first window from which *every* later window up to the next fault (each
start on a ``step_s`` grid) holds at least 90% of the pre-fault level: a dip that comes late (the
trainer running out of buffered trajectories a while after the rollouts stopped) counts.
``None``: never back before the next fault. For a clean return to full rate after a dip to a
share ``d`` of the level this reads early by at most ``0.1 * window_s / (1 - d)`` (2 s for a full
stop with 20 s windows); windows shorter than 20 s dip below 90% on their own now and then on
this 2-core machine (measured without faults: 6% of 10 s windows, none of 20 s ones).
"""

from __future__ import annotations

import asyncio
import json
import re
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from laminar.roles.data.api import DataApi
from laminar.roles.manager.api import RelayChainApi
from laminar.roles.relay.api import RelayApi
from laminar.roles.rollout.api import RolloutApi
from laminar.runtime.errors import CallTimeout, PeerUnavailable, RemoteError
from laminar.runtime.membership import MembershipApi
from laminar.runtime.rpc.client import RpcClient, remote

RPC_ERRORS = (PeerUnavailable, CallTimeout, RemoteError, OSError)


class Clients:
    """One client per address; a role that restarted elsewhere gets a new one."""

    def __init__(self, options: Any) -> None:
        self.options = options
        self._clients: dict[str, RpcClient] = {}

    def get(self, cls: type, address: str, timeout: float = 2.0) -> Any:
        client = self._clients.get(address)
        if client is None:
            client = self._clients[address] = RpcClient(address, self.options, timeout=timeout)
        return remote(cls, client)

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()


@dataclass
class Samples:
    members: list[tuple[float, dict[str, dict[str, Any]]]] = field(default_factory=list)
    chain: list[tuple[float, int, list[str], float]] = field(default_factory=list)
    data: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    rss: list[tuple[float, dict[str, float]]] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)


class Sampler:
    """Polls the manager (members with their stats, the relay chain) and the data role."""

    def __init__(self, clients: Clients, address: Callable[[str], str | None]) -> None:
        self.clients = clients
        self.address = address  # instance -> its current RPC address
        self.samples = Samples()

    def _error(self, what: str) -> None:
        self.samples.errors[what] = self.samples.errors.get(what, 0) + 1

    async def members(self) -> None:
        manager = self.address("manager")
        if manager is None:
            return
        try:
            status = await self.clients.get(MembershipApi, manager).status.call()
            chain = await self.clients.get(RelayChainApi, manager).chain.call()
        except RPC_ERRORS:
            self._error("manager")
            return
        now = time.time()
        view = {
            m.instance: {
                "role": m.role,
                "state": m.state,
                "pid": m.pid,
                "incarnation": m.incarnation,
                "gen": m.stats.get("generated_tokens"),
                "version": m.stats.get("version"),
            }
            for m in status.members
        }
        self.samples.members.append((now, view))
        relays = [r.instance for r in chain.relays]
        self.samples.chain.append((now, chain.epoch, relays, chain.changed_at))

    async def data(self) -> None:
        address = self.address("data")
        if address is None:
            return
        try:
            s = await self.clients.get(DataApi, address).status.call()
        except RPC_ERRORS:
            self._error("data")
            return
        keep = ("queued", "leased", "trajectories", "consumed", "evicted", "tokens", "cursor")
        self.samples.data.append((time.time(), {k: getattr(s, k) for k in keep}))

    async def run(self, interval: float, stop: asyncio.Event) -> None:
        """The manager every ``interval``, the data role every two: in two loops, so that a call
        to a dead role (it waits for its timeout) never delays the other's samples."""

        async def every(seconds: float, sample: Callable[[], Any]) -> None:
            while not stop.is_set():
                await sample()
                try:
                    await asyncio.wait_for(stop.wait(), seconds)
                except TimeoutError:
                    pass

        await asyncio.gather(every(interval, self.members), every(2 * interval, self.data))

    async def relay_repair(self, victim: str, killed_at: float, limit_s: float = 15.0) -> dict:
        """Poll the manager's chain every 20 ms until ``victim`` is out of it: the manager's own
        time of that view minus the kill (``repair_s``), and when we saw it (``seen_s``)."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            manager = self.address("manager")
            try:
                chain = await self.clients.get(RelayChainApi, manager).chain.call()
            except RPC_ERRORS:
                await asyncio.sleep(0.02)
                continue
            relays = [r.instance for r in chain.relays]
            if victim not in relays:
                return {
                    "repair_s": round(chain.changed_at - killed_at, 4),
                    "seen_s": round(time.time() - killed_at, 4),
                    "chain_after": relays,
                    "epoch": chain.epoch,
                }
            await asyncio.sleep(0.02)
        return {"repair_s": None, "seen_s": None, "note": f"still in the chain after {limit_s} s"}

    async def relay_versions(self, name: str) -> dict[int, float]:
        address = self.address(name)
        if address is None:
            return {}
        try:
            status = await self.clients.get(RelayApi, address).status.call()
        except RPC_ERRORS:
            return {}
        return {int(v): t for v, t in status.received_at.items()}

    async def weight_loads(self, name: str) -> list[dict[str, Any]] | None:
        address = self.address(name)
        if address is None:
            return None
        try:
            history = await self.clients.get(RolloutApi, address).weights.call()
        except RPC_ERRORS:
            return None
        return [{"version": w.version, "at": w.loaded_at} for w in history.loads]


# -- throughput --------------------------------------------------------------------------------


def generation_counters(
    samples: Samples, started: dict[int, float], grid: np.ndarray
) -> dict[str, np.ndarray]:
    """Cumulative generated tokens of each rollout instance on ``grid``.

    Each process's counter is interpolated between its own samples, from 0 when it became ready
    (``started``: pid -> wall time) and flat after its last; an instance is the sum over its
    processes. Per process, not over the sum: while the manager restarts, each rollout's count
    reaches the new manager only when that rollout has rejoined, and interpolating the sum would
    put every rollout's tokens of the gap at the moment the last one rejoined (a dip, then a
    spike, that no rollout had)."""
    series: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for t, view in samples.members:
        for name, m in view.items():
            if m["role"] == "rollout" and m["gen"] is not None:
                points = series.setdefault((name, m["pid"]), [])
                if not points or m["gen"] >= points[-1][1]:  # a stale heartbeat is skipped
                    points.append((t, float(m["gen"])))
    out: dict[str, np.ndarray] = {}
    for (name, pid), points in series.items():
        if pid in started and started[pid] < points[0][0]:
            points.insert(0, (started[pid], 0.0))
        ts, cs = zip(*points, strict=True)
        out[name] = out.get(name, np.zeros_like(grid)) + np.interp(grid, ts, cs, left=0.0)
    return out


def training_counter(records: list[dict[str, Any]], grid: np.ndarray) -> np.ndarray:
    """Cumulative trained tokens on ``grid``, each version's tokens spread over its training."""
    out = np.zeros_like(grid)
    for r in records:
        start, end = r["train_start"], max(r["train_end"], r["train_start"] + 1e-6)
        out += r["tokens"] * np.clip((grid - start) / (end - start), 0.0, 1.0)
    return out


def rate(grid: np.ndarray, counter: np.ndarray, a: float, b: float) -> float:
    ca, cb = np.interp([a, b], grid, counter)
    return float((cb - ca) / (b - a))


def recovery(
    grid: np.ndarray,
    counter: np.ndarray,
    fault_at: float,
    end_at: float,
    *,
    pre_s: float,
    window_s: float,
    step_s: float = 0.5,
) -> dict[str, Any]:
    """Pre-fault level, lowest window after the fault (as a share of it), and recovery time."""
    pre = rate(grid, counter, fault_at - pre_s, fault_at)
    starts = np.arange(fault_at, end_at - window_s + 1e-9, step_s)
    if pre <= 0 or len(starts) == 0:
        return {"pre": round(pre, 1), "min_ratio": None, "recovery_s": None}
    ratios = [rate(grid, counter, s, s + window_s) / pre for s in starts]
    bad = [i for i, r in enumerate(ratios) if r < 0.9]
    if not bad:
        rec: float | None = 0.0
    elif bad[-1] == len(starts) - 1:
        rec = None
    else:
        rec = float(starts[bad[-1] + 1] - fault_at)
    return {"pre": round(pre, 1), "min_ratio": round(min(ratios), 3), "recovery_s": rec}


def timeline(grid: np.ndarray, counter: np.ndarray, window_s: float) -> list[float]:
    """Sliding-window rate at each grid point (the window ending there)."""
    before = np.interp(grid - window_s, grid, counter)
    return [round(float(x), 1) for x in (counter - before) / window_s]


# -- the accounting --------------------------------------------------------------------------


def read_records(path: Path) -> list[dict[str, Any]]:
    """The trainer's per-version lines (a line cut by a kill is skipped)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if "train_end" in record:
            out.append(record)
    return out


def account(store: Path, records: list[dict[str, Any]]) -> dict[str, Any]:
    """Where every trajectory of the run went, from the data role's store and the trainer's
    records (read after the cluster stopped).

    A completed trajectory (a row of ``trajectories``) is exactly one of: trained (once, or
    more: ``duplicated``), evicted by the buffer's policy, ``orphaned`` (evicted, or bound to be,
    because another member of its group failed: the group can never be whole), still buffered
    (never handed out), taken by the trainer for the batch it was on when the run ended (consume
    seq past everything trained), or ``lost_completed``: handed out, then neither trained nor
    handed out again before the trainer moved past it. A sample that never completed because
    the data role recorded it as ``failed`` (its ``failures`` table) is lost too: the chaos run
    feeds no bad input, so a failure there is a fault's doing.
    ``lost`` = lost_completed + failed + orphaned.

    Which consume seqs a version trained: the record's ``seqs`` (first, last) where the trainer
    writes it; otherwise the ``trajectories`` seqs ending at its ``cursor`` (one trainer
    consumes, and ``sample`` re-delivers from ``after + 1`` then numbers fresh ones on, so a
    batch's seqs are contiguous)."""
    with sqlite3.connect(f"file:{store}?mode=ro", uri=True) as db:
        rows = db.execute(
            "SELECT trajectory_id, prompt_id, scored, consumed, evicted, consume_seq "
            "FROM trajectories"
        ).fetchall()
        leased = db.execute(
            "SELECT rollout, COUNT(*) FROM samples WHERE state = 'leased' GROUP BY rollout"
        ).fetchall()
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        failures = []
        if "failures" in tables:
            failures = db.execute(
                "SELECT trajectory_id, prompt_id, kind, reason, rollout, failed_at FROM failures"
            ).fetchall()
    trained: dict[int, int] = {}
    again: list[tuple[float, int]] = []  # (train_end, trajectories it trained a second time)
    for r in records:
        first, last = r.get("seqs") or (int(r["cursor"]) - int(r["trajectories"]) + 1, r["cursor"])
        repeats = 0
        for seq in range(int(first), int(last) + 1):
            repeats += seq in trained
            trained[seq] = trained.get(seq, 0) + 1
        if repeats:
            again.append((r["train_end"], repeats))
    top = max(trained, default=0)
    broken = {prompt_id for _, prompt_id, *_ in failures}
    out = {"completed": len(rows), "trained": 0, "duplicated": 0, "evicted": 0, "orphaned": 0}
    out |= {"buffered": 0, "unscored": 0, "in_trainer_at_end": 0, "lost_completed": 0}
    lost_ids, dup_ids = [], []
    for tid, prompt_id, scored, consumed, evicted, seq in rows:
        times = trained.get(seq, 0) if seq is not None else 0
        if times:
            out["trained"] += 1
            if times > 1:
                out["duplicated"] += 1
                dup_ids.append(tid)
        elif prompt_id in broken:  # evicted, or to be when the trainer's sampling reaches it
            out["orphaned"] += 1
        elif evicted:
            out["evicted"] += 1
        elif not consumed:
            out["buffered" if scored else "unscored"] += 1
        elif seq > top:
            out["in_trainer_at_end"] += 1
        else:
            out["lost_completed"] += 1
            lost_ids.append(tid)
    out["failed"] = len(failures)
    out["lost"] = out["lost_completed"] + out["failed"] + out["orphaned"]
    reasons: dict[str, int] = {}
    for _, _, kind, reason, *_ in failures:
        key = f"{kind}: {re.sub(r'[0-9]+', 'N', reason)[:120]}"
        reasons[key] = reasons.get(key, 0) + 1
    out["failed_reasons"] = reasons
    out["failed_by_rollout"] = {}
    for _, _, _, _, rollout, _ in failures:
        out["failed_by_rollout"][rollout] = out["failed_by_rollout"].get(rollout, 0) + 1
    out["extra_trainings"] = sum(v - 1 for v in trained.values() if v > 1)
    out["lost_examples"] = (lost_ids + [f[0] for f in failures])[:10]
    out["duplicated_examples"] = dup_ids[:10]
    out["leased_at_end"] = dict(leased)
    # when things went wrong, to put them against the faults
    out["events"] = {"failed_at": sorted(f[5] for f in failures), "trained_again": again}
    return out
