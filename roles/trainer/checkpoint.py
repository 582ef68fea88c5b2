"""Atomic trainer checkpoints: the policy (an HF directory), optimizer, version and buffer cursor.

A checkpoint is written into a temporary directory and renamed into place, then ``latest`` (a
small file naming it) is replaced atomically; a trainer killed at any instant leaves either the
previous checkpoint or the new one, never half of one. The checkpoint directory is itself a
loadable HF model (``from_pretrained`` works on it, so do ``laminar eval`` and vLLM).

``cursor`` is the data role's consumption cursor after this version's batch: on restart the
trainer asks for trajectories *after* it, so the ones it took but never committed come back in
the same order and nothing is trained twice or skipped. ``history.jsonl`` carries, for every
version so far, the consume-seq range and trajectory ids it trained on (copied forward into each
checkpoint, so pruning old checkpoints loses nothing).
"""

from __future__ import annotations

import json
import os
import shutil
import time
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


@dataclass
class TrainingState:
    version: int = 0
    cursor: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    path: str | None = None  # the checkpoint directory it was loaded from


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    root: str | Path,
    state: TrainingState,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    source_model: str | Path,
    keep: int,
) -> Path:
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"v{state.version:06d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for name in _SIDE_FILES:
        src = Path(source_model) / name
        if src.exists():
            shutil.copy2(src, tmp / name)
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    (tmp / "history.jsonl").write_text("".join(json.dumps(h) + "\n" for h in state.history))
    meta = {"version": state.version, "cursor": state.cursor, "saved_at": time.time()}
    (tmp / "trainer_state.json").write_text(json.dumps(meta))
    for f in tmp.iterdir():
        with f.open("rb") as fh:
            os.fsync(fh.fileno())
    shutil.rmtree(final, ignore_errors=True)  # a leftover from a run that died after the rename
    os.replace(tmp, final)
    latest_tmp = root / f".latest-{os.getpid()}"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, root / "latest")
    _fsync_dir(root)
    _prune(root, keep, final.name)
    return final


def _prune(root: Path, keep: int, newest: str) -> None:
    done = sorted(p for p in root.glob("v[0-9]*") if p.is_dir())
    for old in done[:-keep]:
        if old.name != newest:
            shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


def latest_checkpoint(root: str | Path) -> Path | None:
    pointer = Path(root) / "latest"
    if not pointer.exists():
        return None
    path = Path(root) / pointer.read_text().strip()
    return path if (path / "trainer_state.json").exists() else None


def load_state(path: str | Path) -> TrainingState:
    path = Path(path)
    meta = json.loads((path / "trainer_state.json").read_text())
    history_file = path / "history.jsonl"
    history = [json.loads(line) for line in history_file.read_text().splitlines() if line]
    return TrainingState(meta["version"], meta["cursor"], history, str(path))


def load_training_state(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Model and optimizer state dicts of a checkpoint (``weights_only``: no code runs)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    optim = torch.load(Path(path) / "optimizer.pt", weights_only=True)
    return model.state_dict(), optim
