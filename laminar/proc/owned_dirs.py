"""Temporary directories that belong to one process, and are removed even when it is killed.

Why this exists: vLLM names the ZMQ ``ipc://`` endpoints between its front end, engine core and
workers ``<VLLM_RPC_BASE_PATH>/<uuid4>`` (the system temp directory by default), and only a socket
closed by the process that bound it unlinks its file. On CPU the rollout kills its engine's
processes at close (:meth:`laminar.engines.vllm_engine.VllmEngine.close`), and a rollout killed
with -9 has its engine killed by the owner watch (:mod:`laminar.engines.vllm_worker`), so every
engine start would leave its socket files in ``/tmp``, and a machine that runs the suite again
and again would collect hundreds of them.

So each engine gets a directory of its own for those endpoints, named after its owner, the
rollout process, by pid *and* start time (a recycled pid starts later; see
:mod:`laminar.proc.procfs`): ``laminar-vllm-<pid>-<start>-<random>``. Four removers, so that a
directory outlives its owner only until its launcher has ended the owner's process group, or
until the next start on the host:

* the owner, when it closes the engine (:func:`remove`);
* the engine's owner watch, after the owner died and before it kills the engine;
* the launcher, once it has ended a role's process group (:func:`sweep`, called by
  :func:`laminar.proc.spawn.end_role_groups`): a rollout SIGKILLed and its group ended at once
  leave the two above no time;
* the next owner that makes one (:func:`make`), which sweeps every such directory of this user
  whose owner is gone (a launcher killed with its roles leaves nobody else to do it).

The sweep reads liveness from this process's ``/proc``: an owner in another pid namespace that
shares this temp directory would read as gone, and its live engine's sockets lose their names
(connections made stay up; new ones fail). Containers have a ``/tmp`` of their own as a rule;
where they share one, give each its own ``TMPDIR``.

Standard library only, as :mod:`laminar.proc.procfs`: the owner watch imports it inside vLLM's
processes.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from . import procfs

#: every owned directory's name starts with ``<prefix>-<pid>-<start>-``
PREFIX = "laminar-vllm"
#: the longest ``sun_path`` Linux takes; vLLM appends ``/`` and a 36-character uuid
_SUN_PATH = 107


def make(prefix: str = PREFIX, root: str | None = None) -> tuple[Path, list[Path]]:
    """A fresh private directory (mode 0700) owned by this process under ``root`` (the system
    temp directory), and the stale ones this call swept first."""
    root = root or tempfile.gettempdir()
    swept = sweep(prefix, root)
    pid = os.getpid()
    stat = procfs.stat(pid)
    path = Path(tempfile.mkdtemp(prefix=f"{prefix}-{pid}-{stat.start if stat else 0}-", dir=root))
    longest = _SUN_PATH - 37
    if len(str(path)) > longest:  # vLLM's endpoints would not bind: say why here
        remove(path)
        raise ValueError(
            f"{path}: {len(str(path))} characters, too long a path for vLLM's socket files "
            f"inside it (at most {longest}): set TMPDIR to a shorter directory"
        )
    return path, swept


def owner(path: str | Path, prefix: str = PREFIX) -> tuple[int, int] | None:
    """``(pid, start)`` of the process an owned directory names; None if ``path`` is not one."""
    name = Path(path).name
    if not name.startswith(prefix + "-"):
        return None
    parts = name[len(prefix) + 1 :].split("-")
    if len(parts) != 3 or not (parts[0].isdigit() and parts[1].isdigit()):
        return None
    return int(parts[0]), int(parts[1])


def sweep(prefix: str = PREFIX, root: str | None = None) -> list[Path]:
    """Remove this user's owned directories under ``root`` whose owner is gone; those removed.

    Another user's are left alone (their owner sweeps them), as is anything not named as
    :func:`make` names them."""
    root = root or tempfile.gettempdir()
    swept: list[Path] = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return swept
    for entry in entries:
        named = owner(entry.name, prefix)
        if named is None:
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat().st_uid != os.getuid():
                continue
        except OSError:
            continue
        if not procfs.alive(*named):
            remove(entry.path)
            swept.append(Path(entry.path))
    return swept


def remove(path: str | Path) -> None:
    """Remove an owned directory and what is in it (sockets); nothing if it is gone already."""
    shutil.rmtree(path, ignore_errors=True)
