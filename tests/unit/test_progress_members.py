"""Dead members leave the progress line; the panel keeps them, marked dead, never with their last
heartbeat's state."""

from __future__ import annotations

from types import SimpleNamespace

from rich.console import Console

from laminar.devmode.progress import progress_line, render_progress
from laminar.tracking.progress import cluster_sample, summarize


def _member(name: str, state: str, version: int) -> SimpleNamespace:
    stats = {"version": version, "kv_cache_usage": 0.5, "running": 3, "generated_tokens": 900}
    return SimpleNamespace(instance=name, role="rollout", state=state, stats=stats)


def test_dead_rollouts_leave_the_progress_line_and_are_marked_dead_in_the_panel() -> None:
    members = [
        _member("rollout-0", "alive", 39),
        _member("rollout-1", "dead", 39),
        _member("rollout-2", "left", 38),
    ]
    p = summarize(None, [cluster_sample(members, now=10.0)], started=0.0, now=10.0)
    line = progress_line(p)
    assert line.endswith("  rollout-0:running@v39"), line
    assert "rollout-1" not in line and "rollout-2" not in line, line

    console = Console(width=120, record=True)
    console.print(render_progress(p))
    rows = {ln.split()[0]: ln.split()[1:] for ln in console.export_text().splitlines() if ln}
    assert rows["rollout-0"][:3] == ["running", "39", "50.0%"], rows
    assert rows["rollout-1"] == ["dead", "-", "-", "-", "-"], rows
    assert rows["rollout-2"] == ["left", "-", "-", "-", "-"], rows
