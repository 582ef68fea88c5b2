"""Generation throughput: bare vLLM against the same load through the rollout and data roles.

Two runs in one invocation, on the example task's model and prompts, with identical requests
(the same prompts x samples, the same per-trajectory sampling seeds, max_tokens, EOS):

1. ``bare``: vLLM's own ``AsyncLLM.generate`` in this process, ``--concurrency`` requests in
   flight (a worker pool), outputs only at the end (vLLM's cheapest mode). Tokens / wall time from
   the first submit to the last finish.
2. ``role``: manager + data + one rollout as processes (``laminar serve``), the rollout keeping
   ``--concurrency`` trajectories in flight, streaming partial tokens to the data role, which
   stores them durably, stores and scores every trajectory. Tokens / (last finished_at - first
   started_at) of the trajectories the data role holds.

``overhead_ratio = role / bare`` (goal >= 0.95), measured in alternating pairs
(``benchmarks/pairs.py``): bare, role, bare, role, ... (``--pairs``, at least three); the figure
is the median of the pair ratios, with their spread. Both share this machine's cores; the role
run also pays for the data and manager processes, which is the overhead being measured.

    python benchmarks/generation.py --json runs/bench/generation.json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from laminar.engines.configs import VllmEngineConfig  # noqa: E402
from laminar.engines.vllm_engine import engine_args, eos_token_ids  # noqa: E402
from laminar.harness.launch import ProcessCluster  # noqa: E402
from laminar.roles.data.api import DataApi, SampleRequest  # noqa: E402
from laminar.roles.data.prompts import load_tokenizer, read_records  # noqa: E402
from laminar.roles.data.service import trajectory_seed  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pairs  # noqa: E402  (benchmarks/pairs.py)

TASK = ROOT / "examples" / "arith" / "task.py"


def prepare(args: argparse.Namespace, work: Path) -> tuple[Path, Path]:
    """The model directory and a prompts JSONL of ``--prompts`` records."""
    model = Path(args.model) if args.model else work / "arith-init"
    if not (model / "config.json").is_file():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "laminar",
                "model",
                "init",
                "--task",
                str(TASK.parent),
                "--out",
                str(model),
            ],
            check=True,
        )
    data = work / "arith-data"
    if not (data / "test.jsonl").is_file():
        subprocess.run(
            [
                sys.executable,
                str(TASK),
                "generate",
                "--out",
                str(data),
                "--train",
                "0",
                "--test",
                str(max(args.prompts, 64)),
                "--seed",
                "1",
            ],
            check=True,
        )
    records = read_records(data / "test.jsonl")[: args.prompts]
    prompts = work / f"prompts-{args.prompts}.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    return model, prompts


def engine_config(args: argparse.Namespace, model: Path) -> VllmEngineConfig:
    extra = {} if args.stream_interval is None else {"stream_interval": args.stream_interval}
    return VllmEngineConfig(
        model=str(model), max_model_len=args.max_model_len, max_num_seqs=args.concurrency, **extra
    )


async def run_bare(args: argparse.Namespace, model: Path, prompts: Path) -> dict[str, float]:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    tok = load_tokenizer(model)
    records = read_records(prompts)
    jobs = [
        (f"{r['id']}/{k}", tok.encode(r["prompt"]).ids)
        for r in records
        for k in range(args.samples)
    ]
    eos = eos_token_ids(str(model))
    llm = AsyncLLM.from_engine_args(engine_args(engine_config(args, model)))
    tokens = 0

    async def one(tid: str, ids: list[int]) -> None:
        nonlocal tokens
        sp = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=1.0,
            seed=trajectory_seed(args.seed, tid),
            stop_token_ids=eos,
            logprobs=0,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        async for out in llm.generate({"prompt_token_ids": ids}, sp, tid):
            if out.finished:
                tokens += len(out.outputs[0].token_ids)

    async def worker(queue: list[tuple[str, list[int]]]) -> None:
        while queue:
            await one(*queue.pop(0))

    try:
        # the rollout's engine warms up the same way before it reports ready (VllmEngine._warmup)
        warm = SamplingParams(max_tokens=4, temperature=1.0, logprobs=0, detokenize=False)

        async def warmup(i: int) -> None:
            async for _ in llm.generate({"prompt_token_ids": [i % 2] * 8}, warm, f"warmup-{i}"):
                pass

        await asyncio.gather(*(warmup(i) for i in range(min(8, args.concurrency))))
        tokens = 0
        queue = list(jobs)
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(queue) for _ in range(args.concurrency)))
        wall = time.perf_counter() - t0
    finally:
        llm.shutdown()
        llm = None  # collect it now: its __del__ at interpreter exit would find vLLM torn down
        gc.collect()
    return {"tokens": tokens, "seconds": wall, "requests": len(jobs)}


async def run_role(
    args: argparse.Namespace, model: Path, prompts: Path, work: Path, run: int
) -> dict[str, float]:
    from laminar.config import ClusterConfig
    from laminar.rpc_client import RpcClient, remote
    from laminar.service import transport_options

    token = "bench-token-0123456789abcdef"
    # a fresh store: one left by an earlier invocation's run of this number (`--work` reused)
    # would be resumed, its trajectories all served already
    shutil.rmtree(work / f"role-{run}", ignore_errors=True)
    config = {
        "cluster": {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 5.0, "nice": args.nice},
        "manager": {"bind": "tcp://127.0.0.1:0", "metrics": None, "admin": "127.0.0.1:0"},
        "data": {
            "prompts": str(prompts),
            "tokenizer": str(model),
            "reward": f"{TASK}:reward",
            "samples_per_prompt": args.samples,
            "sampling": {"max_tokens": args.max_tokens, "temperature": 1.0, "seed": args.seed},
            "store": str(work / f"role-{run}" / "data.sqlite"),
            "metrics": None,
        },
        "rollout": {
            "metrics": None,
            "concurrency": args.concurrency,
            "engine": engine_config(args, model).model_dump(),
        },
    }
    path = work / "role.yaml"
    path.write_text(yaml.safe_dump(config))
    total = len(read_records(prompts)) * args.samples
    logs = work / f"role-{run}" / "logs"
    # unpinned, as the bare engine it is compared with
    with ProcessCluster(path, logs, env={"LAMINAR_TOKEN": token}, pin_rollouts=False) as cluster:
        cluster.serve("manager", "manager")
        data_info = cluster.serve("data", "data-0")
        cluster.serve("rollout", "rollout-0", timeout=300)
        client = RpcClient(data_info["address"], transport_options(ClusterConfig(), token.encode()))
        data = remote(DataApi, client)
        try:
            while not (await data.status.call()).finished:  # noqa: ASYNC110 - another process
                await asyncio.sleep(0.5)
            trajectories = (await data.sample.call(SampleRequest(n=total))).items
        finally:
            await client.close()
    start = min(t.started_at for t in trajectories)
    end = max(t.finished_at for t in trajectories)
    tokens = sum(len(t.response_token_ids) for t in trajectories)
    return {"tokens": tokens, "seconds": end - start, "requests": len(trajectories)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="model directory (default: a fresh `laminar model init`)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--stream-interval",
        type=int,
        help="the rollout engine's stream_interval (default: the config's); bare vLLM streams "
        "nothing either way",
    )
    parser.add_argument(
        "--pairs", type=int, default=3, help="alternating bare/role pairs (at least three)"
    )
    parser.add_argument(
        "--nice",
        type=int,
        default=0,
        help="the roles' cluster.nice (laminar.proc.placement; default 0, the config's default)",
    )
    parser.add_argument("--work", help="scratch directory (default: a temporary one)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="laminar-bench-gen-"))
    work.mkdir(parents=True, exist_ok=True)
    model, prompts = prepare(args, work)
    bares, roles = [], []
    for run in range(args.pairs):  # alternating, so drift in the machine hits both alike
        bares.append(asyncio.run(run_bare(args, model, prompts)))
        roles.append(asyncio.run(run_role(args, model, prompts, work, run)))
    bare_runs = [b["tokens"] / b["seconds"] for b in bares]
    role_runs = [r["tokens"] / r["seconds"] for r in roles]
    ratio = pairs.summarise(bare_runs, role_runs)
    bare_tps, role_tps = ratio["baseline_median"], ratio["subject_median"]
    bare, role = bares[-1], roles[-1]
    figures = {
        "vllm_bare_tokens_per_s": round(bare_tps, 1),
        "rollout_role_tokens_per_s": round(role_tps, 1),
        "overhead_ratio": round(ratio["ratio_median"], 4),
        "overhead_ratio_pairs": [round(r, 4) for r in ratio["ratios"]],
        "overhead_ratio_spread": round(ratio["spread"], 4),
        "pairs_agree": ratio["pairs_agree"],
        "bare_runs_tokens_per_s": [round(x, 1) for x in bare_runs],
        "role_runs_tokens_per_s": [round(x, 1) for x in role_runs],
        "bare": bares,
        "role": roles,
        "settings": {
            "pairs": args.pairs,
            "model": str(model),
            "prompts": args.prompts,
            "samples": args.samples,
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "stream_interval": engine_config(args, model).stream_interval,
            "nice": args.nice,
        },
    }
    for name, tps, last in (("bare vLLM", bare_tps, bare), ("role path", role_tps, role)):
        print(
            f"{name:10s} {tps:9.1f} tokens/s median  (last: {last['tokens']} tokens in "
            f"{last['seconds']:.1f} s)"
        )
    print(pairs.describe("overhead_ratio (role / bare)", ratio, goal=0.95))
    print(json.dumps(figures))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
