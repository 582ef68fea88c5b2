"""What a dev-mode run shows while it runs: a progress line, or a live panel.

The numbers come from :mod:`laminar.tracking.progress` (samples in, a ``Progress`` out); this
module only renders them.
"""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from laminar.roles.rollout.api import RolloutPhase
from laminar.tracking.progress import Progress, alive

PHASE_STYLE = {
    RolloutPhase.RUNNING: "green",
    RolloutPhase.SWITCHING: "yellow",
    RolloutPhase.DRAINING: "magenta",
}


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def progress_line(p: Progress) -> str:
    """One line for logs and pipes: live rollouts as ``rollout-0:running@v3``. Dead (or
    departed) members leave it: their last heartbeat's phase and version are no longer true, and
    the membership table printed on every change says who is down."""
    acc = _fmt(p.accuracy, ".3f")
    if p.accuracy is not None and p.accuracy_start is not None:
        acc += f" ({p.accuracy - p.accuracy_start:+.3f})"
    phases = " ".join(
        f"{name}:{r['phase']}@v{r['version']}" for name, r in sorted(p.rollouts.items()) if alive(r)
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
        if not alive(r):  # its last heartbeat's numbers are no longer true
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
