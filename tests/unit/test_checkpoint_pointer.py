"""The checkpoint pointer: durable before it is trusted, and never a silent restart at version 0.

A ``latest`` pointer that is empty, garbage or names a missing or broken checkpoint used to read
as "no checkpoint", and the trainer started over at version 0 (issue 15): every version number
reused, every trajectory trained again. Now the newest checkpoint that validates is used, and a
directory with checkpoints but none usable is a loud error.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from laminar.roles.trainer import checkpoint as ckpt
from laminar.roles.trainer.checkpoint import (
    CheckpointError,
    TrainingState,
    latest_checkpoint,
    load_state,
    published_mark,
    record_published,
    save_checkpoint,
)

from ..support.models import tiny_qwen2


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint directory holding v1 and v2 (pointer on v2), built once."""
    tmp = tmp_path_factory.mktemp("pristine")
    model_dir = tiny_qwen2(tmp / "model")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    root = tmp / "ckpt"
    for version in (1, 2):
        state = TrainingState(version, 8 * version, [{"version": v} for v in range(1, version + 1)])
        save_checkpoint(root, state, model, optimizer.state_dict(), model_dir, keep=3, saved_at=0.0)
    return root


@pytest.fixture
def saved(pristine: Path, tmp_path: Path) -> Path:
    """A copy of ``pristine`` for one test to damage."""
    return Path(shutil.copytree(pristine, tmp_path / "ckpt"))


def test_a_valid_pointer_is_followed(saved: Path) -> None:
    assert (saved / "latest").read_text() == "v000002"
    assert latest_checkpoint(saved) == saved / "v000002"


@pytest.mark.parametrize(
    "pointer", ["", "\x00\x00\x00", "v000009", "../elsewhere"], ids=["empty", "nul", "gone", "odd"]
)
def test_a_broken_pointer_falls_back_to_the_newest_valid_checkpoint(
    saved: Path, pointer: str
) -> None:
    (saved / "latest").write_text(pointer)
    problems: list[str] = []
    found = latest_checkpoint(saved, problems.append)
    assert found == saved / "v000002"
    assert load_state(found).version == 2
    assert any("pointer" in p for p in problems) and "falling back to v000002" in problems[-1]


def test_a_missing_pointer_with_checkpoints_uses_the_newest(saved: Path) -> None:
    (saved / "latest").unlink()
    assert latest_checkpoint(saved) == saved / "v000002"


@pytest.mark.parametrize("damage", ["header", "truncated", "state", "optimizer", "version"])
def test_a_broken_newest_checkpoint_falls_back_to_the_previous(saved: Path, damage: str) -> None:
    newest = saved / "v000002"
    weights = newest / "model.safetensors"
    if damage == "header":  # the safetensors header no longer parses
        weights.write_bytes(b"\x10\x00")
    elif damage == "truncated":  # cut short by a crash: the header promises more than is there
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "state":
        (newest / "trainer_state.json").write_text('{"version": 2, "cur')
    elif damage == "optimizer":
        (newest / "optimizer.pt").unlink()
    else:  # a directory holding another version than its name says
        (newest / "trainer_state.json").write_text('{"version": 5, "cursor": 40}')
    problems: list[str] = []
    assert latest_checkpoint(saved, problems.append) == saved / "v000001"
    assert any("v000002" in p for p in problems), problems


def test_checkpoints_but_none_usable_is_a_loud_error(saved: Path) -> None:
    for version in ("v000001", "v000002"):
        (saved / version / "trainer_state.json").unlink()
    with pytest.raises(CheckpointError, match="refusing to restart training at version 0"):
        latest_checkpoint(saved)


def test_no_checkpoint_at_all_is_a_fresh_start(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path / "none") is None
    assert latest_checkpoint(tmp_path) is None


def test_the_pointer_is_fsynced_before_its_rename_and_names_a_durable_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The order of the syscalls that make a checkpoint durable (real calls, recorded): every
    file and the new directory's name are on disk before the pointer names it, and the pointer's
    bytes before its rename."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst) -> None:  # type: ignore[no-untyped-def]
        events.append(("replace", f"{Path(src).name}->{Path(dst).name}"))
        real_replace(src, dst)

    monkeypatch.setattr(ckpt.os, "fsync", fsync)
    monkeypatch.setattr(ckpt.os, "replace", replace)
    model_dir = tiny_qwen2(tmp_path / "model")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    root = (tmp_path / "ckpt").resolve()
    save_checkpoint(
        root, TrainingState(3, 24), model, optimizer.state_dict(), model_dir, keep=2, saved_at=0.0
    )

    def index(kind: str, predicate) -> int:  # type: ignore[no-untyped-def]
        return next(i for i, (k, what) in enumerate(events) if k == kind and predicate(what))

    dir_rename = index("replace", lambda w: w.endswith("->v000003"))
    pointer_rename = index("replace", lambda w: w.endswith("->latest"))
    pointer_tmp = events[pointer_rename][1].split("->")[0]
    assert index("fsync", lambda w: w.endswith("trainer_state.json")) < dir_rename
    root_synced = [i for i, (k, w) in enumerate(events) if k == "fsync" and w == str(root)]
    assert any(dir_rename < i < pointer_rename for i in root_synced), events
    assert index("fsync", lambda w: w.endswith(pointer_tmp)) < pointer_rename, events
    assert any(i > pointer_rename for i in root_synced), events
    assert (root / "latest").read_text() == "v000003"


def test_the_published_mark(tmp_path: Path) -> None:
    assert published_mark(tmp_path) == -1
    record_published(tmp_path, 7)
    assert published_mark(tmp_path) == 7
    (tmp_path / "v000004").mkdir()
    (tmp_path / "published").write_text("garbage")
    problems: list[str] = []
    assert published_mark(tmp_path, problems.append) == 4  # at least the newest checkpoint
    assert problems
