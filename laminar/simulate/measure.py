"""What a run of the schedules measured: one definition for real processes and for the simulator.

Why one module: the simulator's claim is that it predicts what the cluster of real processes does
(``benchmarks/schedules.py``), and a prediction is only comparable when both sides compute their
figures the same way, from the same samples. Both sample the manager's membership view every
half second (its heartbeat stats) and read the trainer's per-version records (the same dicts the
trainer writes to its ``metrics_file``); only the clock differs (the wall clock there, the virtual
clock here, which is also what the records' timestamps use).

The figures (:func:`figures`), over the window after ``warmup`` seconds:

* ``trained_tokens_per_s`` (the paper's metric): batch tokens (prompt + response) over the time
  between the first and the last trainer update in the window;
* ``trainer_busy``: the share of that span the trainer spent training (the rest it waited for a
  batch or for the schedule's barrier): a capacity planner's "do these rollouts keep it busy";
* ``gen_tokens_per_s``, ``rollout_utilisation`` (share of samples with a non-empty decode
  batch), ``kv_util``, and staleness mean/max from the second batch on.
"""

from __future__ import annotations

import statistics
from typing import Any

from pydantic import BaseModel

from laminar.roles.rollout.api import RolloutStats
from laminar.roles.trainer.api import TrainerStats
from laminar.runtime.membership import MembershipApi
from laminar.runtime.rpc.client import RpcClient

__all__ = ["TrainerRecords", "figures", "sample_cluster", "trainer_records"]

TRAINER_ROLES = ("sim_trainer", "trainer")


async def sample_cluster(manager: MembershipApi, now: float) -> dict[str, Any]:
    """One sample of the cluster at time ``now`` (the caller's clock)."""
    status = await manager.status.call()
    rollouts = [m for m in status.members if m.role == "rollout" and m.state == "alive"]
    trainer = [m for m in status.members if m.role in TRAINER_ROLES]
    stats = [m.stats_as(RolloutStats) or RolloutStats() for m in rollouts]
    trained = (trainer[0].stats_as(TrainerStats) if trainer else None) or TrainerStats()
    return {
        "t": now,
        "tokens": float(sum(s.generated_tokens for s in stats)),
        "busy": [float(s.running > 0) for s in stats],
        "kv": [s.kv_cache_usage for s in stats],
        "versions": [s.version for s in stats],
        "trainer_version": trained.version,
    }


class TrainerRecords(BaseModel):
    """What these figures read of the sim trainer's ``status`` reply (``SimTrainerStatus``): its
    per-version records. Read through RPC by endpoint name, so that this layer needs no role."""

    records: list[dict[str, Any]] = []


async def trainer_records(client: RpcClient) -> list[dict[str, Any]]:
    """The trainer's per-version records (``client`` is connected to the trainer)."""
    reply = await client.call("status", None, TrainerRecords)
    return reply.records


def figures(
    samples: list[dict[str, Any]], records: list[dict[str, Any]], t_warm: float
) -> dict[str, Any]:
    """The run's figures over the window from ``t_warm`` on (see the module docstring)."""
    window = [s for s in samples if s["t"] >= t_warm]
    updates = [r for r in records if r["train_end"] >= t_warm]
    out: dict[str, Any] = {"versions": len(records), "updates_in_window": len(updates)}
    out["trained_tokens_per_s"] = None
    if len(updates) >= 2:
        span = updates[-1]["train_end"] - updates[0]["train_end"]
        out["trained_tokens_per_s"] = sum(r["tokens"] for r in updates[1:]) / span
        out["iteration_s_mean"] = span / (len(updates) - 1)
        out["trainer_busy"] = sum(r["train_s"] for r in updates[1:]) / span
    trained = [r for r in records if r["version"] > 1]  # staleness from the second batch on
    if trained:
        out["staleness_mean"] = statistics.fmean(r["staleness_mean"] for r in trained)
        out["staleness_max"] = max(r["staleness_max"] for r in trained)
    out["train_s_mean"] = statistics.fmean(r["train_s"] for r in records) if records else None
    out["batch_tokens_mean"] = statistics.fmean(r["tokens"] for r in records) if records else None
    if len(window) >= 2:
        out["gen_tokens_per_s"] = (window[-1]["tokens"] - window[0]["tokens"]) / (
            window[-1]["t"] - window[0]["t"]
        )
        out["rollout_utilisation"] = statistics.fmean(b for s in window for b in s["busy"])
        out["kv_util"] = statistics.fmean(k for s in window for k in s["kv"])
        out["window_s"] = window[-1]["t"] - window[0]["t"]
    return out
