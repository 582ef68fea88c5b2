"""Run a process as if this machine's NUMA node 0 were small (tests/slow/test_vllm_cluster).

:func:`namespace_prefix` wraps a command so that it runs in a mount namespace in which
``/sys/devices/system/node/node0/meminfo`` (and ``/proc/meminfo``, for machines without NUMA
sysfs) say node 0 holds 2 GiB: the process cluster of ``test_vllm_cluster`` starts one of its two
vLLM rollouts that way, so our KV sizing (bytes, derived from the rollout's needs) must start
and generate there. vLLM's CPU worker logs the node's total beside the KV cache it set aside
(:data:`KV_LINE`), which is how the test knows vLLM read the small node.

By hand, ``python -m tests.support.small_node share MODEL_DIR`` (root and ``unshare(1)``) starts
bare vLLM on the small node sized the old way (``gpu_memory_utilization=0.05``), which vLLM's CPU
worker turns into 0.05 x the node's memory minus its own RSS: negative on a small node. It exits
with 3 when vLLM refuses to start with its "less than requested memory" error, 0 if it started.
The suite ran that until 2026-11-24 and vLLM refused every time; it is a second engine start
(three interpreters importing torch and vLLM), so it now runs only by hand.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import shutil
import sys
import traceback
from pathlib import Path

#: what the small node reports (kB): 2 GiB in all, 1.8 GiB free, no page cache to reclaim
SMALL = {"MemTotal": 2097152, "MemFree": 1887436, "MemAvailable": 1887436, "MemUsed": 209716}
RECLAIMABLE = ("Active(file)", "Inactive(file)", "SReclaimable", "Buffers", "Cached")
NODE0 = Path("/sys/devices/system/node/node0/meminfo")
#: vLLM's CPU worker, once its KV cache is set aside: "Explicitly set (0.02/2.0) GiB for KV cache
#: on node 0." (the cache, then the node's total)
KV_LINE = re.compile(r"Explicitly set \(([\d.]+)/([\d.]+)\) GiB for KV cache on node (\d+)")
#: set in the namespace's processes (the by-hand mode re-executes itself under the prefix once)
MARK = "LAMINAR_TEST_SMALL_NODE"


def can_unshare() -> bool:
    return shutil.which("unshare") is not None and os.geteuid() == 0


def small_meminfo(real: str) -> str:
    """``real`` (a node's or /proc's meminfo) with its totals made small: every key is kept, so
    whatever vLLM or psutil read is there, and what they count as available is the small node's."""
    lines = []
    for line in real.splitlines():
        parts = line.split()
        key_at = 2 if line.startswith("Node ") else 0
        if len(parts) <= key_at + 1:
            lines.append(line)
            continue
        key = parts[key_at].rstrip(":")
        value = SMALL.get(key, 0 if key in RECLAIMABLE else None)
        if value is not None:
            parts[key_at + 1] = str(value)
        lines.append(" ".join(parts))
    return "\n".join(lines) + "\n"


def namespace_prefix(directory: Path) -> tuple[str, ...]:
    """An argv prefix that runs a command on the small node: a private mount namespace, the small
    meminfo files (written to ``directory``) bound over the real ones, then ``exec`` of the
    command, so it keeps the pid it was started with (signals and ``wait`` reach it). Needs root
    and ``unshare(1)`` (:func:`can_unshare`)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "proc").write_text(small_meminfo(Path("/proc/meminfo").read_text()))
    mounts = [f"mount --bind {shlex.quote(str(directory / 'proc'))} /proc/meminfo"]
    if NODE0.exists():
        (directory / "node0").write_text(small_meminfo(NODE0.read_text()))
        mounts.append(f"mount --bind {shlex.quote(str(directory / 'node0'))} {NODE0}")
    script = " && ".join([*mounts, f"export {MARK}=1", 'exec "$@"'])
    return ("unshare", "--mount", "--propagation", "private", "sh", "-c", script, "small-node")


async def _share(model: str) -> int:
    from vllm.engine.arg_utils import AsyncEngineArgs

    from laminar.engines.vllm_engine import start_async_llm
    from laminar.proc import owned_dirs

    args = AsyncEngineArgs(
        model=model, max_model_len=256, max_num_seqs=8, enforce_eager=True,
        skip_tokenizer_init=True, gpu_memory_utilization=0.05,
    )  # fmt: skip
    try:
        llm, ipc = start_async_llm(args)  # its socket files in a directory of its own
    except Exception:
        traceback.print_exc()
        return 3
    llm.shutdown()
    owned_dirs.remove(ipc)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "share":
        sys.exit("usage: python -m tests.support.small_node share MODEL_DIR")
    if not os.environ.get(MARK):
        import tempfile

        prefix = namespace_prefix(Path(tempfile.mkdtemp(prefix="small-node-")))
        os.execvp(
            prefix[0], [*prefix, sys.executable, "-m", "tests.support.small_node", *sys.argv[1:]]
        )
    sys.exit(asyncio.run(_share(sys.argv[2])))
