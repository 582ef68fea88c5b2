"""What caching bytecode saves an interpreter start (why ``make test`` caches it).

This project's machines set ``PYTHONDONTWRITEBYTECODE=1``. Then nothing is ever cached: each of
the ~470 interpreters a suite run starts (roles, supervisors, CLI calls, probes) compiles
Laminar's modules from source, and each pytest-xdist worker rewrites and compiles every test
module again when it collects. ``make test`` runs pytest without that variable.

Two figures, each in alternating pairs (``benchmarks/pairs.py``), CPU seconds of a child process
(user + system, from ``getrusage``):

* ``collect``: ``pytest --collect-only`` of the whole suite (what each of the 3 workers does);
* ``role_imports``: an interpreter importing the CLI and the rollout role (what every
  ``laminar serve`` does before anything else).

Baseline: ``PYTHONDONTWRITEBYTECODE=1`` and no ``__pycache__`` in the project's own folders (each
baseline run starts by deleting them: the machine as it is). Subject: the variable unset and the
cache an untimed run just filled (every start after a run's first). Third-party packages keep the
bytecode pip compiled at install on both sides (``PYTHONPYCACHEPREFIX`` is not used: it would
move their caches too). The ratio is baseline over subject CPU (above 1: the cache saves).
Usage: ``python benchmarks/bytecode.py --json OUT.json [--pairs 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pairs import alternate, describe

ROOT = Path(__file__).resolve().parents[1]

COMMANDS = {
    "collect": [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
    "role_imports": [
        sys.executable,
        "-c",
        "import laminar.cli, laminar.roles.rollout.service",
    ],
}


def cpu_of(argv: list[str], env: dict[str, str]) -> float:
    """CPU seconds (user + system) of one run of ``argv``, which must succeed."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"{argv} failed ({done.returncode}): {done.stderr[-2000:]}")
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


#: the project's own folders, whose bytecode the baseline must not find (gitignored caches)
PROJECT = ("laminar", "roles", "transport", "tests", "examples", "benchmarks")


def drop_caches() -> None:
    for folder in PROJECT:
        for cache in (ROOT / folder).rglob("__pycache__"):
            shutil.rmtree(cache, ignore_errors=True)


def measure(name: str, pairs: int) -> dict[str, Any]:
    argv = COMMANDS[name]
    no_cache = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    cache = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}

    def baseline() -> float:
        drop_caches()
        return cpu_of(argv, no_cache)

    def subject() -> float:
        cpu_of(argv, cache)  # fill the cache: a run's first start pays for it once
        return cpu_of(argv, cache)

    return alternate(baseline, subject, pairs=pairs, higher_is_better=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the raw figures here")
    parser.add_argument("--pairs", type=int, default=3)
    args = parser.parse_args()
    results = {}
    for name in COMMANDS:
        results[name] = measure(name, args.pairs)
        r = results[name]
        print(describe(f"{name}_no_cache_over_cache", r))
        print(f"  CPU-s: no cache {r['baseline_median']:.2f}, cache {r['subject_median']:.2f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
