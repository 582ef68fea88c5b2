"""What is tracked: the trainer's metrics-file lines (:func:`record_scalars`, through
:class:`TrainerTracking`) and the supervisor's cluster samples (:func:`cluster_scalars`)."""

from __future__ import annotations

from collections.abc import Mapping
from numbers import Real
from pathlib import Path
from typing import Any

from laminar.roles.rollout.api import RolloutPhase

from .config import TrackingConfig
from .plan import TrackingPlan
from .progress import Progress, alive
from .worker import open_tracker

# Record keys that are not measurements: the step itself, bookkeeping, absolute timestamps.
NOT_SCALARS = frozenset(
    {"version", "cursor", "time", "eval", "sampled_at", "train_start", "train_end", "published_at"}
)
#: a live rollout's phases, each counted in ``cluster/rollouts_<phase>``
PHASES = tuple(phase.value for phase in RolloutPhase)


def record_scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """A metrics-file line as tags: a version record's numbers as ``train/<key>``, an eval
    line's (``"eval": true``) as ``eval/<key>``. Nested, non-numeric and boolean values and the
    keys in :data:`NOT_SCALARS` are left out (the JSONL keeps them)."""
    prefix = "eval" if record.get("eval") else "train"
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in NOT_SCALARS or isinstance(value, bool) or not isinstance(value, Real):
            continue
        out[f"{prefix}/{key}"] = float(value)
    return out


class TrainerTracking:
    """The trainers' side (``trainer`` and ``sim_trainer`` share it): each metrics-file line goes
    to the tracker at step = its version, plus ``train/tokens_per_s``, the trained tokens over
    the wall time since the previous version (on the caller's clock)."""

    def __init__(
        self,
        cfg: TrackingConfig,
        metrics_file: str | None,
        log: Any = None,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        base = Path(metrics_file).parent if metrics_file else None
        self.plan = TrackingPlan.of(cfg, base)
        self.tracker = open_tracker(self.plan, "trainer", log, config)
        self._last: float | None = None

    def record(self, record: Mapping[str, Any], now: float) -> None:
        scalars = record_scalars(record)
        if not record.get("eval"):
            tokens = record.get("tokens")
            if self._last is not None and now > self._last and isinstance(tokens, Real):
                scalars["train/tokens_per_s"] = float(tokens) / (now - self._last)
            self._last = now
        if scalars and "version" in record:
            self.tracker.log(int(record["version"]), scalars)

    def close(self, timeout: float = 5.0) -> None:
        """Within ``timeout``: a stopping role has ``run.shutdown_grace_s`` before SIGKILL."""
        self.tracker.close(timeout)


def cluster_scalars(p: Progress) -> dict[str, float]:
    """The supervisor's view of one sample: totals under ``cluster/``, each rollout's own
    numbers under ``rollout/<name>/``. Rollouts that are not alive count only in
    ``rollouts_down``."""
    out: dict[str, float] = {}
    up = {n: r for n, r in p.rollouts.items() if alive(r)}
    out["cluster/generated_tokens_per_s"] = sum(p.rollout_tokens_per_s.values())
    if p.trained_tokens_per_s is not None:
        out["cluster/trained_tokens_per_s"] = p.trained_tokens_per_s
    if p.version is not None:
        out["cluster/trainer_version"] = p.version
    for phase in PHASES:
        out[f"cluster/rollouts_{phase}"] = sum(r["phase"] == phase for r in up.values())
    out["cluster/rollouts_down"] = len(p.rollouts) - len(up)
    if up:
        kv = [r["kv"] for r in up.values()]
        out["cluster/kv_use_mean"] = sum(kv) / len(kv)
        out["cluster/kv_use_max"] = max(kv)
    for key in ("running", "waiting", "in_flight"):
        out[f"cluster/sequences_{key}"] = sum(r[key] for r in up.values())
    for name, r in up.items():
        out[f"rollout/{name}/generated_tokens_per_s"] = p.rollout_tokens_per_s.get(name, 0.0)
        out[f"rollout/{name}/kv_use"] = r["kv"]
        out[f"rollout/{name}/version"] = r["version"]
    return out
