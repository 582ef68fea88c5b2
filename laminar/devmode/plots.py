"""PNG plots of a run directory (``laminar plot RUN_DIR``; ``laminar run`` draws them at the end).

Inputs are the files a dev-mode run leaves (see :mod:`laminar.tracking.progress`): the trainer's
metrics JSONL (one line per version, ``eval`` lines for held-out accuracy), ``cluster.jsonl`` (the
supervisor's samples of every rollout) and ``events.jsonl`` (the manager's event log: weight
pulls, publishes, repacks). Outputs, in ``<run_dir>/plots/``:

* ``reward_accuracy.png``: mean reward per version and held-out accuracy against wall time;
* ``throughput.png``: trained tokens/s (per version) and generated tokens/s (all rollouts);
* ``staleness.png``: histogram of trainer version minus generating version, over trajectories;
* ``timeline.png``: one lane per rollout: what it was doing (generating, switching weights,
  drained, dead), how full its KV cache was, the share of its episodes waiting for the
  environment (multi-turn tasks), each weight pull, and each repack move (an arrow from the
  source's lane to the destination's).

A resumed run appends to the same files, so its plots cover every session; the gap between
sessions shows as a gap.
"""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path
from typing import Any

from laminar.roles.rollout.api import RolloutPhase
from laminar.tracking.progress import policy_reward

PHASE_COLOUR = {
    RolloutPhase.RUNNING: "#2ca02c",
    RolloutPhase.SWITCHING: "#ffbf00",
    RolloutPhase.DRAINING: "#9467bd",
}
DEAD_COLOUR = "#d62728"
ENV_COLOUR = "#1f77b4"  # episodes waiting for the environment


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line cut by a kill: skip it
            continue
    return out


def _t0(*series: list[dict[str, Any]], key: str = "time") -> float:
    starts = [s[0][key] for s in series if s]
    return min(starts) if starts else 0.0


