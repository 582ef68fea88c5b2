"""Where a run's trackers write (:class:`TrackingPlan`), and what ``laminar run`` prints of it."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import TrackingConfig, WandbConfig


@dataclass(frozen=True)
class TrackingPlan:
    """Where a run's trackers write: ``tensorboard`` is the root (``<root>/<job>`` per process),
    ``base`` the run directory (W&B's default dir, names and run-id files)."""

    tensorboard: Path | None
    wandb: WandbConfig | None
    base: Path | None

    @classmethod
    def of(cls, cfg: TrackingConfig, base: str | Path | None) -> TrackingPlan:
        """The plan of ``cfg`` for a run whose directory is ``base`` (the metrics file's)."""
        root: Path | None = None
        if isinstance(cfg.tensorboard, str):
            root = Path(cfg.tensorboard)
        elif cfg.tensorboard and base is not None:
            root = Path(base) / "tensorboard"
        return cls(root, cfg.wandb, Path(base) if base is not None else None)

    @property
    def enabled(self) -> bool:
        return self.tensorboard is not None or self.wandb is not None

    def run_name(self) -> str:
        if self.base is None:
            return "laminar"
        return self.base.resolve().name

    def hints(self) -> list[str]:
        """What ``laminar run`` prints at start: how to look at this run."""
        out = []
        if self.tensorboard is not None:
            command = _tensorboard_command()
            out.append(
                f"TensorBoard: {command or 'pip install tensorboard; tensorboard'} "
                f"--logdir {_short(self.tensorboard)}"
            )
        w = self.wandb
        if w is not None:
            if importlib.util.find_spec("wandb") is None:
                out.append(
                    "W&B is configured but the wandb package is missing "
                    "(pip install 'laminar-rl[wandb]'); the run goes on without it"
                )
            else:
                where = _short(self.wandb_dir() / "wandb")
                mode = w.mode or os.environ.get("WANDB_MODE") or "online"
                what = f"W&B: project {w.project}, group {w.group or self.run_name()}"
                if mode == "offline":
                    what += f", offline in {where} (upload: wandb sync {where}/offline-run-*)"
                elif mode != "disabled":
                    what += " (the trainer logs the run's URL)"
                out.append(what)
        return out

    def wandb_dir(self) -> Path:
        """Where W&B writes its ``wandb/`` folder."""
        if self.wandb is not None and self.wandb.dir is not None:
            return Path(self.wandb.dir)
        return self.base if self.base is not None else Path.cwd()


TRAINER_ROLES = ("trainer", "sim_trainer")


def plan_for_run(
    config: Any, roles: Sequence[tuple[str, str, Mapping[str, Any]]], run_dir: Path
) -> TrackingPlan:
    """``laminar run``'s plan: the trainer's (``roles``: each process's role, config section
    and overrides; ``config`` the :class:`~laminar.runtime.config.LaminarConfig`), which the
    cluster's
    scalars share; under ``run_dir`` when no trainer writes a metrics file."""
    from ..roles_registry import load_role_config  # the trainer's model, for its defaults

    for role, section, overrides in roles:
        if role in TRAINER_ROLES:
            _, model = load_role_config(role)
            cfg = config.role_config(section, model, dict(overrides))
            metrics = getattr(cfg, "metrics_file", None)
            return TrackingPlan.of(cfg.tracking, Path(metrics).parent if metrics else run_dir)
    return TrackingPlan.of(TrackingConfig(), run_dir)


def _short(path: Path) -> str:
    """A path as a person would type it: through no links, relative to here if below."""
    real = path.resolve()
    try:
        return str(real.relative_to(Path.cwd()))
    except ValueError:
        return str(real)


def _tensorboard_command() -> str | None:
    """``tensorboard`` when it is on PATH, else the one installed beside this Python (a venv
    not activated), else None (a dependency of Laminar, but installed without its scripts)."""
    if shutil.which("tensorboard"):
        return "tensorboard"
    beside = Path(sys.executable).parent / "tensorboard"
    return _short(beside) if beside.exists() else None
