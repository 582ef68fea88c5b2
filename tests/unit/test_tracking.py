"""Experiment tracking (laminar/tracking/): what reaches TensorBoard and W&B, and that a broken,
slow or hanging backend never reaches the training run or the supervisor."""

from __future__ import annotations

import asyncio
import importlib.util
import io
import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from laminar.devmode.runview import RunView
from laminar.runtime.config import load_config
from laminar.tracking import (
    ThreadedTracker,
    TrackingConfig,
    TrackingPlan,
    TrainerTracking,
    WandbConfig,
    cluster_scalars,
    open_tracker,
    plan_for_run,
    record_scalars,
)
from laminar.tracking.progress import Progress

from ..support.tensorboard import read_scalars


def eventually(condition: Any, timeout: float = 20.0) -> bool:
    """Whether ``condition()`` holds within ``timeout`` (a loaded machine is slow, not wrong)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


class Captured:
    """A stand-in for a structlog logger that keeps what it was told."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []

    def info(self, event: str, **kw: Any) -> None:
        self.lines.append(("info", event, kw))

    def warning(self, event: str, **kw: Any) -> None:
        self.lines.append(("warning", event, kw))

    def warnings(self) -> list[str]:
        return [event for level, event, _ in self.lines if level == "warning"]


# -- TensorBoard --------------------------------------------------------------------------


def test_tensorboard_scalars_read_back_with_their_steps(tmp_path: Path) -> None:
    plan = TrackingPlan.of(TrackingConfig(), tmp_path)
    assert plan.tensorboard == tmp_path / "tensorboard"
    log = Captured()
    tracker = open_tracker(plan, "trainer", log)
    for step in (1, 2, 3):
        tracker.log(step, {"train/reward_mean": step / 10, "train/tokens": 100 * step})
    tracker.log(3, {"eval/accuracy": 0.625})
    assert tracker.close()
    got = read_scalars(tmp_path / "tensorboard" / "trainer")
    assert got["train/tokens"] == [(1, 100.0), (2, 200.0), (3, 300.0)]
    assert [s for s, _ in got["train/reward_mean"]] == [1, 2, 3]
    assert [v for _, v in got["train/reward_mean"]] == pytest.approx([0.1, 0.2, 0.3])
    assert got["eval/accuracy"] == [(3, 0.625)]
    assert log.warnings() == []


def test_tensorboard_itself_reads_the_files(tmp_path: Path) -> None:
    """What the user runs: TensorBoard's own reader finds the scalars."""
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    tracker = open_tracker(TrackingPlan.of(TrackingConfig(), tmp_path), "cluster")
    tracker.log(0, {"cluster/generated_tokens_per_s": 1500.0})
    tracker.log(7, {"cluster/generated_tokens_per_s": 2500.0})
    tracker.close()
    acc = accumulator.EventAccumulator(str(tmp_path / "tensorboard" / "cluster"))
    acc.Reload()
    events = acc.Scalars("cluster/generated_tokens_per_s")
    assert [(e.step, e.value) for e in events] == [(0, 1500.0), (7, 2500.0)]


def test_tensorboard_flushes_while_the_run_goes_on(tmp_path: Path, monkeypatch) -> None:
    """A run that is still going (or killed -9 later) has its scalars on disk within FLUSH_S."""
    import laminar.tracking.backends as backends

    monkeypatch.setattr(backends, "FLUSH_S", 0.2)
    tracker = open_tracker(TrackingPlan.of(TrackingConfig(), tmp_path), "trainer")
    tracker.log(1, {"train/loss": 0.5})
    logdir = tmp_path / "tensorboard" / "trainer"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if list(logdir.glob("events.*")) and "train/loss" in read_scalars(logdir):
            break
        time.sleep(0.1)
    assert read_scalars(logdir)["train/loss"] == [(1, 0.5)]
    tracker.close()


# -- the trainer's records ------------------------------------------------------------------

RECORD = {  # a torch trainer's version record (roles/trainer/service.py) with every kind of value
    "version": 3,
    "cursor": 24,
    "time": 1_700_000_000.0,
    "train_s": 1.5,
    "tokens": 4096,
    "reward_mean": 0.25,
    "reward_generated": None,
    "staleness_mean": 0.5,
    "staleness_max": 1,
    "staleness_counts": {"0": 4, "1": 4},
    "grad_norm": 0.75,
    "publish_stall_s": 0.01,
    "mismatch_kl": 0.001,
    "clip_frac": 0.0,
}