def plot_run(run_dir: str | Path, trainer_metrics: str | Path | None = None) -> list[Path]:
    """Draw every plot the data allows; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = Path(run_dir)
    records = read_jsonl(Path(trainer_metrics) if trainer_metrics else run / "trainer.jsonl")
    versions = [r for r in records if not r.get("eval")]
    evals = [r for r in records if r.get("eval")]
    samples = read_jsonl(run / "cluster.jsonl")
    events = read_jsonl(run / "events.jsonl")
    t0 = _t0(samples, versions, evals)
    out_dir = run / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def save(fig: Any, name: str) -> None:
        path = out_dir / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    # reward and accuracy
    fig, ax = plt.subplots(figsize=(8, 4.2))
    if versions:
        ts = [(v["time"] - t0) / 60 for v in versions]
        rewards = [policy_reward(v) for v in versions]
        ax.plot(ts, rewards, ".", alpha=0.35, label="reward (version)")
        ax.plot(
            ts,
            _smooth(rewards, 9),
            "-",
            label="reward (9-version mean)",
        )
    if evals:
        ax.plot([(e["time"] - t0) / 60 for e in evals], [e["accuracy"] for e in evals], "o-",
                color="black", label=f"held-out accuracy (n={evals[0].get('n', '?')})")  # fmt: skip
    ax.set_xlabel("wall time (min)")
    ax.set_ylim(0, 1)
    ax.set_title("reward and held-out accuracy")
    ax.grid(alpha=0.3)
    _legend(ax, "lower right", "no version trained yet")
    save(fig, "reward_accuracy.png")

    # throughput
    fig, ax = plt.subplots(figsize=(8, 4.2))
    if len(versions) > 1:
        ts, rates = [], []
        for a, b in pairwise(versions):
            if b["time"] > a["time"]:
                ts.append((b["time"] - t0) / 60)
                rates.append(b["tokens"] / (b["time"] - a["time"]))
        ax.plot(ts, _smooth(rates, 9), label="trained tokens/s (9-version mean)")
    gen_t, gen = _generation_rate(samples)
    if gen:
        ax.plot(
            [(t - t0) / 60 for t in gen_t],
            _smooth(gen, 5),
            label="generated tokens/s (all rollouts)",
        )
    ax.set_xlabel("wall time (min)")
    ax.set_ylabel("tokens/s")
    ax.set_title("throughput")
    ax.grid(alpha=0.3)
    _legend(ax, "upper left", "nothing generated or trained yet")
    save(fig, "throughput.png")

    # staleness
    fig, ax = plt.subplots(figsize=(6, 3.8))
    counts: dict[int, int] = {}
    for v in versions:
        for k, n in (v.get("staleness_counts") or {}).items():
            counts[int(k)] = counts.get(int(k), 0) + int(n)
    if counts:
        xs = sorted(counts)
        ax.bar(xs, [counts[x] for x in xs], color="#1f77b4")
        ax.set_xticks(xs)
    ax.set_xlabel("staleness (trainer version - generating version)")
    ax.set_ylabel("trajectories")
    ax.set_title("staleness of trained trajectories")
    save(fig, "staleness.png")

    # rollout timeline
    names = sorted({n for s in samples for n in s["rollouts"]})
    fig, ax = plt.subplots(figsize=(10, 1.0 + 0.7 * max(1, len(names))))
    lane = {n: i for i, n in enumerate(names)}
    for a, b in pairwise(samples):
        for name, r in a["rollouts"].items():
            colour = (
                PHASE_COLOUR.get(r["phase"], DEAD_COLOUR)
                if r.get("state", "alive") == "alive"
                else DEAD_COLOUR
            )
            y = lane[name]
            span = ((a["time"] - t0) / 60, (b["time"] - a["time"]) / 60)
            shade = 0.35 + 0.65 * min(1.0, r["kv"] * 2)
            ax.broken_barh([span], (y - 0.35, 0.7), color=colour, alpha=shade, linewidth=0)
            # episodes out of the engine, waiting for the environment: a bar from the lane's
            # bottom, as tall as their share of the rollout's trajectories
            share = r.get("env_waiting", 0) / max(1, r.get("in_flight", 0))
            if share > 0:
                ax.broken_barh([span], (y - 0.35, 0.7 * share), color=ENV_COLOUR, linewidth=0)
    for e in events:
        d = e.get("data", {})
        x = (e["at"] - t0) / 60
        if e["kind"] == "pull" and d.get("rollout") in lane:
            ax.plot([x], [lane[d["rollout"]]], "v", color="black", ms=5)
        elif e["kind"] == "repack":
            for m in d.get("moves", []):
                src, dst = m.get("source"), m.get("destination")
                if src in lane and dst in lane:
                    arrow = {"arrowstyle": "->", "color": "#d62728", "lw": 1.5}
                    ax.annotate("", xy=(x, lane[dst]), xytext=(x, lane[src]), arrowprops=arrow)
    ax.set_yticks(range(len(names)), names)
    ax.set_ylim(-0.6, max(0.6, len(names) - 0.4))
    ax.set_xlabel("wall time (min)")
    ax.set_title(
        "rollouts: generating (green; darker = fuller KV cache), switching weights (amber),\n"
        "drained (purple), dead (red); blue from below: share of episodes waiting for the "
        "environment; ▼ weight pull; red arrow: repack move",
        fontsize=9,
    )
    save(fig, "timeline.png")
    return written


def _legend(ax: Any, loc: str, empty: str) -> None:
    """The legend of what ``ax`` shows, or ``empty`` across it if it shows nothing (a run stopped
    before its first version: matplotlib would warn that it has nothing to put in a legend)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc=loc)
    else:
        ax.text(0.5, 0.5, empty, transform=ax.transAxes, ha="center", va="center", color="grey")


def _generation_rate(samples: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    ts, rates = [], []
    for a, b in pairwise(samples):
        dt = b["time"] - a["time"]
        if dt <= 0:
            continue
        total = 0
        for name, r in b["rollouts"].items():
            before = a["rollouts"].get(name)
            if before is not None:
                total += max(0, r["generated_tokens"] - before["generated_tokens"])
        ts.append(b["time"])
        rates.append(total / dt)
    return ts, rates


def _smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over ``window`` points (shorter at the start)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out
