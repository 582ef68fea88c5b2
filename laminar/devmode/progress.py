"""What a dev-mode run shows while it runs, and what it records for the plots afterwards.

The supervisor samples the cluster every ``run.view_interval_s``: the membership view (each
member's heartbeat stats, over RPC), the trainer's metrics file (one JSON line per version, plus
``eval`` lines) and the manager's event log (over the admin API). Each sample is appended to
``<run_dir>/cluster.jsonl`` and events to ``<run_dir>/events.jsonl``; :mod:`laminar.devmode.plots`
draws from those files and the trainer's, so a plot never depends on what the console happened to
show.

Everything here except :class:`TrainerLog` (which reads a file) is pure: a sample in, a view out.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from laminar.stats import RolloutStats

PHASE_STYLE = {"running": "green", "switching": "yellow", "draining": "magenta"}


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
        "phase": s.phase,
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


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _alive(r: dict[str, Any]) -> bool:
    return r.get("state", "alive") == "alive"


def progress_line(p: Progress) -> str:
    """One line for logs and pipes: live rollouts as ``rollout-0:running@v3``. Dead (or
    departed) members leave it: their last heartbeat's phase and version are no longer true, and
    the membership table printed on every change says who is down."""
    acc = _fmt(p.accuracy, ".3f")
    if p.accuracy is not None and p.accuracy_start is not None:
        acc += f" ({p.accuracy - p.accuracy_start:+.3f})"
    phases = " ".join(
        f"{name}:{r['phase']}@v{r['version']}"
        for name, r in sorted(p.rollouts.items())
        if _alive(r)
    )
    worst = p.staleness_max if p.staleness_max is not None else "-"
    return (
        f"[{p.elapsed_s:6.0f}s] version {p.version if p.version is not None else '-'}  "
        f"reward {_fmt(p.reward, '.3f')}  accuracy {acc}  "
        f"trained {_fmt(p.trained_tokens_per_s, '.0f')} tok/s  "
        f"staleness {_fmt(p.staleness_mean, '.2f')}/{worst}"
        f"  {phases}"
    )


def render_progress(p: Progress, title: str = "laminar run") -> Group:
    """The live panel: headline numbers, then one row per rollout (a dead one marked dead, its
    numbers blank)."""
    head = Table.grid(padding=(0, 3))
    for _ in range(6):
        head.add_column()
    acc = _fmt(p.accuracy, ".3f")
    if p.accuracy is not None and p.accuracy_start is not None:
        acc += f" ({p.accuracy - p.accuracy_start:+.3f} since start)"
    head.add_row(
        Text(f"{title}  {p.elapsed_s:.0f} s", style="bold"),
        f"version [bold]{p.version if p.version is not None else '-'}[/]",
        f"reward [bold]{_fmt(p.reward, '.3f')}[/]",
        f"held-out accuracy [bold]{acc}[/]",
        f"trained [bold]{_fmt(p.trained_tokens_per_s, '.0f')}[/] tok/s",
        f"staleness mean [bold]{_fmt(p.staleness_mean, '.2f')}[/] max "
        f"[bold]{p.staleness_max if p.staleness_max is not None else '-'}[/]",
    )
    table = Table(show_edge=False, pad_edge=False, box=None, header_style="bold")
    for col in ("rollout", "state", "version", "KV", "run/wait/flight", "gen tok/s"):
        table.add_column(col)
    for name, r in sorted(p.rollouts.items()):
        if not _alive(r):  # its last heartbeat's numbers are no longer true
            table.add_row(name, Text(r.get("state", "?"), style="red"), "-", "-", "-", "-")
            continue
        table.add_row(
            name,
            Text(r["phase"], style=PHASE_STYLE.get(r["phase"], "red")),
            str(r["version"]),
            f"{100 * r['kv']:.1f}%",
            f"{r['running']}/{r['waiting']}/{r['in_flight']}",
            _fmt(p.rollout_tokens_per_s.get(name), ".0f"),
        )
    return Group(head, table)
