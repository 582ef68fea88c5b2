"""Tool calls per second in the sandbox: the jail's fork server against a jail started per call.

An agentic episode calls its tool on many turns (``examples/arith_tool``: about five an episode, 64
episodes a trained version), and each call is a jailed process: what a call costs in CPU is taken
from the engines and the trainer on the same cores. Both sides run the same calls (the arith_tool
calculator's ``print(a + b)``), ``--concurrency`` at a time, with the same limits, a uid of its
own per call (as root) and the same clean-up (:func:`laminar.tools.sandbox.run_python`'s):

* ``per_call`` (the baseline): each call starts the jail program as a process of its own
  (``python -I -S jail.py SPEC.json``: one interpreter start per call; before the server a call
  started two, the jail's and then the tool's own, so this baseline is the cheaper of the two);
* ``server``: :func:`run_python`, whose calls are forks of this process's jail server.

``speedup = server calls/s / per_call calls/s``, the median of ``--pairs`` alternating pairs
(``benchmarks/pairs.py``), each side calling for ``--seconds``.

    python benchmarks/sandbox.py --json runs/bench/sandbox.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from laminar.tools import sandbox  # noqa: E402
from laminar.tools.jailserver import JAIL  # noqa: E402
from laminar.tools.sandbox import SandboxLimits, run_python  # noqa: E402
from laminar.tools.uids import CLAIMS  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pairs  # noqa: E402  (benchmarks/pairs.py)

#: the arith_tool calculator's limits (examples/arith_tool/task.py)
LIMITS = SandboxLimits(cpu_s=1, wall_s=5, memory_mib=256, output_bytes=1024)


async def per_call(code: str) -> str:
    """One call as a jail process of its own, with run_python's spec and clean-up."""
    uid = CLAIMS.claim() if os.geteuid() == 0 else None
    spec = sandbox._spec(code, LIMITS, uid)
    fd, name = tempfile.mkstemp(prefix="laminar-jail-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(spec, f)
        proc = await asyncio.create_subprocess_exec(
            sandbox.interpreter(uid is not None), "-I", "-S", JAIL, name,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
        )  # fmt: skip
        out, err = await proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"per-call jail failed ({proc.returncode}): {err.decode()}")
        return out.decode()
    finally:
        os.unlink(name)
        if os.path.lexists(str(spec["workdir"])):  # noqa: ASYNC240 - as run_python
            sandbox._cleanup(str(spec["workdir"]), uid)
        elif uid is not None:
            CLAIMS.release(uid)


async def server(code: str) -> str:
    result = await run_python(code, LIMITS)
    if not result.ok:
        raise RuntimeError(f"server call failed: {result.reason}: {result.stderr}")
    return result.stdout


async def rate(call: Any, seconds: float, concurrency: int) -> float:
    """Calls per second over ``seconds``, ``concurrency`` callers each calling in turn (every
    answer checked); the calls in flight at the end are waited for and counted."""
    done = 0
    t0 = time.perf_counter()

    async def caller(k: int) -> None:
        nonlocal done
        i = k
        while time.perf_counter() - t0 < seconds:
            out = await call(f"print({i} + {i % 9 + 1})")
            assert out == f"{i + i % 9 + 1}\n", out
            done += 1
            i += concurrency

    await asyncio.gather(*(caller(k) for k in range(concurrency)))
    return done / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="each side's time per pair")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    async def run() -> dict[str, Any]:
        await rate(server, 1.0, args.concurrency)  # the server started, both paths' caches warm
        await rate(per_call, 1.0, args.concurrency)
        base, subj = [], []
        for _ in range(args.pairs):
            base.append(await rate(per_call, args.seconds, args.concurrency))
            subj.append(await rate(server, args.seconds, args.concurrency))
            print(f"per call {base[-1]:.0f} calls/s, server {subj[-1]:.0f} calls/s", flush=True)
        return pairs.summarise(base, subj)

    ratio = asyncio.run(run())
    figures = {
        "per_call_calls_per_s": round(ratio["baseline_median"], 1),
        "server_calls_per_s": round(ratio["subject_median"], 1),
        "speedup": round(ratio["ratio_median"], 3),
        "speedup_pairs": [round(r, 3) for r in ratio["ratios"]],
        "speedup_spread": round(ratio["spread"], 3),
        "pairs_agree": ratio["pairs_agree"],
        "settings": {"seconds": args.seconds, "concurrency": args.concurrency, "pairs": args.pairs},
    }
    print(
        pairs.describe("speedup (server / per call)", ratio)
        + f"; per call {figures['per_call_calls_per_s']:.0f}, "
        f"server {figures['server_calls_per_s']:.0f} calls/s"
    )
    print(json.dumps(figures))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
