"""The simulator's speed: this checkout's rollout engine against the one at another revision.

``laminar.simulate`` answers the paper's questions (how many rollouts, which schedule) by running
whole cells: a 7B cell on 16 GPUs is ~70k engine events, and the simulator's tests and the sweep
run dozens of cells. What a cell costs is mostly :class:`laminar.simulate.engine.SimEngine`, so
this benchmark times the same cells with the engine at ``--baseline`` (a git revision; its
``engine.py`` is loaded from ``git show`` and put in place of this checkout's for the baseline
runs) and with this checkout's, in pairs (``benchmarks/pairs.py``), alternating cell by cell
within each pair. Each side's figure is the CPU seconds (``process_time``) of every cell in
``CELLS``, after one untimed pair; the ratio is baseline
over subject (above 1: this checkout is faster). A speed-up is only worth having if the answers
stay the same, so every cell's outcome (its figures, less the simulation's own wall time) must be
equal on both sides, or the benchmark fails.

Usage: ``python benchmarks/simulator.py --baseline REV --json OUT.json [--pairs 3]``.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pairs import describe, summarise

import laminar.simulate.batches as batches
import laminar.simulate.continuous as continuous
import laminar.simulate.engine as engine
import laminar.simulate.multiplex as multiplex
from laminar.simulate.cells import run_cell

ROOT = Path(__file__).resolve().parents[1]
#: (system, model, GPUs): a cell of each kind of schedule, at the scale of the simulator's tests
CELLS = [
    ("verl", "7B", 16),
    ("stream", "7B", 16),
    ("areal", "7B", 16),
    ("laminar", "7B", 16),
    ("laminar", "7B", 64),
]
#: the modules that hold a reference to the engine class
USERS = (batches, continuous, multiplex)


def engine_at(revision: str) -> ModuleType:
    """``laminar/simulate/engine.py`` as it was at ``revision``, as a module of its own."""
    source = subprocess.run(
        ["git", "show", f"{revision}:laminar/simulate/engine.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    path = Path(tempfile.mkdtemp()) / "engine_baseline.py"
    path.write_text(source)
    name = "laminar.simulate.engine_baseline"  # a package member: its relative imports resolve
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def outcome(cell: Any) -> str:
    """A cell's figures, less the simulation's own wall time (which the speed-up changes)."""
    return re.sub(r"'wall_s': [0-9.e+-]+", "", repr(cell))


def run_with(engine_cls: type, cell: tuple[str, str, int]) -> tuple[float, str]:
    """CPU seconds of one cell with ``engine_cls`` in place, and the cell's outcome."""
    for module in USERS:
        module.SimEngine = engine_cls  # type: ignore[attr-defined]
    gc.collect()  # each run starts from the same heap, not the last run's garbage
    try:
        start = time.process_time()
        got = outcome(run_cell(*cell, warmup=1, measured=2))
        return time.process_time() - start, got
    finally:
        for module in USERS:
            module.SimEngine = engine.SimEngine  # type: ignore[attr-defined]


def one_pair(engines: dict[str, type], answers: dict[str, list[str]]) -> tuple[float, float]:
    """One pair: every cell with the baseline engine, then at once with this checkout's, cell by
    cell (a shared VM's speed drifts within seconds; alternating cell by cell keeps both sides of
    a pair under the same drift). Returns the two sides' total CPU seconds."""
    totals = {side: 0.0 for side in engines}
    outcomes: dict[str, list[str]] = {side: [] for side in engines}
    for cell in CELLS:
        for side, engine_cls in engines.items():
            seconds, got = run_with(engine_cls, cell)
            totals[side] += seconds
            outcomes[side].append(got)
    for side, got in outcomes.items():
        if answers.setdefault(side, got) != got:
            raise RuntimeError(f"the {side} engine gave other answers on a second run")
    return totals["baseline"], totals["subject"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", required=True, help="git revision of the baseline engine")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    if args.pairs < 3:
        parser.error(f"at least three pairs are needed for a median and a spread, got {args.pairs}")
    baseline = engine_at(args.baseline)
    answers: dict[str, list[str]] = {}
    engines = {"baseline": baseline.SimEngine, "subject": engine.SimEngine}
    one_pair(engines, answers)  # untimed: imports, caches, and each side's answers
    pairs = [one_pair(engines, answers) for _ in range(args.pairs)]
    result = summarise([b for b, _ in pairs], [s for _, s in pairs], higher_is_better=False)
    same = answers["baseline"] == answers["subject"]
    print(describe(f"simulator cells, CPU s ({args.baseline} / this checkout)", result))
    print(
        f"  baseline {result['baseline_median']:.2f} s, this checkout "
        f"{result['subject_median']:.2f} s; answers {'equal' if same else 'DIFFER'} "
        f"on all {len(CELLS)} cells"
    )
    if args.json:
        figures = {"baseline": args.baseline, "cells": CELLS, "same_answers": same, **result}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    if not same:
        raise SystemExit("the engines disagree: a faster engine must give the same answers")


if __name__ == "__main__":
    main()