def test_record_scalars_maps_numbers_and_leaves_out_the_rest() -> None:
    assert record_scalars(RECORD) == {
        "train/train_s": 1.5,
        "train/tokens": 4096.0,
        "train/reward_mean": 0.25,
        "train/staleness_mean": 0.5,
        "train/staleness_max": 1.0,
        "train/grad_norm": 0.75,
        "train/publish_stall_s": 0.01,
        "train/mismatch_kl": 0.001,
        "train/clip_frac": 0.0,
    }
    sim = {  # a sim trainer's: timestamps and lists are not measurements
        "version": 2, "cursor": 16, "tokens": 512, "trajectories": 8, "sampled_at": 10.0,
        "train_start": 10.5, "train_end": 11.0, "train_s": 0.5, "staleness_mean": 0.0,
        "staleness_max": 0, "gen_versions": [1], "published_at": 11.1,
    }  # fmt: skip
    assert record_scalars(sim) == {
        "train/tokens": 512.0,
        "train/trajectories": 8.0,
        "train/train_s": 0.5,
        "train/staleness_mean": 0.0,
        "train/staleness_max": 0.0,
    }
    evaluation = {"eval": True, "version": 3, "time": 1.0, "accuracy": 0.5, "n": 200,
                  "eval_s": 9.0, "buckets": {"short": 0.75}, "flag": True, "note": "x"}  # fmt: skip
    assert record_scalars(evaluation) == {"eval/accuracy": 0.5, "eval/n": 200.0, "eval/eval_s": 9.0}


