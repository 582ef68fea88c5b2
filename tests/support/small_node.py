"""Start a vLLM engine as if this machine's NUMA node 0 were small (run by tests/slow).

``python -m tests.support.small_node bytes|share MODEL_DIR`` inside a mount namespace in which
``/sys/devices/system/node/node0/meminfo`` (and ``/proc/meminfo``) say node 0 holds 2 GiB:

* ``bytes`` (what the suite runs): our engine (KV cache in bytes, derived from the rollout's
  needs) starts and generates; exits 0 when it generated the tokens asked for. vLLM's worker
  logs the node's total beside the KV cache it set aside, which is how the test knows vLLM saw
  the small node.
* ``share`` (by hand; the suite ran it until 2026-11-24): bare vLLM sized the old way
  (``gpu_memory_utilization=0.05``), which vLLM's CPU worker turns into 0.05 x the node's memory
  minus its own RSS: negative on a small node. Exits with 3 when vLLM refuses to start with its
  "less than requested memory" error, 0 if it started.
"""

from __future__ import annotations

import asyncio
import sys
import traceback

#: what the small node reports (kB): 2 GiB in all, 1.8 GiB free, no page cache to reclaim
SMALL = {"MemTotal": 2097152, "MemFree": 1887436, "MemAvailable": 1887436, "MemUsed": 209716}
RECLAIMABLE = ("Active(file)", "Inactive(file)", "SReclaimable", "Buffers", "Cached")


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


async def _share(model: str) -> int:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(
        model=model, max_model_len=256, max_num_seqs=8, enforce_eager=True,
        skip_tokenizer_init=True, gpu_memory_utilization=0.05,
    )  # fmt: skip
    try:
        llm = AsyncLLM.from_engine_args(args)
    except Exception:
        traceback.print_exc()
        return 3
    llm.shutdown()
    return 0


async def _bytes(model: str) -> int:
    from laminar.engines import EngineRequest, VllmEngineConfig, create_engine
    from laminar.trajectory import SamplingParams

    engine = create_engine(VllmEngineConfig(model=model, max_model_len=256, max_num_seqs=8))
    await engine.start()
    try:
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        await engine.add_request(EngineRequest(request_id="r", prompt_token_ids=[3, 4, 5],
                                               params=params))  # fmt: skip
        tokens: list[int] = []
        async with asyncio.timeout(60):
            async for batch in engine.outputs():
                for out in batch:
                    tokens += out.token_ids
                if any(out.finished for out in batch):
                    break
        print(f"generated {len(tokens)} tokens")
        return 0 if len(tokens) == 16 else 1
    finally:
        await engine.close()


if __name__ == "__main__":
    mode, model = sys.argv[1], sys.argv[2]
    sys.exit(asyncio.run(_share(model) if mode == "share" else _bytes(model)))
