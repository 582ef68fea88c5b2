"""Atomic trainer checkpoints: the policy (an HF directory), optimizer, version and buffer cursor.

A checkpoint is written into a temporary directory and renamed into place, then ``latest`` (a
small file naming it) is replaced atomically; a trainer killed at any instant leaves either the
previous checkpoint or the new one, never half of one. The checkpoint directory is itself a
loadable HF model (``from_pretrained`` works on it, so do ``laminar eval`` and vLLM).

``cursor`` is the data role's consumption cursor after this version's batch: on restart the
trainer asks for trajectories *after* it, so the ones it took but never committed come back in
the same order and nothing is trained twice or skipped. ``history.jsonl`` carries, for every
version so far, the consume-seq range and trajectory ids it trained on (copied forward into each
checkpoint, so pruning old checkpoints loses nothing). A version whose batch was screened
(:mod:`laminar.rl.screen`) also lists the ``excluded`` ids per reason, and ``skipped_steps``
when optimizer steps were skipped as non-finite: consumed, deliberately not trained.

Durability: every file of a checkpoint is fsynced, then its directory is renamed into place and
the parent directory fsynced, and only then is the pointer written, fsynced, renamed and the
parent fsynced again; after a power loss the pointer never names a checkpoint that is not on disk.
A pointer that is nevertheless missing, unreadable or names a broken checkpoint is not taken as
"no checkpoint": :func:`latest_checkpoint` falls back to the newest checkpoint that validates
(:func:`validate_checkpoint`), and raises :class:`CheckpointError` when checkpoints exist but none
is usable. Training silently restarting at version 0 would reuse every version number and
retrain every trajectory.

``published`` (:func:`record_published`) is the highest version ever handed to the relays, written
and fsynced *before* its first byte leaves the trainer. With ``checkpoint.every > 1`` versions are
published that no checkpoint holds; a restarted trainer continues after this mark instead of
reusing their numbers (relays keep the old, higher versions, so a reused number is ignored by
every rollout and staleness goes negative). It lives on the trainer's own disk, beside the
checkpoints it qualifies, rather than being asked of the master relay: it holds when every relay
restarted too, or none is reachable at start-up. (The publisher also refuses to push below what
the master holds: :class:`laminar.weights.transfer.VersionConflict`, a second line of defence.)
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

_SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)
POINTER = "latest"  # names the checkpoint to resume from
PUBLISHED = "published"  # the highest version ever handed to the relays


@dataclass
class TrainingState:
    version: int = 0
    cursor: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    path: str | None = None  # the checkpoint directory it was loaded from


class CheckpointError(RuntimeError):
    """Checkpoints exist but none can be resumed from; the message names each and why."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, text: str) -> None:
    """Replace ``path`` by ``text`` atomically and durably (tmp file, fsync, rename, fsync dir)."""
    tmp = path.parent / f".{path.name}-{os.getpid()}"
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def save_checkpoint(
    root: str | Path,
    state: TrainingState,
    model: Any,  # an HF PreTrainedModel (save_pretrained)
    optim_state: dict[str, Any],
    source_model: str | Path,
    keep: int,
    *,
    saved_at: float,
    model_state: dict[str, torch.Tensor] | None = None,
) -> Path:
    """``saved_at``: the wall time to record (from the service's clock). ``model_state``: the
    whole weights when ``model``'s own are sharded (its config and class still name the model)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"v{state.version:06d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True, state_dict=model_state)
    for name in _SIDE_FILES:
        src = Path(source_model) / name
        if src.exists():
            shutil.copy2(src, tmp / name)
    torch.save(optim_state, tmp / "optimizer.pt")
    (tmp / "history.jsonl").write_text("".join(json.dumps(h) + "\n" for h in state.history))
    meta = {"version": state.version, "cursor": state.cursor, "saved_at": saved_at}
    (tmp / "trainer_state.json").write_text(json.dumps(meta))
    for f in tmp.iterdir():
        with f.open("rb") as fh:
            os.fsync(fh.fileno())
    _fsync_dir(tmp)
    shutil.rmtree(final, ignore_errors=True)  # a leftover from a run that died after the rename
    os.replace(tmp, final)
    _fsync_dir(root)  # the directory's new name is on disk before the pointer names it
    _write_durably(root / POINTER, final.name)
    _prune(root, keep, final.name)
    return final


def _prune(root: Path, keep: int, newest: str) -> None:
    done = sorted(p for p in root.glob("v[0-9]*") if p.is_dir())
    for old in done[:-keep]:
        if old.name != newest:
            shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _version_of(name: str) -> int | None:
    return int(name[1:]) if name.startswith("v") and name[1:].isdigit() else None


def validate_checkpoint(path: str | Path) -> TrainingState:
    """The state of a resumable checkpoint; :class:`CheckpointError` saying what is wrong.

    Cheap (no tensor is read): the state and history parse, the version matches the directory
    name, and the model config, the optimizer state and every weight file are there, each
    safetensors file with a readable header (a file cut short by a crash fails here)."""
    path = Path(path)
    try:
        state = load_state(path)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: unreadable trainer state ({exc})") from exc
    if not isinstance(state.version, int) or not isinstance(state.cursor, int):
        raise CheckpointError(f"{path}: version and cursor must be integers")
    if _version_of(path.name) != state.version:
        raise CheckpointError(f"{path}: holds version {state.version}, not its name's")
    for name in ("config.json", "optimizer.pt"):
        if not (path / name).is_file() or (path / name).stat().st_size == 0:
            raise CheckpointError(f"{path}: {name} missing or empty")
    weights = _weight_files(path)
    if not weights:
        raise CheckpointError(f"{path}: no model weights")
    from safetensors import safe_open

    for w in weights:
        try:
            with safe_open(str(w), framework="pt") as f:
                f.keys()
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(f"{path}: {w.name} is not a readable safetensors file") from exc
    return state


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError) as exc:
            raise CheckpointError(f"{path}: unreadable {index.name} ({exc})") from exc
        return [path / s for s in sorted(shards)]
    single = path / "model.safetensors"
    return [single] if single.is_file() else []


def latest_checkpoint(
    root: str | Path, on_problem: Callable[[str], None] | None = None
) -> Path | None:
    """The checkpoint to resume from: the one ``latest`` names if it validates, else the newest
    one that does (each problem passed to ``on_problem``); None only when there is none at all.

    Raises :class:`CheckpointError` when a pointer or checkpoint directories exist but nothing
    validates: resuming at version 0 then would silently redo the whole run."""
    root = Path(root)
    pointer = root / POINTER
    problems: list[str] = []
    named: Path | None = None
    if pointer.exists():
        try:
            text = pointer.read_text().strip()
            if _version_of(text) is None:
                raise ValueError(f"names {text!r}")
            named = root / text
            validate_checkpoint(named)
            return named
        except (OSError, ValueError, CheckpointError) as exc:
            problems.append(f"pointer {pointer} is unusable: {exc}")
    candidates = sorted(
        (p for p in root.glob("v[0-9]*") if p.is_dir() and _version_of(p.name) is not None),
        key=lambda p: _version_of(p.name) or 0,
        reverse=True,
    )
    for path in candidates:
        if path == named:
            continue
        try:
            validate_checkpoint(path)
        except CheckpointError as exc:
            problems.append(str(exc))
            continue
        for problem in problems:
            if on_problem is not None:
                on_problem(problem)
        if on_problem is not None:
            on_problem(f"falling back to {path.name}, the newest checkpoint that validates")
        return path
    if problems or candidates:
        raise CheckpointError(
            f"no usable checkpoint in {root} (refusing to restart training at version 0; "
            "move the directory away to start afresh): " + "; ".join(problems)
        )
    return None


def load_state(path: str | Path) -> TrainingState:
    path = Path(path)
    meta = json.loads((path / "trainer_state.json").read_text())
    history_file = path / "history.jsonl"
    history = [json.loads(line) for line in history_file.read_text().splitlines() if line]
    return TrainingState(meta["version"], meta["cursor"], history, str(path))


def record_published(root: str | Path, version: int) -> None:
    """Durably note that ``version`` is about to reach the relays (see the module docstring)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    _write_durably(root / PUBLISHED, f"{version}\n")


def published_mark(root: str | Path, on_problem: Callable[[str], None] | None = None) -> int:
    """The highest version ever handed to the relays from this checkpoint directory (-1: none).

    An unreadable mark falls back to the highest checkpoint directory's version (what the mark
    is at least) and reports it; the publisher's conflict check covers the rest."""
    root = Path(root)
    path = root / PUBLISHED
    if not path.exists():
        return -1
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError) as exc:
        versions = [_version_of(p.name) for p in root.glob("v[0-9]*")]
        floor = max((v for v in versions if v is not None), default=-1)
        if on_problem is not None:
            on_problem(f"{path} is unreadable ({exc}); assuming v{floor}")
        return floor


def load_training_state(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Model and optimizer state dicts of a checkpoint (``weights_only``: no code runs)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    optim = torch.load(Path(path) / "optimizer.pt", weights_only=True)
    return model.state_dict(), optim
