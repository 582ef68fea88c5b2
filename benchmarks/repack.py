"""Repack on vs off: generation throughput and KV use of an emulated cluster, in one invocation.

The emulated cluster is real processes on this machine: a manager, the data role, a relay, and
``--rollouts`` sim-engine rollouts (``laminar.engines.sim``: vLLM's scheduling shape, the paper's
Fig. 4 decode step times, the paper's bimodal Fig. 17 length distribution), plus a trainer
stand-in in this process that consumes a global batch, "trains" for ``--train-s`` seconds and
publishes a new weight version through the relay (real bytes, the real publisher). Rollouts
switch to each new version as Laminar does: stop taking prompts, drain, load. The control and
data planes are the real ones; only the GPU work is replaced by sleeping.

Time is scaled down so that a run takes a minute: lengths are the paper's divided by
``--length-scale`` (default 32: modes near 32 and 256 tokens, tail to 512) and step times the
paper's times ``--step-scale`` (default 3, so eight Python sim engines leave this 2-core machine
room to keep time). What is kept is the paper's ratio that makes repack matter: a weight version
arrives about as often as the longest tail takes to finish.

Both runs use identical settings; only ``manager.repack.enabled`` differs. Figures over the window
after ``--warmup`` seconds:

* ``gen_tokens_per_s_{on,off}``: tokens generated per second, all rollouts;
  ``gain = on / off`` (the paper: +26% on 16 rollouts; goal >= 1.3 here);
* ``kv_util_{on,off}``: mean KV-cache use over rollouts and samples (the paper: 82.2% vs 71.6%);
* ``repack_overhead_s_p50``: median time from a plan to its last handoff (the paper: 0.69 s).

With ``--vllm MODEL_DIR`` (or ``--vllm auto``: a tiny random Qwen2 built here), two in-process
vLLM engines also time the same in-flight sequences migrating with their KV state
(``migrate_kv_s``) and by tokens + re-prefill (``migrate_reprefill_s``), from export on the source
to the first new token on the destination.

    python benchmarks/repack.py --json runs/bench/repack.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from laminar.harness.launch import ProcessCluster  # noqa: E402
from laminar.roles.data.api import DataApi, SampleRequest  # noqa: E402
from laminar.roles.rollout.api import RolloutStats  # noqa: E402
from laminar.roles.trainer.publisher import WeightPublisher  # noqa: E402
from laminar.runtime.config import ClusterConfig  # noqa: E402
from laminar.runtime.context import transport_options  # noqa: E402
from laminar.runtime.membership import MembershipApi  # noqa: E402
from laminar.runtime.rpc.client import RpcClient, remote  # noqa: E402
from laminar.weights.config import PublishConfig  # noqa: E402

TOKEN = "repack-bench-token"


def task_files(directory: Path) -> tuple[Path, Path]:
    """Prompts and a tokenizer from the tests' toy task (the reward is irrelevant here)."""
    from tests.support.task import write_prompts, write_tokenizer

    return write_prompts(directory / "prompts.jsonl", 4096), write_tokenizer(directory / "tok")


def sim_engine(args: argparse.Namespace) -> dict[str, Any]:
    s = args.length_scale
    fig4 = [[1, 0.007], [64, 0.0125], [128, 0.018], [256, 0.030]]  # the paper's Fig. 4, 7B
    return {
        "backend": "sim",
        "vocab_size": 64,
        "seed": 0,
        "lengths": {
            "kind": "paper",
            "short_median": 1024 / s,
            "long_median": 8192 / s,
            "max_length": int(16384 / s),
        },
        "cost": {
            "batch_points": [[b, t * args.step_scale] for b, t in fig4],
            "prefill_s_per_token": 2e-5 * args.step_scale,
        },
        "kv_capacity_tokens": args.kv_tokens,
        "max_num_seqs": 256,
        "load_time_s": 0.2,
    }


