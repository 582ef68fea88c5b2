"""Experiment tracking with what starts processes: an offline W&B run (W&B's service is one) and
TensorBoard's files written in a fresh interpreter that never loads torch. The rest is
``tests/unit/test_tracking.py``."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from laminar.tracking import (
    TrackingConfig,
    TrainerTracking,
)
from tests.unit.test_tracking import RECORD, Captured

from ..support.tensorboard import read_scalars


def test_tensorboard_files_are_written_without_torch(tmp_path: Path) -> None:
    """The supervisor of every ``laminar run`` and the sim trainer write event files and have no
    other use for torch: the writer must not load it (tensorboardX did, 3.6 CPU-s each time)."""
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from laminar.tracking import TrackingConfig, TrackingPlan, open_tracker\n"
        "tracker = open_tracker(TrackingPlan.of(TrackingConfig(), Path(sys.argv[1])), 'cluster')\n"
        "tracker.log(3, {'cluster/generated_tokens_per_s': 42.0})\n"
        "tracker.close()\n"
        "print('torch loaded:', 'torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "torch loaded: False", out.stdout + out.stderr
    assert read_scalars(tmp_path / "tensorboard" / "cluster") == {
        "cluster/generated_tokens_per_s": [(3, 42.0)]
    }


def wandb_history(run_dir: Path, rows: int) -> list[dict[str, Any]]:
    """The history rows of an offline W&B run, once there are ``rows`` of them (wandb-core may
    write the file a moment after ``finish`` returns)."""
    deadline = time.monotonic() + 20
    while len(got := read_wandb_history(run_dir)) < rows and time.monotonic() < deadline:
        time.sleep(0.1)
    return got


def read_wandb_history(run_dir: Path) -> list[dict[str, Any]]:
    """The history rows in an offline W&B run's ``.wandb`` file (a LevelDB-style log of
    protobuf records: 7-byte file header, 32 KiB blocks, 7-byte record headers)."""
    from wandb.proto import wandb_internal_pb2 as pb

    [path] = run_dir.glob("*.wandb")
    raw, block = path.read_bytes(), 32768
    if len(raw) < 7:  # not written yet
        return []
    assert raw[:4] == b":W&B", raw[:7]
    rows, pos, buf = [], 7, b""
    while pos + 7 <= len(raw):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _crc, n, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        if n == 0 and kind == 0:
            break
        buf += raw[pos + 7 : pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):  # a full record, or the last piece of one
            record = pb.Record.FromString(buf)
            buf = b""
            if record.WhichOneof("record_type") == "history":
                items = record.history.item  # a key with "/" is kept as its parts
                rows.append(
                    {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
                )
    return rows


def test_wandb_offline_run_has_the_scalars(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("wandb")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "home"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    run = tmp_path / "arith-20250101-000000"
    cfg = TrackingConfig(tensorboard=False, wandb={"project": "laminar-test", "mode": "offline"})
    log = Captured()
    tracking = TrainerTracking(cfg, str(run / "trainer.jsonl"), log, {"batch": {"prompts": 8}})
    tracking.record({**RECORD, "version": 1, "reward_mean": 0.25}, 10.0)
    tracking.record({**RECORD, "version": 2, "reward_mean": 0.5}, 12.0)
    tracking.record({"eval": True, "version": 2, "time": 13.0, "accuracy": 0.75}, 13.0)
    tracking.tracker.close(timeout=60)
    assert log.warnings() == [], log.lines
    [offline] = (run / "wandb").glob("offline-run-*")
    rows = wandb_history(offline, 2)
    assert [r["_step"] for r in rows] == [1, 2]  # the eval merged into version 2's row
    assert [r["train/reward_mean"] for r in rows] == [0.25, 0.5]
    assert rows[1]["eval/accuracy"] == 0.75 and rows[1]["train/tokens_per_s"] == 2048.0
    run_id = (run / "wandb-trainer.id").read_text()
    assert offline.name.endswith(run_id)

    # a restarted trainer continues the same W&B run
    again = TrainerTracking(cfg, str(run / "trainer.jsonl"), log)
    again.record({**RECORD, "version": 3}, 20.0)
    again.tracker.close(timeout=60)
    assert log.warnings() == [], log.lines
    [resumed] = set((run / "wandb").glob("offline-run-*")) - {offline}
    assert run_id in resumed.name
    assert [r["_step"] for r in wandb_history(resumed, 1)] == [3]
