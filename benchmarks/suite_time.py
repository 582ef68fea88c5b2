"""How long ``make test`` takes from a fresh clone: a baseline revision against another, here.

Issue 16 asks for a fresh-clone suite of at most half of "today's time on this machine", and the
machines this project runs on are not one speed: nearly the same tree's suite took 496-647 s
in different sessions, and the vLLM fleet's set-up 107 s on one machine and 205 s on another. A
suite time measured on one machine and a baseline measured on another compare the machines as
much as the suites. So this runs both here, in alternating pairs (:mod:`benchmarks.pairs`).

Each run is a fresh clone of its revision (no bytecode cache, no ``runs/``), whose ``make test``
(as that revision's Makefile defines it: its pytest options, its environment) is timed whole,
ruff included; its output is kept beside ``--json`` (``OUT-logs/``). What a clone needs from
``make setup`` comes from this checkout's ``.venv``, so nothing is downloaded or built: each
side gets a virtual environment of its own that sees this one's packages (a ``.pth`` line) and
has only its clone installed in it (editable), so every process a test starts (``sys.executable
-m laminar ...``, the ``laminar`` script) runs the clone's code. ``--patch FILE`` applies a patch
to the baseline's clone before each run: a baseline that cannot run here as it was (c0cc401
sized vLLM's KV cache as a share of NUMA node 0, which on this machine's kind is a negative
request: the bug of issue 14) can be given the smallest change that lets it, and the patch says
what it is.

Usage (run with this checkout's ``.venv/bin/python``; nothing else should run meanwhile; c0cc401's
runs leave vLLM's socket files in ``/tmp``, about 60 a run, which later revisions do not)::

    python benchmarks/suite_time.py --baseline c0cc401 \\
        --patch benchmarks/patches/c0cc401-kv-bytes.patch --json OUT.json [--pairs 3]

Ratio = the baseline's time / the subject's (above 1: the subject is faster); issue 16's goal is
a median of at least 2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pairs import alternate, describe  # benchmarks/pairs.py

ROOT = Path(__file__).resolve().parents[1]
GOAL = 2.0


class Side:
    """One revision: a directory its fresh clones go into, and the environment they run in."""

    def __init__(
        self, name: str, revision: str, work: Path, logs: Path, patch: Path | None
    ) -> None:
        self.name = name
        self.revision = revision
        self.repo = work / name / "repo"
        self.venv = work / name / "venv"
        self.patch = patch
        self.logs = logs

    def fresh_clone(self) -> None:
        """A new clone at the revision (the editable install points at this path, so the path
        stays and its content is made anew each run)."""
        shutil.rmtree(self.repo, ignore_errors=True)
        subprocess.run(["git", "clone", "-q", str(ROOT), str(self.repo)], check=True)
        subprocess.run(["git", "checkout", "-q", self.revision], cwd=self.repo, check=True)
        if self.patch is not None:
            subprocess.run(["git", "apply", str(self.patch.resolve())], cwd=self.repo, check=True)
        if not self.venv.exists():
            self._make_venv()
        (self.repo / ".venv").symlink_to(self.venv)
        (self.venv / ".laminar-installed").touch()  # make setup's stamp: newer than pyproject

    def _make_venv(self) -> None:
        """A venv that sees this checkout's packages and holds the clone, installed editable."""
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(self.venv)], check=True)
        python = str(self.venv / "bin" / "python")
        purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
        found = subprocess.run([python, "-c", purelib], capture_output=True, text=True, check=True)
        site = Path(found.stdout.strip())
        # after the clone's own editable finder (.pth files are read in name order)
        (site / "zz-laminar-main.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
        subprocess.run(
            [python, "-m", "pip", "install", "-q", "--no-deps",
             "--no-build-isolation", "-e", str(self.repo)],
            check=True,
        )  # fmt: skip
        bin_ = self.venv / "bin"
        (bin_ / "pytest").write_text(f'#!/bin/sh\nexec "{python}" -m pytest "$@"\n')
        (bin_ / "pytest").chmod(0o755)
        (bin_ / "ruff").symlink_to(Path(sys.prefix) / "bin" / "ruff")

    def run(self, index: int) -> dict[str, object]:
        """One fresh clone's ``make test``: its wall time and what pytest said."""
        self.fresh_clone()
        log = self.logs / f"{self.name}-{index}.log"
        start = time.monotonic()
        with log.open("w") as out:
            code = subprocess.run(
                ["make", "test"], cwd=self.repo, stdout=out, stderr=subprocess.STDOUT
            ).returncode
        wall = time.monotonic() - start
        text = log.read_text(errors="replace")
        summary = re.findall(r"=+ (.*?) in ([\d.]+)s", text)
        result = {
            "wall_s": wall,
            "returncode": code,
            "pytest_summary": summary[-1][0] if summary else None,
            "pytest_s": float(summary[-1][1]) if summary else None,
            "log": str(log),
        }
        print(
            f"{self.name} ({self.revision[:9]}) run {index}: {wall:.1f} s, exit {code}, "
            f"{result['pytest_summary']}",
            flush=True,
        )
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="the baseline revision")
    parser.add_argument("--subject", default="HEAD", help="the revision measured (default HEAD)")
    parser.add_argument("--patch", type=Path, help="a patch applied to each baseline clone")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--keep", action="store_true", help="keep the clones and their venvs")
    args = parser.parse_args()
    if args.pairs < 3:
        parser.error("at least three pairs")
    if sys.prefix == sys.base_prefix:  # the clones' venvs see the packages of the one running this
        parser.error("run it with the project's .venv/bin/python (make setup)")

    def resolve(rev: str) -> str:
        return subprocess.run(
            ["git", "rev-parse", rev], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()

    work = Path(tempfile.mkdtemp(prefix="laminar-suite-time-"))
    logs = args.json.with_name(args.json.stem + "-logs")  # each run's make test output, kept
    logs.mkdir(parents=True, exist_ok=True)
    base = Side("baseline", resolve(args.baseline), work, logs, args.patch)
    subj = Side("subject", resolve(args.subject), work, logs, None)
    runs: dict[str, list[dict[str, object]]] = {"baseline": [], "subject": []}

    def timed(side: Side) -> float:
        """One run of ``side``, kept in ``runs``; its wall time for the pair."""
        record = side.run(len(runs[side.name]))
        runs[side.name].append(record)
        return float(record["wall_s"])  # type: ignore[arg-type]

    try:
        result = alternate(
            lambda: timed(base), lambda: timed(subj), pairs=args.pairs, higher_is_better=False
        )
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    failed = [
        f"{side} run {i}"
        for side, rs in runs.items()
        for i, r in enumerate(rs)
        if r["returncode"] != 0
    ]
    report = {
        "baseline_revision": base.revision,
        "subject_revision": subj.revision,
        "patch": str(args.patch) if args.patch else None,
        "cores": os.cpu_count(),
        "runs": runs,
        "failed_runs": failed,
        **result,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    print(describe("make test, baseline time / subject time", result, GOAL))
    if failed:
        print(f"NOT COMPARABLE as it stands: {', '.join(failed)} failed (logs in {logs})")


if __name__ == "__main__":
    main()