def test_trainer_tracking_writes_records_at_their_version(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "arith-20250101-000000"
    tracking = TrainerTracking(TrackingConfig(), str(run / "trainer.jsonl"), Captured())
    tracking.record({"eval": True, "version": 0, "time": 5.0, "accuracy": 0.4, "n": 10}, 5.0)
    tracking.record({**RECORD, "version": 1, "tokens": 1000}, 100.0)
    tracking.record({**RECORD, "version": 2, "tokens": 3000}, 102.0)  # 3000 tokens in 2 s
    tracking.record({"eval": True, "version": 2, "time": 103.0, "accuracy": 0.5, "n": 10}, 103.0)
    tracking.close()
    got = read_scalars(run / "tensorboard" / "trainer")
    assert got["train/tokens"] == [(1, 1000.0), (2, 3000.0)]
    assert got["train/tokens_per_s"] == [(2, 1500.0)]  # none for the first: no interval yet
    assert got["eval/accuracy"] == [(0, pytest.approx(0.4)), (2, 0.5)]
    assert set(got) == {f"train/{k}" for k in (
        "train_s", "tokens", "reward_mean", "staleness_mean", "staleness_max", "grad_norm",
        "publish_stall_s", "mismatch_kl", "clip_frac", "tokens_per_s",
    )} | {"eval/accuracy", "eval/n"}  # fmt: skip


def test_no_metrics_file_and_no_directory_means_no_files(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    tracking = TrainerTracking(TrackingConfig(), None)  # the sim trainer's default
    assert not tracking.plan.enabled
    tracking.record(RECORD, 1.0)
    tracking.close()
    off = TrainerTracking(TrackingConfig(tensorboard=False), str(tmp_path / "m.jsonl"))
    assert not off.plan.enabled
    off.record(RECORD, 1.0)
    off.close()
    assert list(tmp_path.iterdir()) == []


# -- failures stay inside the tracker ---------------------------------------------------------


class Recording:
    name = "recording"

    def __init__(self) -> None:
        self.logged: list[tuple[int, dict[str, float]]] = []
        self.closed = False

    def log(self, step: int, scalars: dict[str, float], wall_time: float | None = None) -> None:
        self.logged.append((step, dict(scalars)))

    def close(self) -> None:
        self.closed = True


class Broken(Recording):
    name = "broken"

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def log(self, step: int, scalars: dict[str, float], wall_time: float | None = None) -> None:
        self.calls += 1
        raise OSError(28, "No space left on device")


def test_a_failing_backend_is_logged_once_and_dropped(tmp_path: Path) -> None:
    good, bad, log = Recording(), Broken(), Captured()

    def cannot_start() -> Any:
        raise RuntimeError("api_key not configured")

    tracker = ThreadedTracker(
        [("broken", lambda: bad), ("wandb", cannot_start), ("recording", lambda: good)], log
    )
    for step in range(5):
        tracker.log(step, {"x": float(step)})  # never raises
    assert tracker.close()
    assert [s for s, _ in good.logged] == [0, 1, 2, 3, 4] and good.closed
    assert bad.calls == 1 and not bad.closed
    assert set(tracker.failed) == {"broken", "wandb"}
    assert "No space left" in tracker.failed["broken"]
    assert len(log.warnings()) == 2  # once each


def test_every_backend_failed_turns_the_tracker_off() -> None:
    bad, log = Broken(), Captured()
    tracker = ThreadedTracker([("broken", lambda: bad)], log)
    tracker.log(1, {"x": 1.0})
    assert eventually(lambda: tracker.off)
    for step in range(2, 50):
        tracker.log(step, {"x": 1.0})
    tracker.close()
    assert bad.calls == 1 and len(log.warnings()) == 1


def test_a_stuck_backend_never_blocks_the_caller() -> None:
    release = threading.Event()

    class Stuck(Recording):
        name = "stuck"

        def log(self, step: int, scalars: dict[str, float], wall_time: float | None = None) -> None:
            release.wait(10)

    log = Captured()
    tracker = ThreadedTracker([("stuck", Stuck)], log, max_pending=10)
    started = time.monotonic()
    for step in range(1000):
        tracker.log(step, {"x": 1.0})
    # A blocking log would wait out the backend's 10 s on its first call; the margin is wide so
    # a loaded machine cannot fail it.
    assert time.monotonic() - started < 5.0
    assert not tracker.close(timeout=0.2)  # still stuck: close gives up instead of hanging
    assert log.warnings() == ["tracking falls behind; dropping scalars"]
    release.set()


def test_a_backend_that_hangs_opening_holds_up_nothing_and_is_dropped_at_its_deadline() -> None:
    """``wandb.init`` online without a network waits ~90 s: TensorBoard is written meanwhile,
    and W&B is dropped with one warning once its open is past the deadline."""
    release = threading.Event()
    late, good, log = Recording(), Recording(), Captured()

    def hangs() -> Recording:
        release.wait(60)
        return late

    tracker = ThreadedTracker([("wandb", hangs), ("recording", lambda: good)], log,
                              open_timeout_s=2.0)  # fmt: skip
    for step in range(3):
        tracker.log(step, {"x": float(step)})
    assert eventually(lambda: len(good.logged) == 3)  # while the other is still opening
    assert eventually(lambda: "wandb" in tracker.failed)
    assert "not open after 2 s" in tracker.failed["wandb"]
    tracker.log(3, {"x": 3.0})
    assert tracker.close(timeout=20)
    assert [s for s, _ in good.logged] == [0, 1, 2, 3] and good.closed
    assert log.warnings() == [
        "wandb tracking failed while starting; it is off for the rest of this process"
    ]
    release.set()  # it opens at last: closed at once, never written to
    assert eventually(lambda: late.closed) and late.logged == []


def test_a_backend_slow_to_open_gets_the_rows_logged_meanwhile() -> None:
    gate, slow, log = threading.Event(), Recording(), Captured()

    def opens_late() -> Recording:
        gate.wait(30)
        return slow

    tracker = ThreadedTracker([("slow", opens_late)], log)
    for step in range(3):
        tracker.log(step, {"x": float(step)})
    gate.set()
    assert tracker.close(timeout=30)
    assert [s for s, _ in slow.logged] == [0, 1, 2] and slow.closed
    assert log.warnings() == []


def test_values_that_are_not_numbers_are_left_out_with_one_warning_each() -> None:
    """``log`` never raises into its caller (the supervisor's tick, a training step)."""
    good, log = Recording(), Captured()
    tracker = ThreadedTracker([("recording", lambda: good)], log)
    tracker.log(1, {"x": 1.0, "note": "fast", "nested": {"a": 1}, "none": None})  # type: ignore[dict-item]
    tracker.log(2, {"x": 2, "note": "slow", "big": 10**400})  # type: ignore[dict-item]
    tracker.log("three", {"x": 3.0})  # type: ignore[arg-type]
    tracker.log(4, {"none": None})  # type: ignore[dict-item]  # nothing left: no row
    assert tracker.close(timeout=20)
    assert good.logged == [(1, {"x": 1.0}), (2, {"x": 2.0})]
    skipped = [kw["key"] for level, _, kw in log.lines if level == "warning"]
    assert skipped == ["note", "nested", "none", "big", "step 'three'"]


# -- configuration ------------------------------------------------------------------------


def test_tracking_config_rejects_unknown_keys_and_modes() -> None:
    with pytest.raises(ValidationError, match="tensorbord"):
        TrackingConfig.model_validate({"tensorbord": False})
    with pytest.raises(ValidationError, match="projct"):
        TrackingConfig.model_validate({"wandb": {"project": "p", "projct": "q"}})
    with pytest.raises(ValidationError, match="project"):
        TrackingConfig.model_validate({"wandb": {"mode": "offline"}})
    with pytest.raises(ValidationError, match="mode"):
        WandbConfig.model_validate({"project": "p", "mode": "offlne"})
    for mode in ("online", "offline", "disabled", None):
        assert WandbConfig.model_validate({"project": "p", "mode": mode}).mode == mode


def test_plans_and_the_hints_laminar_run_prints(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    real = tmp_path / "runs" / "arith-20250101-000000"
    real.mkdir(parents=True)
    (tmp_path / "runs" / "latest").symlink_to(real.name)
    plan = TrackingPlan.of(TrackingConfig(), Path("runs/latest"))
    assert plan.tensorboard == Path("runs/latest/tensorboard")
    assert plan.run_name() == "arith-20250101-000000"
    [hint] = plan.hints()
    assert hint.endswith("--logdir runs/arith-20250101-000000/tensorboard"), hint
    explicit = TrackingPlan.of(TrackingConfig(tensorboard="/srv/tb"), None)
    assert explicit.tensorboard == Path("/srv/tb")
    offline = TrackingPlan.of(
        TrackingConfig(tensorboard=False, wandb={"project": "arith", "mode": "offline"}),
        Path("runs/latest"),
    )
    [w] = offline.hints()
    if importlib.util.find_spec("wandb") is None:
        assert "pip install 'laminar-rl[wandb]'" in w
    else:
        assert "project arith" in w and "group arith-20250101-000000" in w
        assert "wandb sync runs/arith-20250101-000000/wandb/offline-run-*" in w


def test_plan_for_run_follows_the_trainer_section(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(
        "sim_trainer:\n"
        f"  metrics_file: {tmp_path}/run/trainer.jsonl\n"
        "  tracking: {wandb: {project: sims, mode: offline}}\n"
        "run:\n  roles: [{role: manager}, {role: sim_trainer}]\n"
    )
    config = load_config(path)
    roles = [("manager", "manager", {}), ("sim_trainer", "sim_trainer", {})]
    plan = plan_for_run(config, roles, tmp_path / "rundir")
    assert plan.tensorboard == tmp_path / "run" / "tensorboard"
    assert plan.wandb is not None and plan.wandb.project == "sims"
    overridden = [("sim_trainer", "sim_trainer", {"tracking": {"tensorboard": False}})]
    assert plan_for_run(config, overridden, tmp_path).tensorboard is None
    # no trainer (or one without a metrics file): the cluster's scalars go to the run directory
    assert plan_for_run(config, roles[:1], tmp_path / "rundir").tensorboard == (
        tmp_path / "rundir" / "tensorboard"
    )


# -- the cluster's view (dev mode) ----------------------------------------------------------


def test_cluster_scalars() -> None:
    p = Progress(started=0.0, version=7, trained_tokens_per_s=800.0)
    r = {"phase": "running", "version": 7, "kv": 0.5, "running": 3, "waiting": 1, "in_flight": 4}
    p.rollouts = {
        "rollout-0": {**r, "state": "alive"},
        "rollout-1": {**r, "phase": "switching", "kv": 0.25, "version": 6, "state": "alive"},
        "rollout-2": {**r, "state": "dead"},
    }
    p.rollout_tokens_per_s = {"rollout-0": 1000.0, "rollout-1": 500.0}
    got = cluster_scalars(p)
    assert got["cluster/generated_tokens_per_s"] == 1500.0
    assert got["cluster/trained_tokens_per_s"] == 800.0
    assert got["cluster/trainer_version"] == 7
    assert (got["cluster/rollouts_running"], got["cluster/rollouts_switching"]) == (1, 1)
    assert (got["cluster/rollouts_draining"], got["cluster/rollouts_down"]) == (0, 1)
    assert got["cluster/kv_use_mean"] == 0.375 and got["cluster/kv_use_max"] == 0.5
    assert got["cluster/sequences_running"] == 6 and got["cluster/sequences_in_flight"] == 8
    assert got["rollout/rollout-1/kv_use"] == 0.25 and got["rollout/rollout-1/version"] == 6
    assert "rollout/rollout-2/kv_use" not in got
    idle = cluster_scalars(Progress(started=0.0))
    assert idle["cluster/generated_tokens_per_s"] == 0.0 and "cluster/kv_use_mean" not in idle


def _member(instance: str, generated: int) -> Any:
    stats = {"version": 1.0, "kv_cache_usage": 0.5, "running": 2.0, "generated_tokens": generated}
    return SimpleNamespace(role="rollout", instance=instance, state="alive", incarnation=1,
                           stats=stats, endpoints={})  # fmt: skip


async def test_run_view_writes_the_cluster_run(tmp_path: Path, monkeypatch) -> None:
    """RunView's samples reach TensorBoard at step = seconds since the run first started; a
    resumed run (cluster.jsonl already there) continues from its first sample."""
    from rich.console import Console

    import laminar.devmode.runview as runview

    (tmp_path / "cluster.jsonl").write_text(json.dumps({"time": 1000.0, "rollouts": {}}) + "\n")
    clock = iter([1100.0, 1101.0, 1102.0])
    generated = iter([0, 300, 900])

    async def fake_status(*args: Any, **kw: Any) -> Any:
        return SimpleNamespace(members=[_member("rollout-0", next(generated))])

    monkeypatch.setattr(runview, "fetch_status", fake_status)
    monkeypatch.setattr(runview, "render_status", lambda *a, **k: "")
    sample = runview.cluster_sample
    monkeypatch.setattr(runview, "cluster_sample", lambda members: sample(members, next(clock)))
    view = RunView(
        run_dir=tmp_path, trainer_metrics=None, console=Console(file=io.StringIO()),
        mode="lines", interval_s=1.0, progress_interval_s=60.0, title="t",
        tracking=TrackingPlan.of(TrackingConfig(), tmp_path),
    )  # fmt: skip
    view.tracker = open_tracker(view.tracking, "cluster")  # what run() does first
    for _ in range(3):
        await view._tick("tcp://x", b"t" * 16, None)
    await view.close_tracking()
    got = read_scalars(tmp_path / "tensorboard" / "cluster")
    steps = [s for s, _ in got["cluster/generated_tokens_per_s"]]
    assert steps == [100, 101, 102]
    assert [v for _, v in got["rollout/rollout-0/generated_tokens_per_s"]] == [0.0, 300.0, 450.0]
    assert got["cluster/kv_use_mean"][-1] == (102, 0.5)


async def test_run_view_leaves_the_tracker_open_and_closes_it_within_a_bound(
    tmp_path: Path,
) -> None:
    """Stopping the view (before the supervisor signals the roles) never waits on the
    tracker; ``close_tracking`` (after the roles are stopped) waits 5 s at most."""
    from rich.console import Console

    class SlowToClose:
        def __init__(self) -> None:
            self.closes: list[float] = []

        def log(self, step: int, scalars: dict[str, float]) -> None:
            pass

        def close(self, timeout: float = 30.0) -> bool:
            self.closes.append(timeout)
            return False  # still writing when the timeout ran out

    out = io.StringIO()
    view = RunView(
        run_dir=tmp_path, trainer_metrics=None, console=Console(file=out, width=200),
        mode="lines", interval_s=1.0, progress_interval_s=60.0, title="t",
    )  # fmt: skip
    tracker = SlowToClose()
    view.tracker = tracker  # type: ignore[assignment]
    stopping = asyncio.Event()
    stopping.set()
    await view.run("tcp://x", b"t" * 16, None, stopping, None)
    assert tracker.closes == []
    await view.close_tracking()
    assert tracker.closes == [5.0]
    assert "tracking did not finish within 5 s" in out.getvalue()
    await view.close_tracking()  # once only
    assert tracker.closes == [5.0]

    # a real tracker whose backend hangs in close: close_tracking still returns in time
    release = threading.Event()

    class HangsClosing(Recording):
        def close(self) -> None:
            release.wait(60)

    view.tracker = ThreadedTracker([("hangs", HangsClosing)], Captured())
    started = time.monotonic()
    await view.close_tracking(timeout=0.5)
    assert time.monotonic() - started < 30.0  # the backend hangs for 60 s
    release.set()


# -- W&B ----------------------------------------------------------------------------------
