"""Trainer benchmark: replicated vs FSDP2-sharded data parallelism on this machine's CPU.

What it measures, on a random Qwen2 made here (``--layers``, ``--hidden``; nothing downloaded):

- **memory per rank**: the bytes one rank holds of the parameters, gradients and AdamW moments
  (:meth:`PolicyTrainer.state_bytes`: exact accounting of the tensors, not a process-size guess),
  for 1 and 2 replicated ranks and 2 sharded ranks, and the peak resident set of each group's
  rank-1 process (``VmHWM``; rank 0 is this script, which holds every group). The headline
  ``sharded_mem_over_replicated`` is parameters + optimizer states per rank, 2-rank sharded over
  replicated (goal <= 0.6);
- **trained tokens/s** of the 2-rank replicated and 2-rank sharded groups, in alternating pairs
  (``benchmarks/pairs.py``: replicated, sharded, replicated, ... ``--pairs`` times, each timed
  section ``--batches`` global batches), so ``sharded_over_replicated_tps`` is a median of pair
  ratios with its spread; the 1-rank trainer's tokens/s is reported beside them (not a ratio:
  on 2 cores one rank gets both cores' threads);
- **parity**: the largest absolute weight difference between a 1-rank trainer and the 2-rank
  sharded group after the same ``--parity-steps`` batches (``parity_max_abs_diff``), next to the
  size of the update itself;
- **publish**: staging the weights for the relays, at this model size and at twice the layers
  (``publish``): the replicated trainer's copy (``replicate1``), the sharded group gathering each
  tensor whole in turn into the buffer (``fsdp2_gather``, what ranks on other hosts do) and each
  sharded rank writing its own rows into the shared buffer (``fsdp2_rows``, ranks on one host):
  the stall, its cost per MiB, and the largest single tensor.

GPU figures (MFU of a ~0.5B model, publish-to-serving time) need a GPU; this script says so and
runs the CPU part only where torch sees none.

    python benchmarks/trainer.py --json OUT.json [--pairs 3] [--batches 3]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import pairs  # noqa: E402  (benchmarks/pairs.py)

from laminar.rl import grpo_advantages, pack  # noqa: E402
from laminar.rl.batch import PackedBatch  # noqa: E402
from laminar.roles.trainer.config import TrainerConfig  # noqa: E402
from laminar.roles.trainer.dp import DataParallelGroup  # noqa: E402
from laminar.trajectory import Trajectory  # noqa: E402
from laminar.transport.shm import SharedBuffer  # noqa: E402
from laminar.weights.tensors import copy_into, plan_specs  # noqa: E402

MIB = 1 << 20


def make_model(directory: Path, layers: int, hidden: int, vocab: int) -> Path:
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(directory)
    return directory


def batches(count: int, rows: int, length: int, vocab: int, seed: int) -> list[PackedBatch]:
    """GRPO-shaped global batches: groups of 4 samples, long-tailed response lengths."""
    rng = random.Random(seed)
    out = []
    for b in range(count):
        trajectories = []
        for g in range(rows // 4):
            prompt = [rng.randrange(3, vocab) for _ in range(16)]
            for s in range(4):
                n = min(length, max(4, int(rng.lognormvariate(np.log(length / 3), 0.6))))
                trajectories.append(
                    Trajectory(
                        trajectory_id=f"b{b}/p{g}/{s}",
                        prompt_id=f"b{b}/p{g}",
                        sample_index=s,
                        prompt_token_ids=prompt,
                        response_token_ids=[rng.randrange(3, vocab) for _ in range(n)],
                        logprobs=[-rng.uniform(0.5, 4.0) for _ in range(n)],
                        version=0,
                        finish_reason="length",
                        queued_at=0,
                        started_at=0,
                        finished_at=0,
                        reward=float(rng.random() < 0.5),
                    )
                )
        adv = grpo_advantages(
            torch.tensor([t.reward for t in trajectories]), [t.prompt_id for t in trajectories]
        )
        out.append(pack(trajectories, adv.tolist()))
    return out


def config(model: Path, world: int, sharding: str, rows: int, threads: int) -> TrainerConfig:
    return TrainerConfig(
        model=str(model),
        data_parallel=world,
        sharding=sharding,
        threads_per_rank=threads,
        batch={"prompts": rows // 4, "samples": 4, "micro_batch_rows": 8},
        optim={"name": "adamw", "lr": 1e-4},
        loss={"off_policy": "tis"},
    )


def peak_rss_mib(group: DataParallelGroup) -> float | None:
    """The rank-1 process's peak resident set (VmHWM), if the group has one."""
    if not group.procs:
        return None
    for line in Path(f"/proc/{group.procs[0].pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return None


def tokens_per_s(group: DataParallelGroup, work: list[PackedBatch]) -> float:
    start, tokens = time.perf_counter(), 0
    for batch in work:
        tokens += group.train(batch).tokens
    return tokens / (time.perf_counter() - start)


def stage(group: DataParallelGroup, rows: bool, buffer: Any) -> dict[str, float]:
    """One publish's staging, as the trainer does it (TorchCompute._stage), into a reused
    buffer: ``rows``: every rank writes its own rows into the shared segment (sharded, ranks on
    one host); else each tensor is copied in as it is gathered (whole, where replicated)."""
    specs = group.weight_specs()
    manifest = plan_specs(specs, 1)
    start = time.perf_counter()
    if rows:
        group.fill(manifest, buffer.name, buffer.view)
    else:
        copy_into(group.weights(), manifest, buffer.view)
    seconds = time.perf_counter() - start
    largest = max(e.nbytes for e in manifest.tensors)
    return {
        "stall_s": seconds,
        "mib": manifest.total_bytes / MIB,
        "stall_ms_per_mib": 1e3 * seconds / (manifest.total_bytes / MIB),
        "largest_tensor_mib": largest / MIB,
    }


def publish_figures(args: argparse.Namespace, tmp: Path, layers: int) -> dict[str, Any]:
    model = make_model(tmp / f"model-{layers}", layers, args.hidden, args.vocab)
    out: dict[str, Any] = {}
    for sharding, world, rows in (("replicate", 1, False), ("fsdp", 2, False), ("fsdp", 2, True)):
        group = DataParallelGroup(config(model, world, sharding, args.rows, 1), timeout_s=300)
        buffer = SharedBuffer(plan_specs(group.weight_specs(), 1).total_bytes)
        try:
            stage(group, rows, buffer)  # first touch of the buffer's pages: not timed
            runs = [stage(group, rows, buffer) for _ in range(3)]
        finally:
            group.close()
            buffer.close()
        name = f"{sharding}{world}" + ("_rows" if rows else "_gather" if world > 1 else "")
        out[name] = sorted(runs, key=lambda r: r["stall_s"])[1]  # the median of three
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--rows", type=int, default=32, help="trajectories per global batch")
    parser.add_argument("--length", type=int, default=96, help="longest response")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--batches", type=int, default=3, help="global batches per timed section")
    parser.add_argument("--parity-steps", type=int, default=2)
    args = parser.parse_args()
    cores = len(__import__("os").sched_getaffinity(0))
    result: dict[str, Any] = {"cores": cores, "torch": torch.__version__, "args": vars(args)}
    if torch.cuda.is_available():
        result["gpu"] = "a GPU is present, but this script measures the CPU trainer only"
    else:
        result["gpu"] = "no GPU: MFU and publish-to-serving figures not measured"

    with tempfile.TemporaryDirectory(prefix="laminar-trainer-bench-") as d:
        tmp = Path(d)
        model = make_model(tmp / "model", args.layers, args.hidden, args.vocab)
        work = batches(args.batches, args.rows, args.length, args.vocab, seed=1)
        warm = batches(1, args.rows, args.length, args.vocab, seed=2)

        # parity first, from the same starting weights
        parity_work = batches(args.parity_steps, args.rows, args.length, args.vocab, seed=3)
        one = DataParallelGroup(config(model, 1, "replicate", args.rows, cores), timeout_s=300)
        start = {k: v.clone() for k, v in one.weights()}
        for b in parity_work:
            one.train(b)
        single = {k: v.clone() for k, v in one.weights()}
        one_tps = tokens_per_s(one, work)
        one_mem = one.state_bytes()
        one.close()

        sharded_group = DataParallelGroup(config(model, 2, "fsdp", args.rows, 1), timeout_s=300)
        try:
            for b in parity_work:
                sharded_group.train(b)
            sharded = dict(sharded_group.weights())
        finally:
            sharded_group.close()
        diff = max(float((sharded[k] - single[k]).abs().max()) for k in single)
        update = max(float((single[k] - start[k]).abs().max()) for k in single)

        # one process holds one default process group: each timed section has its own group
        mem: dict[str, dict[str, int]] = {}
        rss: dict[str, float | None] = {}

        def section(sharding: str) -> float:
            group = DataParallelGroup(config(model, 2, sharding, args.rows, 1), timeout_s=300)
            try:
                group.train(warm[0])  # allocator, first touch: not timed
                rate = tokens_per_s(group, work)
                mem[f"{sharding}2"] = group.state_bytes()
                rss[f"{sharding}2"] = peak_rss_mib(group)
            finally:
                group.close()
            return rate

        tps = pairs.alternate(
            lambda: section("replicate"), lambda: section("fsdp"), pairs=args.pairs
        )

        def mib(d: dict[str, int]) -> dict[str, float]:
            return {k: round(v / MIB, 3) for k, v in d.items()}

        def param_optim(d: dict[str, int]) -> int:
            return d["params"] + d["optimizer"]

        publish = {
            f"{args.layers}_layers": publish_figures(args, tmp, args.layers),
            f"{2 * args.layers}_layers": publish_figures(args, tmp, 2 * args.layers),
        }

    result.update(
        {
            "model_params_m": round(one_mem["params"] / 4 / 1e6, 2),
            "memory_per_rank_mib": {
                "replicate1": mib(one_mem),
                "replicate2": mib(mem["replicate2"]),
                "fsdp2": mib(mem["fsdp2"]),
            },
            "rank1_peak_rss_mib": rss,
            "sharded_mem_over_replicated": param_optim(mem["fsdp2"])
            / param_optim(mem["replicate2"]),
            "tokens_per_s": {
                "replicate1": one_tps,
                "replicate2": tps["baseline_median"],
                "fsdp2": tps["subject_median"],
            },
            "sharded_over_replicated_tps": tps,
            "parity_max_abs_diff": diff,
            "parity_update_max_abs": update,
            "publish": publish,
        }
    )
    print(f"model: {result['model_params_m']} M parameters, {cores} cores")
    for name, m in result["memory_per_rank_mib"].items():
        print(f"  {name:11s} per rank: {m} MiB  rank-1 peak RSS: {rss.get(name, '-')} MiB")
    print(
        f"sharded_mem_over_replicated {result['sharded_mem_over_replicated']:.3f} "
        f"(params + optimizer per rank; goal <= 0.6)"
    )
    print("tokens/s: " + ", ".join(f"{k} {v:.0f}" for k, v in result["tokens_per_s"].items()))
    print(pairs.describe("sharded_over_replicated_tps (2 ranks)", tps))
    print(f"parity_max_abs_diff {diff:.3g} (the update itself: up to {update:.3g})")
    for size, figures in publish.items():
        for name, f in figures.items():
            print(
                f"publish {size:10s} {name:11s} stall {f['stall_s'] * 1e3:7.1f} ms "
                f"for {f['mib']:.1f} MiB ({f['stall_ms_per_mib']:.2f} ms/MiB; largest tensor "
                f"{f['largest_tensor_mib']:.1f} MiB)"
            )
    print(result["gpu"])
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
