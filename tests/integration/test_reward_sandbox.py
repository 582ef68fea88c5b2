"""Reward workers: no cluster token, nothing left behind, limits, NumPy rewards, JSON replies.

A reward may run code the model wrote. Each test starts a real :class:`RewardPool` on a reward file
written here; the workers are real processes, checked through ``/proc``.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from laminar.proc import procfs
from laminar.roles.data.reward_worker import as_reward
from laminar.roles.data.rewards import RewardPool, RewardResult, RewardSandbox
from tests.support.poll import until
from tests.support.procs import TOKEN

REWARDS = r"""
import json, os, pickle, sys, time


def environment(record, response):
    with open("/proc/self/environ", "rb") as f:
        raw = f.read().decode(errors="replace")
    with open(record["out"], "w") as f:
        json.dump({"environ": dict(os.environ), "proc": raw}, f)
    return 0.0


def forks(record, response):
    stays = os.fork()  # in the worker's process group
    if stays == 0:
        time.sleep(120)
        os._exit(0)
    leaves = os.fork()  # a session of its own: out of the group
    if leaves == 0:
        os.setsid()
        time.sleep(120)
        os._exit(0)
    with open(record["out"], "w") as f:
        json.dump([os.getpid(), stays, leaves], f)
    time.sleep(120)


def value(record, response):
    import numpy as np

    return {
        "float32": np.float32(0.5),
        "int64": np.int64(2),
        "float64": np.float64(1.5),
        "array0d": np.array(0.25),
        "numpy_bool": np.bool_(True),
        "bool": True,
        "nan": np.float32("nan"),
        "text": "abc",
    }[record["kind"]]


def allocates(record, response):
    return float(len(bytearray(record["bytes"])))


def spins(record, response):
    while True:
        pass


class Trap:
    def __reduce__(self):
        return (open, (self.path, "w"))


def lies(record, response):
    trap = Trap()
    trap.path = record["out"]
    results = json.loads(sys.argv[1])["results"]
    os.write(results, pickle.dumps(trap) + b"\n")  # a reply the parent must never unpickle
    return 1.0
"""


@pytest.fixture
def rewards(tmp_path: Path) -> str:
    path = tmp_path / "rewards_under_test.py"
    path.write_text(REWARDS)
    return str(path)


async def test_a_reward_sees_no_token_in_its_environment(
    rewards: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LAMINAR_TOKEN", TOKEN)
    monkeypatch.setenv("LAMINAR_OTHER_SECRET", "another-secret-0123456789")
    monkeypatch.setenv("TOKEN_COPY", f"Bearer {TOKEN}")  # the value under another name
    monkeypatch.setenv("LAMINAR_LAUNCH", "the-runs-process-mark")  # a mark, not a secret: kept
    monkeypatch.setenv("LAMINAR_INCARNATION", "the-roles-process-mark")  # kept as well
    out = tmp_path / "env.json"
    pool = RewardPool(f"{rewards}:environment")
    try:
        assert await pool.score({"out": str(out)}, "") == RewardResult(0.0)
    finally:
        await pool.close()
    seen = json.loads(out.read_text())
    assert TOKEN not in seen["proc"] and "another-secret" not in seen["proc"]
    assert not {"LAMINAR_TOKEN", "LAMINAR_OTHER_SECRET", "TOKEN_COPY"} & seen["environ"].keys()
    assert seen["environ"]["LAMINAR_LAUNCH"] == "the-runs-process-mark"
    assert seen["environ"]["LAMINAR_INCARNATION"] == "the-roles-process-mark"
    assert seen["environ"]["PATH"] == os.environ["PATH"]


async def test_a_custom_token_variable_and_dropped_names_are_not_seen(
    rewards: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MY_CLUSTER_TOKEN", "f3a9c1e07b5d2468ace13579bdf02468")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI/K7MDENG")
    out = tmp_path / "env.json"
    sandbox = RewardSandbox(drop_env=["AWS_*"])
    pool = RewardPool(f"{rewards}:environment", sandbox=sandbox, token_env="MY_CLUSTER_TOKEN")
    try:
        assert await pool.score({"out": str(out)}, "") == RewardResult(0.0)
    finally:
        await pool.close()
    seen = json.loads(out.read_text())
    assert "f3a9c1e07b5d" not in seen["proc"] and "wJalrXUtnFEMI" not in seen["proc"]


async def test_a_reward_that_forks_and_times_out_leaves_no_process_behind(
    rewards: str, tmp_path: Path
) -> None:
    out = tmp_path / "pids.json"
    pool = RewardPool(f"{rewards}:forks", timeout_s=3.0)
    pids: list[int] = []
    try:
        result = await pool.score({"out": str(out)}, "")
        assert result == RewardResult(None, "timed out after 3.0s")
        pids = json.loads(out.read_text())  # the worker, its child, the child that left

        async def all_gone() -> bool:
            return not any(procfs.alive(pid) for pid in pids)

        await until(all_gone, timeout=10)
    finally:
        await pool.close()
        for pid in pids:  # never leave them, even when the test fails
            if procfs.alive(pid):
                os.kill(pid, signal.SIGKILL)


async def test_numpy_rewards_are_accepted_and_bools_refused(rewards: str) -> None:
    pool = RewardPool(f"{rewards}:value", workers=1)
    try:
        got = {
            kind: await pool.score({"kind": kind}, "")
            for kind in ("float32", "int64", "float64", "array0d", "numpy_bool", "nan", "text")
        }
    finally:
        await pool.close()
    assert got["float32"] == RewardResult(0.5)
    assert got["int64"] == RewardResult(2.0)
    assert got["float64"] == RewardResult(1.5)
    assert got["array0d"] == RewardResult(0.25)
    assert got["numpy_bool"].reward is None and "a bool" in got["numpy_bool"].error
    assert got["nan"] == RewardResult(None, "returned nan, not a finite number")
    assert got["text"] == RewardResult(None, "returned 'abc', not a number")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (3, (3.0, None)),
        (True, (None, "returned True, a bool, not a number (return float(...) to score it)")),
        (10**400, (None, f"returned {str(10**400)[:200]}..., not a finite number")),
        (None, (None, "returned None, not a number")),
    ],
)
def test_reward_values(value: Any, expected: tuple[float | None, str | None]) -> None:
    assert as_reward(value) == expected


async def test_memory_over_the_limit_fails_the_call_not_the_worker(rewards: str) -> None:
    pool = RewardPool(f"{rewards}:allocates", sandbox=RewardSandbox(memory_mib=1024))
    try:
        too_much = await pool.score({"bytes": 2 << 30}, "")
        fine = await pool.score({"bytes": 1 << 20}, "")
    finally:
        await pool.close()
    assert too_much == RewardResult(None, "raised MemoryError: ")
    assert fine == RewardResult(float(1 << 20))


async def test_a_call_over_its_cpu_limit_is_killed(rewards: str) -> None:
    pool = RewardPool(f"{rewards}:spins", timeout_s=60.0, sandbox=RewardSandbox(cpu_s=1))
    try:
        result = await pool.score({}, "")
    finally:
        await pool.close()
    assert result == RewardResult(None, "worker died (exit -24: SIGXCPU, over its CPU limit cpu_s)")


async def test_a_reply_is_never_unpickled(rewards: str, tmp_path: Path) -> None:
    out = tmp_path / "trap-sprung"
    pool = RewardPool(f"{rewards}:lies")
    try:
        result = await pool.score({"out": str(out)}, "")
    finally:
        await pool.close()
    assert result == RewardResult(None, "worker sent a malformed reply")
    assert not out.exists()
