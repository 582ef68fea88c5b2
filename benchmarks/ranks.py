"""How long a trainer's data-parallel group takes to form on one host: ranks spawned as fresh
interpreters against ranks forked from a server that imported their code once.

``DataParallelGroup`` (``roles/trainer/dp.py``) starts ranks 1..W-1 as ``multiprocessing``
children; a rank must import torch and transformers before it can join the group's rendezvous.

* ``spawn`` (the baseline, how ranks started before): each rank a fresh interpreter;
* ``forkserver`` (``dp.rank_processes``, now): one server imports ``roles.trainer.worker`` the
  first time a group forms in this process, and every rank is forked from it.

A figure is the wall time of ``DataParallelGroup(config)``, from the call until every rank has
joined the group and rank 0 holds the model, then the group is closed. The forkserver's first
group pays for starting the server (``first_forkserver_s``, measured before the pairs and not
counted in them); the pairs compare what every later group pays: a trainer whose group forms
again, or a host whose seven ranks all start from the one server. ``speedup = spawn time /
forkserver time``, the median of ``--pairs`` alternating pairs (``benchmarks/pairs.py``).

    python benchmarks/ranks.py --json runs/bench/ranks.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import pairs  # noqa: E402  (benchmarks/pairs.py)

from laminar.roles.trainer import dp  # noqa: E402
from laminar.roles.trainer.config import TrainerConfig  # noqa: E402
from tests.support.models import tiny_qwen2  # noqa: E402


def form(config: TrainerConfig, context: str) -> float:
    """Seconds to form a group whose ranks start from ``context``; the group is closed after."""
    original = dp.rank_processes
    if context == "spawn":  # the baseline: how ranks started before dp.rank_processes
        dp.rank_processes = lambda: mp.get_context("spawn")
    try:
        start = time.perf_counter()
        group = dp.DataParallelGroup(config, timeout_s=120)
        took = time.perf_counter() - start
        group.close()
    finally:
        dp.rank_processes = original
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2, help="ranks in the group (default 2)")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="laminar-bench-ranks-") as tmp:
        model = tiny_qwen2(Path(tmp) / "model")
        config = TrainerConfig(model=str(model), data_parallel=args.world, threads_per_rank=1)
        first = form(config, "forkserver")
        print(f"first forkserver group (starts the server): {first:.2f} s", flush=True)
        result = pairs.alternate(
            lambda: form(config, "spawn"),
            lambda: form(config, "forkserver"),
            pairs=args.pairs,
            higher_is_better=False,
        )
    print(pairs.describe("speedup (spawn s / forkserver s)", result))
    print(
        f"spawn {result['baseline_median']:.2f} s, forkserver {result['subject_median']:.2f} s "
        f"(medians), world {args.world}"
    )
    figures: dict[str, Any] = {
        "speedup": result["ratio_median"],
        "first_forkserver_s": first,
        "world": args.world,
        **{k: v for k, v in result.items() if k != "ratio_median"},
    }
    print(json.dumps(figures))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
