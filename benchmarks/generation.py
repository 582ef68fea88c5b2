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
(``benchmarks/pairs.py``); the figure is the median of the pair ratios, with their spread. Both
share this machine's cores; the role run also pays for the data and manager processes, which is
the overhead being measured. Two ways to alternate (``--mode``):

* ``segments`` (the default): both set-ups start once and stay up, and the pairs are segments of
  ``--prompts`` x ``--samples`` requests each: the role path generates one (the data role's
  ``max_ahead`` lets the rollout lease exactly that many), the rollout is drained, the segment's
  trajectories are taken, and bare vLLM then generates the very same requests (their prompt
  tokens and per-trajectory seeds); the rollout is resumed for the next. ``--warmup-pairs``
  (default 1) run first and are not counted: a side's first segment is its first real load.
  Each side waits ``--settle`` seconds before its segment, so the other side's idle engine has
  stopped polling (vLLM's engine core and worker spin only about a second after their last
  work). No start-up, no model load and no fresh interpreter sits between the two sides of a
  pair.
  Each segment also counts CPU seconds per 1,000 tokens (``cpu_s_per_1k_tokens``): of the
  rollout, data and manager processes over the role segment (each process alone, not the
  rollout's engine processes), and of this process (bare vLLM's front end) over the bare one.
  On 2 cores shared with an engine that keeps both busy, that work is the overhead; it moves far
  less from one hour to the next than tokens/s do.
* ``fresh``: each run starts its own engine (bare) or cluster (role) and stops it afterwards, the
  protocol of every figure measured before 2026-11-27; pairs a minute apart, each
  behind a start-up, disagreed by 15% and more on this 2-core VM.

    python benchmarks/generation.py --json runs/bench/generation.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from laminar.engines.configs import VllmEngineConfig  # noqa: E402
from laminar.engines.vllm_compat import token_prompt  # noqa: E402
from laminar.engines.vllm_engine import (  # noqa: E402
    engine_args,
    eos_token_ids,
    start_async_llm,
)
from laminar.harness.launch import ProcessCluster  # noqa: E402
from laminar.proc import owned_dirs  # noqa: E402
from laminar.proc.procfs import stat  # noqa: E402
from laminar.roles.data.api import DataApi, SampleRequest  # noqa: E402
from laminar.roles.data.prompts import load_tokenizer, read_records  # noqa: E402
from laminar.roles.data.service import trajectory_seed  # noqa: E402
from laminar.roles.rollout.api import DrainRequest, RolloutApi  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pairs  # noqa: E402  (benchmarks/pairs.py)

TASK = ROOT / "examples" / "arith" / "task.py"

#: the role processes whose CPU a segment counts (each process alone, not its engine's children)
ROLE_PROCESSES = {"rollout": "rollout-0", "data": "data-0", "manager": "manager"}


def cpu_per_1k(bares: list[dict[str, Any]], roles: list[dict[str, Any]]) -> dict[str, Any]:
    """Per process: the CPU seconds per 1,000 tokens of each pair's segment, and their median
    (``segments`` mode only: ``fresh`` runs count no CPU)."""
    out: dict[str, Any] = {}
    for side in (roles, bares):
        if not side or "cpu_s" not in side[0]:
            continue
        for name in side[0]["cpu_s"]:
            runs = [1000 * r["cpu_s"][name] / r["tokens"] for r in side]
            out[name] = {"median": statistics.median(runs), "pairs": runs}
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads)."""
    st = stat(pid)
    if st is None:
        raise RuntimeError(f"process {pid} is gone: its CPU time cannot be read")
    return st.cpu / os.sysconf("SC_CLK_TCK")


def prepare(args: argparse.Namespace, work: Path, n: int) -> tuple[Path, Path]:
    """The model directory and a prompts JSONL of ``n`` records."""
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
    data = work / f"arith-data-{max(n, 64)}"
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
                str(max(n, 64)),
                "--seed",
                "1",
            ],
            check=True,
        )
    records = read_records(data / "test.jsonl")[:n]
    prompts = work / f"prompts-{n}.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    return model, prompts


def engine_config(args: argparse.Namespace, model: Path) -> VllmEngineConfig:
    extra = {} if args.stream_interval is None else {"stream_interval": args.stream_interval}
    return VllmEngineConfig(
        model=str(model), max_model_len=args.max_model_len, max_num_seqs=args.concurrency, **extra
    )


def bare_start(args: argparse.Namespace, model: Path) -> tuple[Any, Path]:
    """vLLM's ``AsyncLLM`` on the rollout's engine settings (warmed up by :func:`bare_warm`),
    and the directory of its socket files (:func:`bare_stop` removes it)."""
    return bare_llm(engine_args(engine_config(args, model)))


def bare_llm(args: Any) -> tuple[Any, Path]:
    """``AsyncLLM`` on vLLM's engine ``args``, started as the rollout's engine starts it
    (``start_async_llm``: its socket files in a directory of this process's own, else each start
    leaves 7 in ``/tmp``; then the environment cache on); the engine and that directory."""
    from vllm import envs

    llm, ipc = start_async_llm(args)
    envs.enable_envs_cache()  # as the rollout's engine does (VllmEngine.start)
    return llm, ipc


async def bare_warm(llm: Any, args: argparse.Namespace) -> None:
    """What the rollout's engine does before it reports ready (``VllmEngine._warmup``)."""
    from vllm import SamplingParams

    warm = SamplingParams(max_tokens=4, temperature=1.0, logprobs=0, detokenize=False)

    async def one(i: int) -> None:
        async for _ in llm.generate(token_prompt([i % 2] * 8), warm, f"warmup-{i}"):
            pass

    await asyncio.gather(*(one(i) for i in range(min(8, args.concurrency))))


