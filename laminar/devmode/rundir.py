"""Where a dev-mode run keeps its files, and how ``--resume`` finds them again.

``run.run_dir`` (default ``runs/latest``) is the path every role's config refers to (the data
role's store, the trainer's checkpoints and metrics, ``cluster.json``). Each ``laminar run``
makes a fresh directory beside it, ``<cluster.name>-<YYYYmmdd-HHMMSS>``, and points ``run_dir``
at it with a symlink, so configs stay the same, old runs stay on disk, and a new run never
trains on a previous run's leftover trajectories. ``--resume`` keeps the directory the link points
to (or the one given) and continues it: the trainer restarts from its newest checkpoint with its
consumption cursor and the data role from its durable store.

A ``run_dir`` that is a real directory rather than a link was made by hand (or by an older
version); a new run refuses to reuse it silently: ``--resume`` continues it, anything else is an
error that says so.

A run directory holds the cluster token, the logs and the data store, so it is made (and, on
``--resume``, made again) readable by this user only: mode 0700, whatever the umask.
"""

from __future__ import annotations

import time
from pathlib import Path

from laminar.runtime.errors import ConfigError


def prepare_run_dir(
    run_dir: str | Path, name: str, resume: bool | str = False, now: float | None = None
) -> tuple[Path, bool]:
    """Make or find the run's directory; returns ``(real directory, resumed)``."""
    link = Path(run_dir)
    if resume:
        target = Path(resume) if isinstance(resume, str) else link
        if not target.exists():
            raise ConfigError(f"--resume: {target} does not exist (nothing to continue)")
        real = target.resolve()
        if not real.is_dir():
            raise ConfigError(f"--resume: {target} is not a directory")
        if target != link:
            _point(link, real)
        real.chmod(0o700)  # a run made by an older version, or by hand, may be world-readable
        return real, True
    if link.exists() and not link.is_symlink():
        if not any(link.iterdir()):  # an empty directory made for this run: use it
            link.chmod(0o700)
            return link.resolve(), False
        raise ConfigError(
            f"{link} is a directory with files from an earlier run, not a link to a run; "
            f"pass --resume to continue it, or move it away to start a new run"
        )
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    parent = link.parent
    parent.mkdir(parents=True, exist_ok=True)
    real = parent / f"{name}-{stamp}"
    n = 1
    while real.exists():
        n += 1
        real = parent / f"{name}-{stamp}-{n}"
    real.mkdir(mode=0o700)
    real.chmod(0o700)  # mkdir's mode is masked by the umask; this one is not
    _point(link, real.resolve())
    return real.resolve(), False


def _point(link: Path, target: Path) -> None:
    """Atomically (re)point ``link`` at ``target`` (relative when they share a parent)."""
    if link.exists() and not link.is_symlink():
        raise ConfigError(f"{link} is a real directory; cannot point it at {target}")
    link.parent.mkdir(parents=True, exist_ok=True)
    rel = target.name if target.parent == link.parent.resolve() else str(target)
    tmp = link.with_name(f".{link.name}.tmp")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(rel)
    tmp.replace(link)
