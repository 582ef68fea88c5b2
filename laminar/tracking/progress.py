"""A run's progress as numbers: samples of the cluster, the trainer's records, and what the live
display and the tracked curves derive from them.

The supervisor samples the cluster every ``run.view_interval_s``: the membership view (each
member's heartbeat stats, over RPC), the trainer's metrics file (one JSON line per version, plus
``eval`` lines) and the manager's event log (over the admin API). Each sample is appended to
``<run_dir>/cluster.jsonl`` and events to ``<run_dir>/events.jsonl``; the plots draw from those
files and the trainer's, so a plot never depends on what the console happened to show. How the
console shows them is :mod:`laminar.devmode.progress`; this module loads no console library.

Everything here except :class:`TrainerLog` (which reads a file) is pure: a sample in, a view out.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from laminar.roles.rollout.api import RolloutStats


class TrainerLog:
    """Follows the trainer's metrics JSONL (written by another process) by byte offset."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.versions: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []

    def poll(self) -> None:
        if not self.path.is_file():
            return
        with self.path.open("rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1  # a line still being written waits for the next poll
        self.offset += end
        for line in chunk[:end].splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            (self.evals if record.get("eval") else self.versions).append(record)


def policy_reward(record: dict[str, Any]) -> float:
    """A version record's reward of the policy: of every trajectory scored while its batch was
    gathered (``reward_generated``) where there is one, else of the batch it trained on (the same
    thing unless the data role filters groups)."""
    generated = record.get("reward_generated")
    return float(generated if generated is not None else record["reward_mean"])


def rollout_sample(stats: RolloutStats | None) -> dict[str, Any]:
    """The part of a rollout's heartbeat stats a timeline needs (before its first heartbeat:
    version -1 and zeros)."""
    s = stats if stats is not None else RolloutStats(version=-1)
    return {
        "phase": s.phase.value,
        "version": s.version,
        "kv": round(s.kv_cache_usage, 4),
        "running": s.running,
        "waiting": s.waiting,
        "in_flight": s.in_flight,
        "env_waiting": s.env_waiting,
        "generated_tokens": s.generated_tokens,
    }


def cluster_sample(members: list[Any], now: float | None = None) -> dict[str, Any]:
    """One line of ``cluster.jsonl`` from a membership view's members (``Member``, or anything
    with their ``instance``, ``role``, ``state`` and ``stats``)."""
    rollouts = {
        m.instance: {**rollout_sample(RolloutStats.parse(m.stats)), "state": m.state}
        for m in members
        if m.role == "rollout"
    }
    return {"time": time.time() if now is None else now, "rollouts": rollouts}


@dataclass
class Progress:
    """The numbers the live display shows, derived from the samples so far."""

    started: float
    version: int | None = None
    reward: float | None = None  # mean over the last few versions
    accuracy: float | None = None
    accuracy_start: float | None = None
    trained_tokens_per_s: float | None = None
    staleness_mean: float | None = None
    staleness_max: int | None = None
    rollouts: dict[str, dict[str, Any]] = field(default_factory=dict)
    rollout_tokens_per_s: dict[str, float] = field(default_factory=dict)
    elapsed_s: float = 0.0


def summarize(
    trainer: TrainerLog | None,
    samples: list[dict[str, Any]],
    started: float,
    now: float,
    window: int = 5,
) -> Progress:
    """The display's numbers: reward averaged over the last ``window`` versions, trained
    tokens/s over the versions of the last minute (or all, if fewer), generation tokens/s per
    rollout over the last ten samples."""
    p = Progress(started=started, elapsed_s=now - started)
    versions = trainer.versions if trainer else []
    evals = trainer.evals if trainer else []
    if versions:
        last = versions[-window:]
        p.version = int(versions[-1]["version"])
        p.reward = sum(policy_reward(v) for v in last) / len(last)
        p.staleness_mean = sum(v["staleness_mean"] for v in last) / len(last)
        p.staleness_max = max(int(v["staleness_max"]) for v in versions)
        recent = [v for v in versions if v["time"] >= now - 60] or versions
        span = now - (recent[0]["time"] - recent[0].get("train_s", 0.0))
        if span > 0:
            p.trained_tokens_per_s = sum(v["tokens"] for v in recent) / span
    if evals:
        p.accuracy = float(evals[-1]["accuracy"])
        p.accuracy_start = float(evals[0]["accuracy"])
        if p.version is None:
            p.version = int(evals[-1]["version"])
    if samples:
        p.rollouts = samples[-1]["rollouts"]
        first = samples[max(0, len(samples) - 10)]
        dt = samples[-1]["time"] - first["time"]
        for name, now_r in p.rollouts.items():
            before = first["rollouts"].get(name)
            if before is not None and dt > 0:
                delta = now_r["generated_tokens"] - before["generated_tokens"]
                p.rollout_tokens_per_s[name] = max(0.0, delta / dt)
    return p


def alive(r: dict[str, Any]) -> bool:
    """Whether a rollout of a sample is up: the display and the tracked curves agree on who is."""
    return r.get("state", "alive") == "alive"
