"""What test files cost the machine: their CPU at a baseline revision against this checkout's.

Why CPU and not time: ``make test`` keeps both cores busy (1.93-1.94 of 2 on average, counted
from ``/proc/stat``), so the suite's wall time is its CPU divided by two, and a test that spends
less CPU shortens the suite wherever it runs. Its own wall time says little: under pytest-xdist
it stretches with whatever the other workers run beside it. And why not one suite run against
another: two full runs of the same tree here read 1,108 and 1,180 CPU-s (issue 16's 2026-11-29
stop), more than most single cuts save.

So this measures test files alone, serially, each run one ``pytest`` process: the CPU the whole
machine spent while it ran (``/proc/stat``: the test process, every role, engine and tool it
started, and the kernel's share, whoever ends up reaping them), in alternating pairs
(:mod:`benchmarks.pairs`). The baseline is each file as it was at ``--baseline`` (``git show``),
put in the file's place for the baseline's runs and the checkout's bytes put back after each
(in place, because test modules import each other by name: ``admin_fuzz`` imports
``test_admin_api``); the subject is the checkout's file. Only the test files differ between the
two sides: a change to ``laminar/`` is measured on both. Run it on a quiet machine: anything
else running is counted too. Killed mid-run, it may leave a file at its baseline version:
``git diff`` shows it.

Usage: ``python benchmarks/suite_cpu.py --baseline REV --json OUT.json [--pairs 3] FILE...``
(ratio = baseline CPU / this checkout's, per file).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pairs import alternate, describe  # benchmarks/pairs.py

ROOT = Path(__file__).resolve().parents[1]


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (all but idle and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def run_file(path: Path) -> float:
    """One serial pytest run of ``path``: the machine's busy CPU seconds while it ran."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # as make test
    before = busy_cpu_s()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)],
        cwd=ROOT, env=env, capture_output=True, text=True,
    )  # fmt: skip
    spent = busy_cpu_s() - before
    if done.returncode != 0:
        raise SystemExit(f"{path} failed:\n{done.stdout[-3000:]}\n{done.stderr[-2000:]}")
    return spent


def at_revision(path: Path, revision: str) -> bytes:
    """``path``'s bytes as they were at ``revision``."""
    rel = path.resolve().relative_to(ROOT)
    return subprocess.run(
        ["git", "show", f"{revision}:{rel.as_posix()}"], cwd=ROOT, capture_output=True, check=True
    ).stdout


def run_baseline(path: Path, baseline: bytes) -> float:
    """:func:`run_file` with ``baseline`` in ``path``'s place; the checkout's bytes back after."""
    ours = path.read_bytes()
    path.write_bytes(baseline)
    try:
        return run_file(path)
    finally:
        path.write_bytes(ours)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path, help="test files (paths)")
    parser.add_argument("--baseline", required=True, help="git revision of the baseline files")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    figures: dict[str, object] = {"baseline": args.baseline, "files": {}}
    for path in args.files:
        baseline = at_revision(path, args.baseline)
        result = alternate(
            lambda p=path, b=baseline: run_baseline(p, b),
            lambda p=path: run_file(p),
            pairs=args.pairs,
            higher_is_better=False,
        )
        print(describe(f"{path}: CPU-s, {args.baseline} / this checkout", result))
        print(
            f"  {result['baseline_median']:.1f} CPU-s at {args.baseline}, "
            f"{result['subject_median']:.1f} in this checkout (medians)"
        )
        figures["files"][str(path)] = result  # type: ignore[index]
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
