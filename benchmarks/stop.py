"""How long a role process takes to exit once its work is done: the interpreter's own exit
against :func:`laminar.cli.serve.exit_without_final_collection`.

A role that stopped has nothing left to do but exit, and the interpreter's exit collects and
tears down every object its imports made: seconds for a process that imported vLLM (a rollout,
and each of its engine's processes) or torch (the trainer). Those seconds count against the
role's stop grace period and come in every ``laminar run`` stop, every restart and every test
teardown. Both sides here run the same child, which imports the role's modules, writes the time
and then ends:

* ``interpreter`` (the baseline): returns from its script, as every role did before;
* ``fast``: calls ``exit_without_final_collection(0)``, as ``laminar serve`` now does after a
  clean stop (threads joined, atexit handlers run, streams flushed, ``os._exit``).

The figure of one run is the time from the child's last timestamp to its exit as this process
sees it (``waitpid``); ``speedup = interpreter time / fast time``, the median of ``--pairs``
alternating pairs (``benchmarks/pairs.py``), one result per module set.

    python benchmarks/stop.py --json runs/bench/stop.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import pairs  # noqa: E402  (benchmarks/pairs.py)

#: what each role's process imports (the rollout's engine processes import vLLM alike)
MODULES = {
    "rollout": "laminar.roles.rollout.service, laminar.engines.vllm_engine, "
    "vllm.v1.engine.async_llm",
    "trainer": "laminar.roles.trainer.service, roles.trainer.torch_compute",
    "cli": "laminar.cli",
}

CHILD = """
import sys, time
import {modules}
from laminar.cli.serve import exit_without_final_collection
print(time.time(), flush=True)
if sys.argv[1] == "fast":
    exit_without_final_collection(0)
"""


def exit_seconds(modules: str, mode: str) -> float:
    """Seconds from the child's last line to its exit."""
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD.format(modules=modules), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    proc.wait()
    ended = time.time()
    if proc.returncode != 0 or not line.strip():
        raise RuntimeError(f"the child failed ({proc.returncode}) importing {modules}")
    return ended - float(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--roles", nargs="+", default=["rollout", "trainer"], choices=MODULES)
    parser.add_argument("--json", type=Path, help="write the raw figures here")
    args = parser.parse_args()
    results: dict[str, Any] = {}
    for role in args.roles:
        modules = MODULES[role]
        result = pairs.alternate(
            lambda modules=modules: exit_seconds(modules, "interpreter"),
            lambda modules=modules: exit_seconds(modules, "fast"),
            pairs=args.pairs,
            higher_is_better=False,
        )
        results[role] = result
        print(
            f"{role}: interpreter exit {result['baseline_median']:.2f} s, "
            f"fast exit {result['subject_median']:.2f} s; "
            + pairs.describe("speedup (interpreter / fast)", result),
            flush=True,
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    print(json.dumps({role: r["ratio_median"] for role, r in results.items()}))


if __name__ == "__main__":
    main()
