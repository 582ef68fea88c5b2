"""What a role's config says about tracking: the ``tracking`` section of the trainers' configs.

Kept apart from the machinery (no threads, no backends) because the trainers' config models
import it, and ``laminar doctor`` loads those models without the rest of the trainer."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from laminar.runtime.config import Strict


class WandbConfig(Strict):
    """A W&B run per process that tracks (the trainer; the supervisor in dev mode)."""

    project: str = Field(description="W&B project.")
    entity: str | None = Field(None, description="W&B entity (team or user; unset: your default).")
    name: str | None = Field(
        None,
        description="Run name (unset: the run directory's name); `-trainer` or `-cluster` added.",
    )
    group: str | None = Field(
        None, description="W&B group (unset: the run directory's name): a run's processes."
    )
    tags: list[str] = Field(default_factory=list, description="W&B tags.")
    mode: Literal["online", "offline", "disabled"] | None = Field(
        None,
        description="offline: write locally, no account or network (`wandb sync` uploads later); "
        "unset: W&B's default (the WANDB_MODE variable, else online).",
    )
    dir: str | None = Field(
        None, description="Where W&B writes its `wandb/` folder (unset: the run directory)."
    )


class TrackingConfig(Strict):
    """Where the trainer's records and evaluations go besides ``metrics_file``
    (:mod:`laminar.tracking`)."""

    tensorboard: bool | str = Field(
        True,
        description="TensorBoard event files: true: `tensorboard/` beside `metrics_file` (none "
        "without one); a directory; false: off. The trainer writes `<dir>/trainer`, `laminar "
        "run` `<dir>/cluster`.",
    )
    wandb: WandbConfig | None = Field(
        None, description="Weights & Biases (unset: off; needs `pip install 'laminar-rl[wandb]'`)."
    )
