"""The dev mode's pure parts: the CPU plan, run directories, progress numbers and the plots."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from laminar.devmode.plots import plot_run
from laminar.devmode.progress import progress_line
from laminar.devmode.rundir import prepare_run_dir
from laminar.proc.cpus import plan_cpus
from laminar.runtime.errors import ConfigError
from laminar.tracking.progress import TrainerLog, summarize

from ..support.processes import ARITH_PROCESSES

ARITH = list(ARITH_PROCESSES)


def test_two_cores_give_each_rollout_its_own_and_the_trainer_shares() -> None:
    plan = plan_cpus([0, 1], ARITH)
    assert plan["rollout-0"].cpus == (0,) and plan["rollout-1"].cpus == (1,)
    assert plan["trainer-0"].cpus == () and plan["trainer-0"].threads == 1
    assert all(plan[n].cpus == () for n in ("manager-0", "data-0", "relay-0"))
    env = plan["rollout-1"].env("rollout")
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1" and env["OMP_NUM_THREADS"] == "1"


@pytest.mark.parametrize("cores", [3, 4, 7, 16])
def test_enough_cores_are_split_disjointly_with_the_remainder_to_rollouts(cores: int) -> None:
    plan = plan_cpus(list(range(cores)), ARITH)
    heavy = [plan[n].cpus for n in ("rollout-0", "rollout-1", "trainer-0")]
    flat = [c for cpus in heavy for c in cpus]
    assert sorted(flat) == list(range(cores)) and len(set(flat)) == cores
    assert len(plan["rollout-0"].cpus) >= len(plan["trainer-0"].cpus) >= 1
    assert all(plan[n].threads == len(plan[n].cpus) for n in ("rollout-0", "trainer-0"))


def test_more_rollouts_than_cores_wrap_around() -> None:
    procs = [(f"rollout-{i}", "rollout") for i in range(5)] + [("trainer-0", "trainer")]
    plan = plan_cpus([0, 1], procs)
    assert [plan[f"rollout-{i}"].cpus for i in range(5)] == [(0,), (1,), (0,), (1,), (0,)]
    assert plan["trainer-0"].threads == 1


def test_each_run_gets_a_fresh_directory_and_resume_finds_it(tmp_path: Path) -> None:
    link = tmp_path / "runs" / "latest"
    first, resumed = prepare_run_dir(link, "arith", now=0)
    assert not resumed and link.is_symlink() and link.resolve() == first
    (first / "trainer.jsonl").write_text("{}\n")
    second, _ = prepare_run_dir(link, "arith", now=0)  # same second: a suffix, not a clash
    assert second != first and link.resolve() == second and first.is_dir()
    again, resumed = prepare_run_dir(link, "arith", resume=str(first))
    assert resumed and again == first and link.resolve() == first
    latest, resumed = prepare_run_dir(link, "arith", resume=True)
    assert resumed and latest == first


def test_a_real_directory_with_files_is_never_silently_reused(tmp_path: Path) -> None:
    old = tmp_path / "latest"
    old.mkdir()
    (old / "data.sqlite").write_text("x")
    with pytest.raises(ConfigError, match="--resume"):
        prepare_run_dir(old, "arith")
    with pytest.raises(ConfigError, match="does not exist"):
        prepare_run_dir(tmp_path / "nope", "arith", resume=True)
    assert prepare_run_dir(old, "arith", resume=True) == (old.resolve(), True)


def _write_run(run: Path) -> None:
    t = 1000.0
    versions = [
        {"version": v, "time": t + 10 * v, "train_s": 1.0, "tokens": 500, "reward_mean": 0.1 * v,
         "staleness_mean": 0.5, "staleness_max": 1, "staleness_counts": {"0": 3, "1": 1}}
        for v in range(1, 6)
    ]  # fmt: skip
    evals = [
        {"eval": True, "version": 0, "time": t, "accuracy": 0.4, "n": 10},
        {"eval": True, "version": 5, "time": t + 50, "accuracy": 0.6, "n": 10},
    ]
    (run / "trainer.jsonl").write_text("".join(json.dumps(r) + "\n" for r in versions + evals))
    samples = [
        {"time": t + i, "rollouts": {
            "rollout-0": {"phase": "running" if i % 7 else "switching", "version": i // 10,
                          "kv": 0.3, "running": 4, "waiting": 0, "in_flight": 4,
                          "generated_tokens": 100 * i, "state": "alive"},
            "rollout-1": {"phase": "running", "version": i // 10, "kv": 0.1, "running": 1,
                          "waiting": 0, "in_flight": 1, "generated_tokens": 50 * i,
                          "state": "alive" if i < 40 else "dead"}}}
        for i in range(60)
    ]  # fmt: skip
    (run / "cluster.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    events = [
        {"seq": 1, "at": t + 12, "kind": "pull", "data": {"rollout": "rollout-0", "version": 1}},
        {"seq": 2, "at": t + 20, "kind": "repack", "data": {"moves": [
            {"source": "rollout-1", "destination": "rollout-0", "trajectories": ["a"]}]}},
    ]  # fmt: skip
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events) + "{cut")


def test_progress_numbers_come_from_the_files(tmp_path: Path) -> None:
    _write_run(tmp_path)
    log = TrainerLog(tmp_path / "trainer.jsonl")
    log.poll()
    samples = [json.loads(x) for x in (tmp_path / "cluster.jsonl").read_text().splitlines()]
    p = summarize(log, samples, started=1000.0, now=1060.0)
    assert p.version == 5 and p.accuracy == 0.6 and p.accuracy_start == 0.4
    assert p.reward == pytest.approx(0.3) and p.staleness_max == 1
    assert p.rollout_tokens_per_s["rollout-0"] == pytest.approx(100.0)
    assert "accuracy 0.600 (+0.200)" in progress_line(p)


def test_a_run_stopped_before_anything_happened_plots_without_a_warning(tmp_path: Path) -> None:
    """A run stopped while its roles start (no version, no trainer log, a single sample): every
    plot is drawn, saying there is nothing yet, and matplotlib has nothing to warn about (it
    warned "No artists with labels found to put in legend" at the end of such runs)."""
    sample = {"time": 1000.0, "rollouts": {"rollout-0": {"phase": "running", "version": 0,
              "kv": 0.0, "in_flight": 0, "generated_tokens": 0, "state": "alive"}}}  # fmt: skip
    (tmp_path / "cluster.jsonl").write_text(json.dumps(sample) + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        written = plot_run(tmp_path)
    assert sorted(p.name for p in written) == [
        "reward_accuracy.png",
        "staleness.png",
        "throughput.png",
        "timeline.png",
    ]


def test_trainer_log_waits_for_a_whole_line(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text('{"version": 1, "time": 1}\n{"version": 2, "ti')
    log = TrainerLog(path)
    log.poll()
    assert [v["version"] for v in log.versions] == [1]
    with path.open("a") as f:
        f.write('me": 2}\n')
    log.poll()
    assert [v["version"] for v in log.versions] == [1, 2]


def test_plots_are_drawn_from_a_run_directory(tmp_path: Path) -> None:
    _write_run(tmp_path)
    written = plot_run(tmp_path)
    names = sorted(p.name for p in written)
    assert names == ["reward_accuracy.png", "staleness.png", "throughput.png", "timeline.png"]
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