def write_config(directory: Path, args: argparse.Namespace, repack: bool) -> Path:
    prompts, tokenizer = task_files(directory)
    config = {
        "cluster": {
            "name": "repack-bench",
            "heartbeat_interval_s": 0.25,
            "heartbeat_timeout_s": 5.0,
            "rpc_timeout_s": 30.0,
            "log_level": "warning",
        },
        "manager": {
            "bind": "tcp://127.0.0.1:0",
            "metrics": None,
            "admin": "127.0.0.1:0",
            "repack": {
                "enabled": repack,
                "period_s": args.period,
                "c_max": 0.99,
                "batch_limit": args.batch_limit,
            },
        },
        "data": {
            "prompts": str(prompts),
            "tokenizer": str(tokenizer),
            "reward": "tests.support.task:reward_len",
            "samples_per_prompt": 4,
            "epochs": None,
            "store": str(directory / "data.sqlite"),
            "sampling": {"max_tokens": int(16384 / args.length_scale)},
            "metrics": None,
            "queue_ahead": 512,
        },
        "relay": {"weights_bind": "tcp://127.0.0.1:0", "metrics": None, "keep": 3},
        "rollout": {
            "metrics": None,
            "concurrency": args.concurrency,
            "min_take": max(1, args.concurrency // 8),
            # as these figures were measured: leasing as slots free (the emulated data role never
            # stalls, which is what leases ahead are for: docs/benchmarks.md, *Generation*)
            "lease_ahead": 0,
            "flush_interval_s": 0.5,
            "take_wait_s": 0.5,
            "engine": sim_engine(args),
        },
    }
    path = directory / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


class TrainerStandIn:
    """Consume a global batch, 'train', publish a version through the relay (real bytes)."""

    def __init__(self, cluster: ProcessCluster, options: Any, args: argparse.Namespace) -> None:
        assert cluster.manager is not None
        self.manager = RpcClient(cluster.manager, options, timeout=30.0)
        self.data = RpcClient(cluster.info["data"]["address"], options, timeout=60.0)
        self.publisher = WeightPublisher(PublishConfig(chunks=4), options, manager=self.manager)
        self.args = args
        self.version = 0
        self.published: list[float] = []

    async def run(self) -> None:
        data = remote(DataApi, self.data)
        tensors = [("w", torch.zeros(256 * 1024))]  # 1 MiB: the relay path, not its bandwidth
        pushing = asyncio.create_task(self.publisher.run())
        try:
            while True:
                got = await data.sample.options(timeout=120).call(
                    SampleRequest(n=self.args.global_batch, wait_s=60, trainer_version=self.version)
                )
                if len(got.items) < self.args.global_batch:
                    continue
                await asyncio.sleep(self.args.train_s)
                self.version += 1
                vb = await asyncio.to_thread(self.publisher.stage, self.version, tensors)
                await self.publisher.hand_off(vb)
                self.published.append(time.time())
        finally:
            pushing.cancel()
            await asyncio.gather(pushing, return_exceptions=True)

    async def close(self) -> None:
        await self.manager.close()
        await self.data.close()


async def sample_cluster(manager: MembershipApi) -> tuple[float, float, list[float], int]:
    status = await manager.status.call()
    rollouts = [m for m in status.members if m.role == "rollout" and m.state == "alive"]
    stats = [m.stats_as(RolloutStats) or RolloutStats() for m in rollouts]
    tokens = float(sum(s.generated_tokens for s in stats))
    kv = [s.kv_cache_usage for s in stats]
    versions = [s.version for s in stats]
    return time.time(), tokens, kv, max(versions, default=0)


async def admin_events(url: str, kind: str) -> list[dict[str, Any]]:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{url}/v1/events", params={"format": "json", "kind": kind}, headers=headers) as r,
    ):
        r.raise_for_status()
        return await r.json()


async def run_once(args: argparse.Namespace, repack: bool, work: Path) -> dict[str, Any]:
    directory = work / ("on" if repack else "off")
    directory.mkdir(parents=True)
    config = write_config(directory, args, repack)
    env = {"LAMINAR_TOKEN": TOKEN, "PYTHONPATH": str(ROOT)}
    options = transport_options(ClusterConfig(), TOKEN.encode())
    with ProcessCluster(config, directory / "logs", env=env) as cluster:
        cluster.serve("manager", "manager")
        cluster.serve("data", "data")
        cluster.serve("relay", "relay")
        for i in range(args.rollouts):
            cluster.serve("rollout", f"rollout-{i}")
        assert cluster.manager is not None
        client = RpcClient(cluster.manager, options, timeout=30.0)
        manager = remote(MembershipApi, client)
        trainer = TrainerStandIn(cluster, options, args)
        training = asyncio.create_task(trainer.run())
        samples = []
        try:
            start = time.time()
            while time.time() - start < args.warmup + args.duration:
                samples.append(await sample_cluster(manager))
                if training.done():
                    training.result()  # raise what stopped it
                await asyncio.sleep(0.5)
            status = await manager.status.call()
            url = next(m.endpoints["admin"] for m in status.members if m.role == "manager")
            repacks = await admin_events(url, "repack")
        finally:
            training.cancel()
            await asyncio.gather(training, return_exceptions=True)
            await trainer.close()
            await client.close()
    window = [s for s in samples if s[0] - start >= args.warmup]
    (t0, tok0, _, v0), (t1, tok1, _, v1) = window[0], window[-1]
    in_window = [e for e in repacks if e["at"] >= t0]
    overheads = [e["data"]["overhead_s"] for e in in_window]
    return {
        "gen_tokens_per_s": (tok1 - tok0) / (t1 - t0),
        "kv_util": statistics.fmean(k for s in window for k in s[2]),
        "versions_in_window": v1 - v0,
        "repacks": len(in_window),
        "moved_trajectories": sum(e["data"]["moved"] for e in in_window),
        "released_rollouts": sum(len(e["data"]["released"]) for e in in_window),
        "repack_overhead_s": overheads,
        "window_s": t1 - t0,
    }


