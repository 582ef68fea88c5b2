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
- **publish**: the trainer's stall per publish, at this model size and at twice the layers
  (``publish``). The replicated trainer copying its weights (``replicate1``), each sharded rank
  writing its own rows into the shared buffer (``fsdp2_rows``, ranks on one host) and each
  sending its rows to rank 0 on the group's staging group (``fsdp2_send``, ranks on other hosts)
  all run in the background while the next step trains, so their stall is the start plus that
  step's wait at the optimizer's fence; each is measured in alternating pairs against the same
  copy waited for at once (the synchronous stall, ``sync_copy_s``), with the next step's
  slowdown from sharing the cores with the copy. For reference, ``fsdp2_gather``: gathering each
  tensor whole in turn, synchronously (how a cross-host publish was staged before).
  ``publish_stall_growth_2x_layers``: each stall at twice the layers over this size (flat in
  model size: near 1).

GPU figures (MFU of a ~0.5B model, publish-to-serving time) need a GPU; this script says so and
runs the CPU part only where torch sees none.

    python benchmarks/trainer.py --json OUT.json [--pairs 3] [--batches 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
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
from laminar.weights.manifest import plan_specs  # noqa: E402
from laminar.weights.tensors import copy_into  # noqa: E402

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


def batches(
    count: int, rows: int, length: int, vocab: int, seed: int, prompt_tokens: int = 16
) -> list[PackedBatch]:
    """GRPO-shaped global batches: groups of 4 samples, long-tailed response lengths (at most
    ``length``, a third of it typically)."""
    rng = random.Random(seed)
    out = []
    for b in range(count):
        trajectories = []
        for g in range(rows // 4):
            prompt = [rng.randrange(3, vocab) for _ in range(prompt_tokens)]
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


def _seconds(fn: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def publish_pair(
    group: DataParallelGroup, buffer: SharedBuffer, step: PackedBatch
) -> tuple[dict[str, float], dict[str, float]]:
    """One alternating pair for a group that copies out in the background (TorchCompute._stage):
    the baseline waits for the copy at once (what a synchronous publish stalls), the subject
    starts it and trains the next step, and its stall is the start plus that step's wait at the
    fence (``weights_wait_s``). Each side is followed by one training step, timed, so the cost
    of the copy running beside a step shows as that step's slowdown."""
    manifest = plan_specs(group.weight_specs(), 1)
    segment = buffer.name if group.needs_segment else None
    copy_s, copying = _seconds(lambda: group.copy_out(manifest, segment, buffer.view))
    copy_s += _seconds(copying.result)[0]
    plain_step_s, _ = _seconds(lambda: group.train(step))
    start_s, copying = _seconds(lambda: group.copy_out(manifest, segment, buffer.view))
    step_s, result = _seconds(lambda: group.train(step))
    copying.result()
    base = {"stall_s": copy_s, "step_s": plain_step_s}
    overlapped = {
        "stall_s": start_s + result.weights_wait_s,
        "start_s": start_s,
        "wait_s": result.weights_wait_s,
        "step_s": step_s,
    }
    return base, overlapped


def gather_stall(group: DataParallelGroup, buffer: SharedBuffer, runs: int) -> float:
    """The median stall of staging by gathering each tensor whole in turn (synchronous)."""
    manifest = plan_specs(group.weight_specs(), 1)
    copy_into(group.weights(), manifest, buffer.view)  # first touch: not timed
    return statistics.median(
        _seconds(lambda: copy_into(group.weights(), manifest, buffer.view))[0] for _ in range(runs)
    )


def background_figures(
    group: DataParallelGroup, buffer: SharedBuffer, step: PackedBatch, runs: int
) -> dict[str, Any]:
    publish_pair(group, buffer, step)  # first touch: not timed
    measured = [publish_pair(group, buffer, step) for _ in range(runs)]
    base, sub = [b for b, _ in measured], [o for _, o in measured]
    return {
        "stall_s": statistics.median(o["stall_s"] for o in sub),
        "start_s": statistics.median(o["start_s"] for o in sub),
        "wait_s_max": max(o["wait_s"] for o in sub),  # the next step's wait at the fence
        "sync_copy_s": statistics.median(b["stall_s"] for b in base),
        # the synchronous copy's stall over the background one's (how many times smaller)
        "sync_copy_over_stall": pairs.summarise(
            [b["stall_s"] for b in base], [o["stall_s"] for o in sub], higher_is_better=False
        ),
        # the step beside the copy over a step alone (the copy's cost in shared cores)
        "step_slowdown": pairs.summarise([b["step_s"] for b in base], [o["step_s"] for o in sub]),
    }


def publish_figures(args: argparse.Namespace, tmp: Path, layers: int) -> dict[str, Any]:
    """Per publish path at one model size: the stall (median of ``--pairs``), its cost per MiB
    and the largest tensor; for the background paths the synchronous copy beside it, in pairs."""
    model = make_model(tmp / f"model-{layers}", layers, args.hidden, args.vocab)
    step = batches(1, args.rows, args.length, args.vocab, seed=4)[0]
    out: dict[str, Any] = {}
    for sharding, world, name in (
        ("replicate", 1, "replicate1"),
        ("fsdp", 2, "fsdp2_rows"),
        ("fsdp", 2, "fsdp2_send"),
        ("fsdp", 2, "fsdp2_gather"),
    ):
        group = DataParallelGroup(config(model, world, sharding, args.rows, 1), timeout_s=300)
        group.rows_by_segment = name != "fsdp2_send"  # send: as served ranks on other hosts
        manifest = plan_specs(group.weight_specs(), 1)
        buffer = SharedBuffer(manifest.total_bytes)
        try:
            group.train(step)  # allocator: not timed
            if name == "fsdp2_gather":  # the old cross-host path: gathered, synchronous
                figures: dict[str, Any] = {"stall_s": gather_stall(group, buffer, args.pairs)}
            else:
                figures = background_figures(group, buffer, step, args.pairs)
        finally:
            group.close()
            buffer.close()
        mib = manifest.total_bytes / MIB
        figures.update(
            mib=mib,
            stall_ms_per_mib=1e3 * figures["stall_s"] / mib,
            largest_tensor_mib=max(e.nbytes for e in manifest.tensors) / MIB,
        )
        out[name] = figures
    return out


def training_figures(args: argparse.Namespace, tmp: Path, cores: int) -> dict[str, Any]:
    """Memory per rank, parity and trained tokens/s (see the module docstring)."""
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

    tps = pairs.alternate(lambda: section("replicate"), lambda: section("fsdp"), pairs=args.pairs)

    def mib(d: dict[str, int]) -> dict[str, float]:
        return {k: round(v / MIB, 3) for k, v in d.items()}

    def param_optim(d: dict[str, int]) -> int:
        return d["params"] + d["optimizer"]

    return {
        "model_params_m": round(one_mem["params"] / 4 / 1e6, 2),
        "memory_per_rank_mib": {
            "replicate1": mib(one_mem),
            "replicate2": mib(mem["replicate2"]),
            "fsdp2": mib(mem["fsdp2"]),
        },
        "rank1_peak_rss_mib": rss,
        "sharded_mem_over_replicated": param_optim(mem["fsdp2"]) / param_optim(mem["replicate2"]),
        "tokens_per_s": {
            "replicate1": one_tps,
            "replicate2": tps["baseline_median"],
            "fsdp2": tps["subject_median"],
        },
        "sharded_over_replicated_tps": tps,
        "parity_max_abs_diff": diff,
        "parity_update_max_abs": update,
    }


def print_training(result: dict[str, Any], cores: int) -> None:
    rss = result["rank1_peak_rss_mib"]
    print(f"model: {result['model_params_m']} M parameters, {cores} cores")
    for name, m in result["memory_per_rank_mib"].items():
        print(f"  {name:11s} per rank: {m} MiB  rank-1 peak RSS: {rss.get(name, '-')} MiB")
    print(
        f"sharded_mem_over_replicated {result['sharded_mem_over_replicated']:.3f} "
        f"(params + optimizer per rank; goal <= 0.6)"
    )
    print("tokens/s: " + ", ".join(f"{k} {v:.0f}" for k, v in result["tokens_per_s"].items()))
    print(
        pairs.describe(
            "sharded_over_replicated_tps (2 ranks)", result["sharded_over_replicated_tps"]
        )
    )
    print(
        f"parity_max_abs_diff {result['parity_max_abs_diff']:.3g} "
        f"(the update itself: up to {result['parity_update_max_abs']:.3g})"
    )


def print_publish(publish: dict[str, Any]) -> dict[str, float]:
    """Print the publish figures; returns each path's stall growth at twice the layers."""
    for size, figures in publish.items():
        for name, f in figures.items():
            line = (
                f"publish {size:10s} {name:12s} stall {f['stall_s'] * 1e3:7.1f} ms "
                f"for {f['mib']:.1f} MiB (largest tensor {f['largest_tensor_mib']:.1f} MiB)"
            )
            if "sync_copy_s" in f:
                line += (
                    f" = start {f['start_s'] * 1e3:.1f} ms + fence wait (at most "
                    f"{f['wait_s_max'] * 1e3:.1f} ms); a synchronous copy "
                    f"{f['sync_copy_s'] * 1e3:.1f} ms; the step beside the copy "
                    f"{f['step_slowdown']['ratio_median']:.2f}x as long"
                )
            print(line)
    sizes = list(publish)
    growth = {
        name: publish[sizes[1]][name]["stall_s"] / publish[sizes[0]][name]["stall_s"]
        for name in publish[sizes[0]]
    }
    print(
        "stall growth at twice the layers: " + ", ".join(f"{k} {v:.2f}x" for k, v in growth.items())
    )
    return growth


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
    parser.add_argument(
        "--publish-only", action="store_true", help="only the publish figures (a few minutes)"
    )
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    result: dict[str, Any] = {"cores": cores, "torch": torch.__version__, "args": vars(args)}
    if torch.cuda.is_available():
        result["gpu"] = "a GPU is present, but this script measures the CPU trainer only"
    else:
        result["gpu"] = "no GPU: MFU and publish-to-serving figures not measured"

    with tempfile.TemporaryDirectory(prefix="laminar-trainer-bench-") as d:
        tmp = Path(d)
        if not args.publish_only:
            result.update(training_figures(args, tmp, cores))
            print_training(result, cores)
        publish = {
            f"{args.layers}_layers": publish_figures(args, tmp, args.layers),
            f"{2 * args.layers}_layers": publish_figures(args, tmp, 2 * args.layers),
        }
    result["publish"] = publish
    result["publish_stall_growth_2x_layers"] = print_publish(publish)
    print(result["gpu"])
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
