"""Schedules side by side: trained tokens/s of laminar, sync, one_step and tail_batching, one run.

Each schedule runs the same emulated cluster (real processes on this machine): a manager, the data
role, one relay, ``--rollouts`` sim-engine rollouts and the sim trainer (``roles/trainer/sim.py``),
which publishes ``--weight-mib`` MiB per version through the real publisher and relay. Only
``cluster.schedule.kind`` differs (and repack, on for laminar only: it is part of Laminar's
design). Same rollouts, same decode step-time model (the paper's Fig. 4, 7B), same length
distribution (the paper's bimodal Fig. 17), same batch size, same train cost model. With
``--workload tool``: the paper's tool-calling workload instead (Fig. 12: responses near 1K tokens,
up to 8 code-sandbox calls each of long-tailed latency, during which the episode's sequence leaves
its engine's batch and the others decode; ``laminar.engines.configs.ToolCalls``).

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
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from laminar.harness.launch import ProcessCluster  # noqa: E402
from laminar.runtime.config import ClusterConfig, load_config  # noqa: E402
from laminar.runtime.context import transport_options  # noqa: E402
from laminar.runtime.log import configure_logging  # noqa: E402
from laminar.runtime.membership import MembershipApi  # noqa: E402
from laminar.runtime.rpc.client import RpcClient, remote  # noqa: E402
from laminar.simulate.cluster import SAMPLE_S, run_config  # noqa: E402
from laminar.simulate.measure import figures, sample_cluster, trainer_records  # noqa: E402

TOKEN = "schedules-bench-token"
SCHEDULES = ("laminar", "sync", "one_step", "tail_batching")
COLOCATED = {"sync", "tail_batching"}
FIG4_7B = [[1, 0.007], [64, 0.0125], [128, 0.018], [256, 0.030]]  # paper Fig. 4, seconds


#: The paper's tool-calling workload (Fig. 12, ``shared/paper-notes.md`` §6.1 and Fig. 17): a 7B
#: ReTool checkpoint whose responses peak sharply near 1K tokens, at most 8 code-sandbox calls,
#: sandbox latencies "mostly under 50 s, with a tail to ~600 s". Assumed shapes: calls uniform in
#: 0..8; latency lognormal with median 8 s and sigma 1.4 (p90 48 s, p99.9 600 s), cut at 600 s;
#: 128 tokens of tool output per call; lengths lognormal, median 1024, sigma 0.3.
TOOL_LATENCY = {"median_s": 8.0, "sigma": 1.4, "max_s": 600.0}


def workload_engine(workload: str, s: float, L: float) -> dict[str, Any]:
    """The engine's lengths (and tool calls) of ``workload``, time-scaled (module docstring:
    emulated time runs at S / L of real time, so a tool's latency is multiplied by S / L)."""
    if workload == "math":
        lengths = {"kind": "paper", "short_median": 1024 / L, "long_median": 8192 / L}
        return {"lengths": {**lengths, "max_length": int(16384 / L)}}
    scale = s / L
    return {
        "lengths": {
            "kind": "lognormal",
            "median": 1024 / L,
            "sigma": 0.3,
            "max_length": int(16384 / L),
        },
        "tools": {
            "max_calls": 8,
            "latency_median_s": TOOL_LATENCY["median_s"] * scale,
            "latency_sigma": TOOL_LATENCY["sigma"],
            "latency_max_s": TOOL_LATENCY["max_s"] * scale,
            "output_tokens": max(1, round(128 / L)),
        },
    }


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
            # as these figures were measured: leasing as slots free (the emulated data role never
            # stalls, which is what leases ahead are for: docs/benchmarks.md, *Generation*)
            "lease_ahead": 0,
            "flush_interval_s": 0.5,
            "take_wait_s": 0.5,
            "engine": {
                "backend": "sim",
                "vocab_size": 64,
                "seed": 0,
                **workload_engine(args.workload, s, L),
                "cost": {
                    "batch_points": [[b, t * s] for b, t in FIG4_7B],
                    "prefill_s_per_token": 2e-5 * s,
                },
                "kv_capacity_tokens": args.kv_tokens,
                "max_num_seqs": 256,
                "load_time_s": 0.2,
            },
        },
        "run": {
            "roles": [
                {"role": "manager"},
                {"role": "data"},
                {"role": "relay"},
                {"role": "sim_trainer"},
                {"role": "rollout", "count": args.rollouts},
            ]
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


async def run_processes(args: argparse.Namespace, config: Path) -> dict[str, Any]:
    """The schedule on real processes, in real time."""
    directory = config.parent
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
        trainer = RpcClient(cluster.info["trainer"]["address"], options, timeout=30.0)
        manager = remote(MembershipApi, client)
        samples = []
        try:
            start = time.time()
            while time.time() - start < args.warmup + args.duration:
                samples.append(await sample_cluster(manager, time.time()))
                await asyncio.sleep(SAMPLE_S)
            records = await trainer_records(trainer)
        finally:
            await client.close()
            await trainer.close()
    return figures(samples, records, start + args.warmup)


def run_simulated(args: argparse.Namespace, config: Path) -> dict[str, Any]:
    """The same config in the simulator (every role in one process, virtual time)."""
    started = time.perf_counter()
    out = run_config(load_config(config), duration_s=args.duration, warmup_s=args.warmup)
    out["wall_s"] = time.perf_counter() - started
    return out


def run_once(args: argparse.Namespace, schedule: str, work: Path, mode: str) -> dict[str, Any]:
    directory = work / f"{schedule}-{mode}"
    directory.mkdir(parents=True)
    config = write_config(directory, args, schedule)
    if mode == "simulate":
        return run_simulated(args, config)
    return asyncio.run(run_processes(args, config))


def compare(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Laminar over each other schedule, by trained tokens/s."""
    out: dict[str, Any] = {}
    lam = runs.get("laminar", {}).get("trained_tokens_per_s")
    for other in ("sync", "one_step", "tail_batching"):
        theirs = runs.get(other, {}).get("trained_tokens_per_s")
        out[f"laminar_over_{other}"] = lam / theirs if lam and theirs else None
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
    p.add_argument(
        "--workload",
        choices=("math", "tool"),
        default="math",
        help="math: the paper's bimodal 7B lengths; tool: multi-turn episodes with up to 8 "
        "code-sandbox calls of long-tailed latency (the paper's Fig. 12 workload)",
    )
    p.add_argument(
        "--mode",
        choices=("processes", "simulate", "both"),
        default="processes",
        help="real processes in real time; the simulator (laminar simulate run: the same roles "
        "in one process on virtual time); or both, with the simulator's error per schedule",
    )
    args = p.parse_args()

    results: dict[str, Any] = {"settings": {k: v for k, v in vars(args).items() if k != "json"}}
    if args.mode != "processes":  # the simulated members log here: what a process would log
        configure_logging(role="simulate", instance="simulate", level="error")
    modes = ["processes", "simulate"] if args.mode == "both" else [args.mode]
    by_mode: dict[str, dict[str, dict[str, Any]]] = {m: {} for m in modes}
    with tempfile.TemporaryDirectory(prefix="laminar-schedules-") as tmp:
        for schedule in args.schedules.split(","):
            for mode in modes:
                by_mode[mode][schedule] = run = run_once(args, schedule, Path(tmp), mode)
                print(f"{schedule} ({mode}): {json.dumps(run)}", flush=True)
    runs = by_mode[modes[0]]
    results["runs"] = runs
    results["trained_tokens_per_s"] = {k: v["trained_tokens_per_s"] for k, v in runs.items()}
    results.update(compare(runs))
    summary = {"trained_tokens_per_s": results["trained_tokens_per_s"], **compare(runs)}
    if args.mode == "both":
        simulated = by_mode["simulate"]
        results["simulated"] = simulated
        results["simulated_over_processes"] = {
            k: (simulated[k]["trained_tokens_per_s"] or 0) / v["trained_tokens_per_s"]
            if v["trained_tokens_per_s"]
            else None
            for k, v in runs.items()
        }
        results["simulated_ratios"] = compare(simulated)
        summary["simulated_over_processes"] = results["simulated_over_processes"]
        summary["simulated_ratios"] = results["simulated_ratios"]
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