def bare_stop(llm: Any, ipc: Path) -> None:
    llm.shutdown()
    gc.collect()  # now: its __del__ at interpreter exit would find vLLM torn down
    owned_dirs.remove(ipc)


async def bare_generate(
    llm: Any, jobs: list[tuple[str, list[int]]], args: argparse.Namespace, eos: list[int]
) -> dict[str, float]:
    """``jobs`` (trajectory id, prompt token ids) through ``llm``, ``--concurrency`` in flight,
    each seeded as the data role seeds that trajectory; tokens and wall time."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

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
        async for out in llm.generate(token_prompt(ids), sp, tid):
            if out.finished:
                tokens += len(out.outputs[0].token_ids)

    queue = list(jobs)

    async def worker() -> None:
        while queue:
            await one(*queue.pop(0))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    return {"tokens": tokens, "seconds": time.perf_counter() - t0, "requests": len(jobs)}


async def run_bare(args: argparse.Namespace, model: Path, prompts: Path) -> dict[str, float]:
    """``fresh``: an engine of its own for one run of every prompt x sample."""
    tok = load_tokenizer(model)
    jobs = [
        (f"{r['id']}/{k}", tok.encode(r["prompt"]).ids)
        for r in read_records(prompts)
        for k in range(args.samples)
    ]
    llm, ipc = bare_start(args, model)
    try:
        await bare_warm(llm, args)
        return await bare_generate(llm, jobs, args, eos_token_ids(str(model)))
    finally:
        bare_stop(llm, ipc)


TOKEN = "bench-token-0123456789abcdef"


def role_config(
    args: argparse.Namespace, model: Path, prompts: Path, store: Path, max_ahead: int | None
) -> dict[str, Any]:
    return {
        "cluster": {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 5.0, "nice": args.nice},
        "manager": {"bind": "tcp://127.0.0.1:0", "metrics": None, "admin": "127.0.0.1:0"},
        "data": {
            "prompts": str(prompts),
            "tokenizer": str(model),
            "reward": f"{TASK}:reward",
            "samples_per_prompt": args.samples,
            "sampling": {"max_tokens": args.max_tokens, "temperature": 1.0, "seed": args.seed},
            "store": str(store),
            "metrics": None,
            "max_ahead": max_ahead,
        },
        "rollout": {
            "metrics": None,
            "concurrency": args.concurrency,
            "engine": engine_config(args, model).model_dump(),
        },
    }


def role_figures(trajectories: list[Any]) -> dict[str, float]:
    """Tokens over the time from the first trajectory started to the last finished."""
    start = min(t.started_at for t in trajectories)
    end = max(t.finished_at for t in trajectories)
    tokens = sum(len(t.response_token_ids) for t in trajectories)
    return {"tokens": tokens, "seconds": end - start, "requests": len(trajectories)}


@contextlib.asynccontextmanager
async def role_cluster(
    args: argparse.Namespace, work: Path, config: dict[str, Any], logs: Path
) -> AsyncIterator[tuple[Any, Any]]:
    """Manager, data and one rollout as processes; typed clients of the data role and rollout."""
    from laminar.runtime.config import ClusterConfig
    from laminar.runtime.context import transport_options
    from laminar.runtime.rpc.client import RpcClient, remote

    path = work / "role.yaml"
    path.write_text(yaml.safe_dump(config))
    options = transport_options(ClusterConfig(), TOKEN.encode())
    # unpinned, as the bare engine it is compared with
    with ProcessCluster(path, logs, env={"LAMINAR_TOKEN": TOKEN}, pin_rollouts=False) as cluster:
        cluster.serve("manager", "manager")
        data_info = cluster.serve("data", "data-0")
        rollout_info = cluster.serve("rollout", "rollout-0", timeout=300)
        data_client = RpcClient(data_info["address"], options)
        rollout_client = RpcClient(rollout_info["address"], options)
        pids = {role: cluster.procs[name].pid for role, name in ROLE_PROCESSES.items()}
        try:
            yield remote(DataApi, data_client), remote(RolloutApi, rollout_client), pids
        finally:
            await data_client.close()
            await rollout_client.close()


async def run_role(
    args: argparse.Namespace, model: Path, prompts: Path, work: Path, run: int
) -> dict[str, float]:
    """``fresh``: a cluster of its own for one run of every prompt x sample."""
    # a fresh store: one left by an earlier invocation's run of this number (`--work` reused)
    # would be resumed, its trajectories all served already
    shutil.rmtree(work / f"role-{run}", ignore_errors=True)
    config = role_config(args, model, prompts, work / f"role-{run}" / "data.sqlite", None)
    total = len(read_records(prompts)) * args.samples
    async with role_cluster(args, work, config, work / f"role-{run}" / "logs") as (data, _, _):
        while not (await data.status.call()).finished:  # noqa: ASYNC110 - another process
            await asyncio.sleep(0.5)
        trajectories = (await data.sample.call(SampleRequest(n=total))).items
    return role_figures(trajectories)


async def run_segments(
    args: argparse.Namespace, model: Path, prompts: Path, work: Path
) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """``segments``: both set-ups up at once, alternating segments of the same requests."""
    segment = args.prompts * args.samples
    eos = eos_token_ids(str(model))
    bares: list[dict[str, float]] = []
    roles: list[dict[str, float]] = []
    llm, ipc = bare_start(args, model)
    try:
        await bare_warm(llm, args)  # then idle: its processes stop polling before the roles start
        shutil.rmtree(work / "segments", ignore_errors=True)
        # the data role leases one segment's trajectories and no more until they are taken
        config = role_config(args, model, prompts, work / "segments" / "data.sqlite", segment)
        async with role_cluster(args, work, config, work / "segments" / "logs") as (
            data,
            rollout,
            pids,
        ):
            for k in range(args.warmup_pairs + args.pairs):
                if k:
                    await asyncio.sleep(args.settle)
                before = {role: cpu_seconds(pid) for role, pid in pids.items()}
                if k:
                    await rollout.resume.call()
                while (await data.status.call()).scored < (k + 1) * segment:  # noqa: ASYNC110
                    await asyncio.sleep(0.5)
                await rollout.drain.call(DrainRequest(reason="the bare segment runs"))
                items = (await data.sample.call(SampleRequest(n=segment))).items
                if len(items) != segment:
                    raise RuntimeError(f"segment {k}: took {len(items)} of {segment} trajectories")
                role = role_figures(items)
                role["cpu_s"] = {r: cpu_seconds(pid) - before[r] for r, pid in pids.items()}
                await asyncio.sleep(args.settle)
                jobs = [(t.trajectory_id, t.prompt_token_ids) for t in items]
                start_cpu = cpu_seconds(os.getpid())
                bare = await bare_generate(llm, jobs, args, eos)
                bare["cpu_s"] = {"front_end": cpu_seconds(os.getpid()) - start_cpu}
                warmup = k < args.warmup_pairs
                print(
                    f"{'warm-up pair' if warmup else 'pair'} {k}: role "
                    f"{role['tokens'] / role['seconds']:.0f}, bare "
                    f"{bare['tokens'] / bare['seconds']:.0f} tokens/s",
                    flush=True,
                )
                if not warmup:
                    roles.append(role)
                    bares.append(bare)
    finally:
        bare_stop(llm, ipc)
        llm = None
    return bares, roles


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
    parser.add_argument(
        "--mode",
        choices=("segments", "fresh"),
        default="segments",
        help="segments: both set-ups stay up and alternate segments of the same requests; "
        "fresh: a new engine or cluster for every run (see the module's docstring)",
    )
    parser.add_argument(
        "--warmup-pairs",
        type=int,
        default=1,
        help="segments: pairs run first and not counted (a side's first segment is its first "
        "real load: caches, allocator, the data role's first leases)",
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=3.0,
        help="segments: seconds between segments, for the idle side's engine to stop polling",
    )
    parser.add_argument("--work", help="scratch directory (default: a temporary one)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    if args.pairs < 3:
        parser.error("--pairs: at least three, for a median and a spread")
    work = Path(args.work or tempfile.mkdtemp(prefix="laminar-bench-gen-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.mode == "segments":  # a segment of its own prompts per pair
        model, prompts = prepare(args, work, args.prompts * (args.warmup_pairs + args.pairs))
        bares, roles = asyncio.run(run_segments(args, model, prompts, work))
    else:
        model, prompts = prepare(args, work, args.prompts)
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
        # segments: CPU seconds per 1,000 tokens of each role process over its segment, and of
        # this process (bare vLLM's front end and the driver) over its own: the overhead as
        # work done, which moves far less with the machine's hour than tokens/s
        "cpu_s_per_1k_tokens": cpu_per_1k(bares, roles),
        "settings": {
            "mode": args.mode,
            "settle_s": args.settle,
            "warmup_pairs": args.warmup_pairs if args.mode == "segments" else 0,
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
    if figures["cpu_s_per_1k_tokens"]:
        print(
            "CPU s per 1k tokens (median of the pairs): "
            + ", ".join(f"{k} {v['median']:.4f}" for k, v in figures["cpu_s_per_1k_tokens"].items())
        )
    print(json.dumps(figures))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
