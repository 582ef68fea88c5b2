"""Schedules side by side: trained tokens/s of laminar, sync, one_step and tail_batching, one run.

Each schedule runs the same emulated cluster (real processes on this machine): a manager, the data
role, one relay, ``--rollouts`` sim-engine rollouts and the sim trainer (``roles/trainer/sim.py``),
which publishes ``--weight-mib`` MiB per version through the real publisher and relay. Only
``cluster.schedule.kind`` differs (and repack, on for laminar only: it is part of Laminar's
design). Same rollouts, same decode step-time model (the paper's Fig. 4, 7B), same length
distribution (the paper's bimodal Fig. 17), same batch size, same train cost model.

Resources: every schedule has the same GPUs. ``--rollouts`` R rollout GPUs and ``--train-gpus`` T
trainer GPUs (default T = R: the paper's smallest 7B placement, 16 = 8 train + 8 rollout).
Disaggregated schedules (laminar, one_step) train on T GPUs while the R rollouts generate. The
colocated ones (sync = verl, tail_batching = RollPacker, which is built on verl) time-share the
whole pool: they train on R + T GPUs, and generate on the R emulated rollouts while the trainer
GPUs sit idle — see docs/schedules.md for why that is close to generating on R + T (the round's
time is its longest trajectory, which more engines do not shorten).

Time is scaled (as in benchmarks/repack.py): lengths are the paper's divided by
``--length-scale`` L (default 64: modes near 16 and 128 tokens, max 256) and decode step times
multiplied by ``--step-scale`` S (default 8, so sixteen Python engines leave this 2-core machine
room to keep time). One emulated token stands for L real ones, so emulated time runs at S / L of
real time; the train cost model uses the same factor (``time_scale`` = S, ``base_s`` = 2 S / L).

Figures (``trained_tokens_per_s``, the paper's metric): batch tokens (prompt + response) over the
time between consecutive trainer updates, over the updates after ``--warmup`` seconds. Plus
generation tokens/s, rollout utilisation (share of samples with a non-empty decode batch), KV use,
staleness mean/max and versions.

    python benchmarks/schedules.py --json runs/bench/schedules.json
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

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from laminar.config import ClusterConfig  # noqa: E402
from laminar.harness.launch import ProcessCluster  # noqa: E402
from laminar.membership import MembershipApi  # noqa: E402
from laminar.rpc_client import RpcClient, remote  # noqa: E402
from laminar.service import transport_options  # noqa: E402
from laminar.stats import RolloutStats, TrainerStats  # noqa: E402

TOKEN = "schedules-bench-token"
SCHEDULES = ("laminar", "sync", "one_step", "tail_batching")
COLOCATED = {"sync", "tail_batching"}
FIG4_7B = [[1, 0.007], [64, 0.0125], [128, 0.018], [256, 0.030]]  # paper Fig. 4, seconds


def task_files(directory: Path) -> tuple[Path, Path]:
    from tests.support.task import write_prompts, write_tokenizer

    return write_prompts(directory / "prompts.jsonl", 4096), write_tokenizer(directory / "tok")


def write_config(directory: Path, args: argparse.Namespace, schedule: str) -> Path:
    prompts, tokenizer = task_files(directory)
    s, L = args.step_scale, args.length_scale
    gpus = args.train_gpus + (args.rollouts if schedule in COLOCATED else 0)
    config = {
        "cluster": {
            "name": f"schedules-{schedule}",
            "heartbeat_interval_s": 0.5,
            "heartbeat_timeout_s": 10.0,
            "rpc_timeout_s": 60.0,
            "log_level": "warning",
            "schedule": {
                "kind": schedule,
                "round_prompts": args.batch_prompts,
                "over_launch": args.over_launch,
            },
        },
        "manager": {
            "bind": "tcp://127.0.0.1:0",
            "metrics": None,
            "admin": "127.0.0.1:0",
            "repack": {"enabled": schedule == "laminar", "period_s": 1.0, "c_max": 0.99},
        },
        "data": {
            "prompts": str(prompts),
            "tokenizer": str(tokenizer),
            "reward": "tests.support.task:reward_len",
            "samples_per_prompt": args.samples,
            "epochs": None,
            "store": str(directory / "data.sqlite"),
            "sampling": {"max_tokens": int(16384 / L)},
            "metrics": None,
            "queue_ahead": args.rollouts * args.concurrency,
        },
        "relay": {"weights_bind": "tcp://127.0.0.1:0", "metrics": None, "keep": 3},
        "rollout": {
            "metrics": None,
            "concurrency": args.concurrency,
            "min_take": max(1, args.concurrency // 8),
            "flush_interval_s": 0.5,
            "take_wait_s": 0.5,
            "engine": {
                "backend": "sim",
                "vocab_size": 64,
                "seed": 0,
                "lengths": {
                    "kind": "paper",
                    "short_median": 1024 / L,
                    "long_median": 8192 / L,
                    "max_length": int(16384 / L),
                },
                "cost": {
                    "batch_points": [[b, t * s] for b, t in FIG4_7B],
                    "prefill_s_per_token": 2e-5 * s,
                },
                "kv_capacity_tokens": args.kv_tokens,
                "max_num_seqs": 256,
                "load_time_s": 0.2,
            },
        },
        "sim_trainer": {
            "metrics": None,
            "batch": {"prompts": args.batch_prompts, "samples": args.samples},
            "cost": {"gpus": gpus, "time_scale": s, "base_s": 2.0 * s / L},
            "weight_bytes": int(args.weight_mib * (1 << 20)),
            "publish": {"chunks": 4},
            "sample_wait_s": 5.0,
        },
    }
    path = directory / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


async def sample_cluster(manager: MembershipApi) -> dict[str, Any]:
    status = await manager.status.call()
    rollouts = [m for m in status.members if m.role == "rollout" and m.state == "alive"]
    trainer = [m for m in status.members if m.role == "sim_trainer"]
    stats = [m.rollout_stats() or RolloutStats() for m in rollouts]
    trained = (trainer[0].trainer_stats() if trainer else None) or TrainerStats()
    return {
        "t": time.time(),
        "tokens": float(sum(s.generated_tokens for s in stats)),
        "busy": [float(s.running > 0) for s in stats],
        "kv": [s.kv_cache_usage for s in stats],
        "versions": [s.version for s in stats],
        "trainer_version": trained.version,
    }


async def trainer_records(cluster: ProcessCluster, options: Any) -> list[dict[str, Any]]:
    from laminar.roles.trainer.sim import SimTrainerService

    client = RpcClient(cluster.info["trainer"]["address"], options, timeout=30.0)
    try:
        status = await remote(SimTrainerService, client).status.call()
        return status.records
    finally:
        await client.close()


async def run_once(args: argparse.Namespace, schedule: str, work: Path) -> dict[str, Any]:
    directory = work / schedule
    directory.mkdir(parents=True)
    config = write_config(directory, args, schedule)
    env = {"LAMINAR_TOKEN": TOKEN, "PYTHONPATH": str(ROOT)}
    options = transport_options(ClusterConfig(), TOKEN.encode())
    with ProcessCluster(config, directory / "logs", env=env) as cluster:
        cluster.serve("manager", "manager")
        cluster.serve("data", "data")
        cluster.serve("relay", "relay")
        # the trainer first: rollouts that start (slowly, on 2 cores) before it would fill the
        # buffer with a backlog it then drains at more than the generation rate
        cluster.serve("sim_trainer", "trainer")
        for i in range(args.rollouts):
            cluster.serve("rollout", f"rollout-{i}")
        assert cluster.manager is not None
        client = RpcClient(cluster.manager, options, timeout=30.0)
        manager = remote(MembershipApi, client)
        samples = []
        try:
            start = time.time()
            while time.time() - start < args.warmup + args.duration:
                samples.append(await sample_cluster(manager))
                await asyncio.sleep(0.5)
            records = await trainer_records(cluster, options)
        finally:
            await client.close()
    t_warm = start + args.warmup
    window = [s for s in samples if s["t"] >= t_warm]
    updates = [r for r in records if r["train_end"] >= t_warm]
    out: dict[str, Any] = {"versions": len(records), "updates_in_window": len(updates)}
    if len(updates) >= 2:
        span = updates[-1]["train_end"] - updates[0]["train_end"]
        out["trained_tokens_per_s"] = sum(r["tokens"] for r in updates[1:]) / span
        out["iteration_s_mean"] = span / (len(updates) - 1)
    else:
        out["trained_tokens_per_s"] = None
    trained = [r for r in records if r["version"] > 1]  # staleness from the second batch on
    if trained:
        out["staleness_mean"] = statistics.fmean(r["staleness_mean"] for r in trained)
        out["staleness_max"] = max(r["staleness_max"] for r in trained)
    out["train_s_mean"] = statistics.fmean(r["train_s"] for r in records) if records else None
    out["batch_tokens_mean"] = statistics.fmean(r["tokens"] for r in records) if records else None
    if len(window) >= 2:
        out["gen_tokens_per_s"] = (window[-1]["tokens"] - window[0]["tokens"]) / (
            window[-1]["t"] - window[0]["t"]
        )
        out["rollout_utilisation"] = statistics.fmean(b for s in window for b in s["busy"])
        out["kv_util"] = statistics.fmean(k for s in window for k in s["kv"])
        out["window_s"] = window[-1]["t"] - window[0]["t"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", type=Path, help="write the figures here")
    p.add_argument("--schedules", default=",".join(SCHEDULES))
    p.add_argument("--rollouts", type=int, default=16)
    p.add_argument("--train-gpus", type=int, default=16, help="T, the disaggregated trainer's")
    p.add_argument("--concurrency", type=int, default=32, help="trajectories per rollout")
    p.add_argument("--kv-tokens", type=int, default=8000)
    p.add_argument("--batch-prompts", type=int, default=128, help="prompt groups per batch")
    p.add_argument("--samples", type=int, default=4, help="samples per prompt")
    p.add_argument("--over-launch", type=float, default=1.25, help="tail_batching's eta")
    p.add_argument("--weight-mib", type=float, default=64.0)
    p.add_argument("--length-scale", type=float, default=64.0)
    p.add_argument("--step-scale", type=float, default=8.0)
    p.add_argument("--warmup", type=float, default=25.0)
    p.add_argument("--duration", type=float, default=80.0)
    args = p.parse_args()

    results: dict[str, Any] = {"settings": {k: v for k, v in vars(args).items() if k != "json"}}
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="laminar-schedules-") as tmp:
        for schedule in args.schedules.split(","):
            runs[schedule] = asyncio.run(run_once(args, schedule, Path(tmp)))
            print(f"{schedule}: {json.dumps(runs[schedule])}", flush=True)
    results["runs"] = runs
    results["trained_tokens_per_s"] = {k: v["trained_tokens_per_s"] for k, v in runs.items()}
    lam = runs.get("laminar", {}).get("trained_tokens_per_s")
    for other in ("sync", "one_step", "tail_batching"):
        theirs = runs.get(other, {}).get("trained_tokens_per_s")
        results[f"laminar_over_{other}"] = lam / theirs if lam and theirs else None
    ratios = {k: v for k, v in results.items() if k.startswith("laminar_over_")}
    print(json.dumps({"trained_tokens_per_s": results["trained_tokens_per_s"], **ratios}, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