async def migrate_vllm(model: str, n: int, tokens_before: int) -> dict[str, float]:
    """The same in-flight sequences moved between two vLLM engines: KV state vs re-prefill."""
    from laminar.engines import EngineRequest, VllmEngineConfig, create_engine
    from laminar.trajectory import SamplingParams

    cfg = VllmEngineConfig(
        model=model, max_model_len=512, max_num_seqs=max(8, n), kv_migration=True
    )
    source, dest = create_engine(cfg), create_engine(cfg)
    await source.start()
    await dest.start()
    params = SamplingParams(max_tokens=tokens_before + 64, temperature=0.0, ignore_eos=True)
    prompts = [[3 + (i % 50)] * 384 for i in range(n)]  # long contexts: prefill is what differs
    out: dict[str, float] = {"sequences": n, "context_tokens": 384 + tokens_before}
    try:
        for mode in ("kv", "reprefill"):
            ids = [f"{mode}-{i}" for i in range(n)]
            counts = dict.fromkeys(ids, 0)
            for rid, prompt in zip(ids, prompts, strict=True):
                await source.add_request(
                    EngineRequest(request_id=rid, prompt_token_ids=prompt, params=params)
                )
            source_out = source.outputs()
            async for batch in source_out:
                for o in batch:
                    counts[o.request_id] += len(o.token_ids)
                if min(counts.values()) >= tokens_before:
                    break
            t0 = time.perf_counter()
            seqs = await source.export_sequences(ids, with_kv=mode == "kv")
            t_export = time.perf_counter() - t0
            covered = sum(s.kv.tokens for s in seqs if s.kv is not None)
            await dest.import_sequences(seqs)
            first: set[str] = set()
            async for batch in dest.outputs():
                first |= {o.request_id for o in batch if o.token_ids}
                if first >= set(ids):
                    break
            out[f"migrate_{mode}_s"] = time.perf_counter() - t0
            out[f"migrate_{mode}_export_s"] = t_export
            out[f"migrate_{mode}_kv_tokens"] = covered
            for rid in ids:
                await dest.abort(rid)
    finally:
        await source.close()
        await dest.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", type=Path, help="write the figures here")
    p.add_argument("--rollouts", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=48)
    p.add_argument("--kv-tokens", type=int, default=4000)
    p.add_argument("--batch-limit", type=int, default=128, help="B, the roofline batch size")
    p.add_argument("--period", type=float, default=1.0, help="repack period (scaled time)")
    p.add_argument("--global-batch", type=int, default=256)
    p.add_argument("--train-s", type=float, default=3.0)
    p.add_argument("--length-scale", type=float, default=32.0)
    p.add_argument("--step-scale", type=float, default=6.0)
    p.add_argument("--warmup", type=float, default=20.0)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--vllm", help="model dir for the migration timing ('auto': a tiny Qwen2)")
    p.add_argument("--vllm-sequences", type=int, default=8)
    p.add_argument("--vllm-only", action="store_true", help="skip the emulated cluster runs")
    args = p.parse_args()

    results: dict[str, Any] = {"settings": {k: v for k, v in vars(args).items() if k != "json"}}
    with tempfile.TemporaryDirectory(prefix="laminar-repack-") as tmp:
        work = Path(tmp)
        runs = {}
        for repack in () if args.vllm_only else (False, True):
            runs[repack] = asyncio.run(run_once(args, repack, work))
            print(f"repack {'on' if repack else 'off'}: {json.dumps(runs[repack])}", flush=True)
        on, off = runs.get(True), runs.get(False)
        if on and off:
            results.update(
                gen_tokens_per_s_on=on["gen_tokens_per_s"],
                gen_tokens_per_s_off=off["gen_tokens_per_s"],
                gain=on["gen_tokens_per_s"] / off["gen_tokens_per_s"],
                kv_util_on=on["kv_util"],
                kv_util_off=off["kv_util"],
                repack_overhead_s_p50=(
                    statistics.median(on["repack_overhead_s"]) if on["repack_overhead_s"] else None
                ),
                on=on,
                off=off,
            )
        if args.vllm:
            model = args.vllm
            if model == "auto":
                from tests.support.models import tiny_qwen2

                model = str(tiny_qwen2(work / "tiny", vocab=64))
            results["vllm"] = asyncio.run(migrate_vllm(model, args.vllm_sequences, 64))
            for key in ("migrate_kv_s", "migrate_reprefill_s"):
                results[key] = results["vllm"].get(key)
    summary = {k: v for k, v in results.items() if k not in ("on", "off", "vllm", "settings")}
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
