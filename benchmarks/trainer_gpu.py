"""The torch trainer on one GPU: model-FLOPs utilisation of a Qwen2.5-0.5B-shaped policy.

What it measures, on a random model of Qwen2.5-0.5B's shape made here (nothing downloaded;
``--preset tiny`` for a smoke run on any machine):

- **MFU**: the model FLOPs of the trainer's own update (:meth:`PolicyTrainer.train` on GRPO-shaped
  batches: bf16 autocast over fp32 master weights, AdamW, the fp32 log-softmax and entropy the
  loss needs), per second, in alternating pairs (``benchmarks/pairs.py``) with the baseline: a
  bf16 matrix multiply of ``--matmul`` cubed, the most this GPU does in this process. The pair
  ratio is MFU against that measured peak (``mfu_over_matmul``); ``mfu_nominal`` divides by the
  data-sheet dense bf16 peak where the device is known (H100 SXM / H200: 989 TFLOP/s, H100
  PCIe: 756). Goal: >= 0.35 of nominal (issue 17; the paper assumes it).
- **Model FLOPs**, counted, not profiled: per real (non-padding) token 6 x the weights of every
  linear layer (the LM head included), plus causal attention 6 x layers x width x T^2 per row of
  T tokens (forward and backward, half the square). Recomputation under activation checkpointing
  is not model FLOPs, so it lowers MFU, as it should.
- **peak memory** of the update (``torch.cuda.max_memory_allocated``), with and without
  activation checkpointing (``--variants``).

The publish-to-serving time of issue 17 needs vLLM's CUDA build beside this trainer; it is not
measured here (see the JSON's ``not_measured``).

    python benchmarks/trainer_gpu.py --json OUT.json [--pairs 3] [--batches 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import pairs  # noqa: E402  (benchmarks/pairs.py)
from trainer import batches  # noqa: E402  (benchmarks/trainer.py)

from laminar.rl.batch import PackedBatch  # noqa: E402
from laminar.rl.logprobs import token_logprobs  # noqa: E402
from laminar.roles.trainer.compute import PolicyTrainer  # noqa: E402
from laminar.roles.trainer.config import TrainerConfig  # noqa: E402

#: Qwen2.5-0.5B's shape (its config.json), the arith example's, and a tiny one for a smoke run
PRESETS: dict[str, dict[str, Any]] = {
    "0.5b": {
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
    },
    "arith": {  # the arith example's policy (laminar model init --task examples/arith)
        "vocab_size": 80,
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
        "max_position_embeddings": 1024,
    },
    "tiny": {
        "vocab_size": 4096,
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
        "max_position_embeddings": 2048,
    },
}

#: dense bf16 tensor-core peaks from the data sheets (no sparsity), by a name fragment
NOMINAL_BF16 = [("H100 PCIe", 756e12), ("H100", 989.4e12), ("H200", 989.4e12), ("A100", 312e12)]


def nominal_peak(name: str) -> float | None:
    for fragment, peak in NOMINAL_BF16:
        if fragment in name:
            return peak
    return None


def make_model(directory: Path, preset: str) -> Path:
    import transformers

    config = transformers.Qwen2Config(**PRESETS[preset], torch_dtype="float32")
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(directory)
    return directory


def linear_weights(model: torch.nn.Module) -> int:
    """Weights of every linear layer (the matrix multiplies per token), the LM head included."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def model_flops(batch: PackedBatch, linear: int, layers: int, width: int) -> float:
    """Training FLOPs of one global batch: 6 x linear weights per real token, plus causal
    attention (QK^T and AV, forward and backward) 6 x layers x width x T^2 per row."""
    lengths = batch.attention_mask.sum(dim=1).double()
    return float(6 * linear * lengths.sum() + 6 * layers * width * (lengths**2).sum())


def matmul_flops_per_s(device: torch.device, n: int, repeats: int) -> float:
    """The baseline: bf16 ``n``-cubed matrix multiplies back to back, FLOP/s."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    sync(device)
    return 2 * n**3 * repeats / (time.perf_counter() - start)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Setting(NamedTuple):
    """What one timed section runs: ``METHOD/MICRO[/compiled][/ac]`` on the command line."""

    method: str  # the trainer's logprobs: chunked, fused or full
    micro: int  # rows per micro-batch
    compiled: bool  # decoder layers compiled (trainer.compile)
    checkpointing: bool  # activation checkpointing

    @classmethod
    def parse(cls, text: str) -> Setting:
        method, micro, *flags = text.split("/")
        unknown = set(flags) - {"compiled", "ac"}
        if method not in ("chunked", "fused", "full") or unknown:
            raise argparse.ArgumentTypeError(f"METHOD/MICRO[/compiled][/ac], got {text!r}")
        return cls(method, int(micro), "compiled" in flags, "ac" in flags)

    def __str__(self) -> str:
        flags = ["compiled"] * self.compiled + ["ac"] * self.checkpointing
        return "/".join([self.method, str(self.micro), *flags])


class Bench:
    """One trainer (its model compiled or not, with or without activation checkpointing) and the
    batches; each section trains ``--batches`` global batches with the logprob method and
    micro-batch size it is given (the trainer reads both at every step)."""

    def __init__(
        self, args: argparse.Namespace, model: Path, compiled: bool, checkpointing: bool
    ) -> None:
        self.args = args
        self.trainer = PolicyTrainer(
            TrainerConfig(
                model=str(model),
                device=args.device,
                precision="bf16" if args.device == "cuda" else "fp32",
                activation_checkpointing=checkpointing,
                compile=compiled,
                metrics_file=None,
                batch={"prompts": args.rows // 4, "samples": 4, "micro_batch_rows": 8},
                optim={"name": "adamw", "lr": 1e-5},
                loss={"off_policy": "tis"},
            )
        )
        self.device = self.trainer.device
        shape = PRESETS[args.preset]
        self.linear = linear_weights(self.trainer.model)
        self.work = batches(
            args.batches, args.rows, args.length, shape["vocab_size"], seed=1,
            prompt_tokens=args.prompt,
        )  # fmt: skip
        layers, width = shape["num_hidden_layers"], shape["hidden_size"]
        self.flops = sum(model_flops(b, self.linear, layers, width) for b in self.work)
        self.tokens = sum(int(b.attention_mask.sum()) for b in self.work)
        self.peak: dict[str, float] = {}

    def configure(self, method: str, micro: int) -> None:
        cfg = self.trainer.config
        self.trainer.config = cfg.model_copy(
            update={
                "logprobs": method,
                "batch": cfg.batch.model_copy(update={"micro_batch_rows": micro}),
            }
        )

    def flops_per_s(self, setting: Setting) -> float:
        """One timed section: model FLOP/s; the section's peak memory is kept by its setting."""
        self.configure(setting.method, setting.micro)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        sync(self.device)
        start = time.perf_counter()
        for b in self.work:
            self.trainer.train(b)
        sync(self.device)
        rate = self.flops / (time.perf_counter() - start)
        if self.device.type == "cuda":
            used = torch.cuda.max_memory_allocated(self.device) / 2**30
            self.peak[str(setting)] = max(self.peak.get(str(setting), 0.0), used)
        return rate

    @torch.no_grad()
    def logprobs(self, method: str, micro: int) -> torch.Tensor:
        """The logprobs of the first micro-batch of the first batch (for parity)."""
        part = self.work[0].select(list(range(micro))).trimmed().to(self.device)
        lp, _ = token_logprobs(
            self.trainer._run(self.trainer.model), part, with_entropy=True, method=method
        )
        return lp.float().cpu()

    def profile(self, setting: Setting, rows: int = 14) -> str:
        """The kernels of one global batch by their own GPU time (after the timed sections)."""
        from torch.profiler import ProfilerActivity, profile

        self.configure(setting.method, setting.micro)
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        with profile(activities=activities) as prof:
            self.trainer.train(self.work[0])
            sync(self.device)
        key = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        return prof.key_averages().table(sort_by=key, row_limit=rows)


def is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error)


class Plan:
    """The trainers the settings need (at most one per compiled/checkpointing kind, made on
    first use) and the figures: A/B pairs and MFU against the matmul."""

    def __init__(self, args: argparse.Namespace, model: Path, device_name: str) -> None:
        self.args, self.model, self.device_name = args, model, device_name
        self.benches: dict[tuple[bool, bool], Bench] = {}

    def bench(self, s: Setting) -> Bench:
        key = (s.compiled, s.checkpointing)
        if key not in self.benches:
            self.benches[key] = Bench(self.args, self.model, *key)
        return self.benches[key]

    def rate(self, s: Setting) -> Callable[[], float]:
        return lambda: self.bench(s).flops_per_s(s)

    def matmul(self) -> float:
        bench = next(iter(self.benches.values()))
        return matmul_flops_per_s(bench.device, self.args.matmul, self.args.matmul_repeats)

    def pairs(self, a: Setting, b: Setting | None) -> dict[str, Any]:
        """``a`` against ``b`` (or the matmul, for MFU), warmed up, in alternating pairs; an
        out-of-memory error gives ``{"out_of_memory": ...}``."""
        try:
            baseline = self.rate(a) if b is not None else self.matmul
            subject = self.rate(b if b is not None else a)
            self.rate(a)()  # warm-ups: the allocator, compilation, kernels for these shapes
            if b is not None:
                self.rate(b)()
            return pairs.alternate(baseline, subject, pairs=self.args.pairs)
        except RuntimeError as error:
            if not is_oom(error):
                raise
            torch.cuda.empty_cache()
            return {"out_of_memory": str(error).splitlines()[0]}

    def mfu(self, s: Setting) -> dict[str, Any]:
        result = self.pairs(s, None)
        if "out_of_memory" in result:
            return result
        bench = self.bench(s)
        model_flops_s = statistics.median(result["subject"])
        peak = nominal_peak(self.device_name)
        return {
            "section_s": [bench.flops / r for r in result["subject"]],
            "tokens_per_s_median": bench.tokens * model_flops_s / bench.flops,
            "model_tflops_median": model_flops_s / 1e12,
            "matmul_tflops_median": statistics.median(result["baseline"]) / 1e12,
            "mfu_over_matmul": result,
            "nominal_bf16_tflops": peak / 1e12 if peak else None,
            "mfu_nominal": model_flops_s / peak if peak else None,
            "peak_memory_gib": bench.peak.get(str(s)),
        }


def print_mfu(label: str, f: dict[str, Any]) -> None:
    if "out_of_memory" in f:
        print(f"MFU {label:22s} out of memory", flush=True)
        return
    nominal = f["mfu_nominal"]
    memory = f["peak_memory_gib"]
    print(
        f"MFU {label:22s} {f['tokens_per_s_median']:8.0f} tokens/s "
        f"{f['model_tflops_median']:6.1f} model TFLOP/s, "
        f"{nominal if nominal is not None else float('nan'):.3f} of nominal; "
        + pairs.describe("over matmul", f["mfu_over_matmul"])
        + f"; matmul {f['matmul_tflops_median']:.0f} TFLOP/s"
        + (f"; peak {memory:.1f} GiB" if memory is not None else ""),
        flush=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument(
        "--profile",
        type=Setting.parse,
        nargs="*",
        default=[],
        help="settings whose kernels to tabulate (into --profile-out)",
    )
    parser.add_argument("--profile-out", help="where the kernel tables go")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="0.5b")
    parser.add_argument("--device", default="cuda", help="cuda (the point), or cpu for a smoke run")
    parser.add_argument("--rows", type=int, default=64, help="trajectories per global batch")
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens")
    parser.add_argument("--length", type=int, default=1024, help="longest response")
    parser.add_argument("--batches", type=int, default=3, help="global batches per timed section")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--matmul", type=int, default=8192, help="the baseline's matrix size")
    parser.add_argument("--matmul-repeats", type=int, default=600)
    parser.add_argument(
        "--ab", type=Setting.parse, nargs=2, action="append", default=None, metavar="SETTING",
        help="two settings (METHOD/MICRO[/compiled][/ac]) in alternating pairs; repeatable",
    )  # fmt: skip
    parser.add_argument(
        "--mfu", type=Setting.parse, nargs="*", default=None, metavar="SETTING",
        help="settings whose MFU to measure (pairs against the matmul)",
    )  # fmt: skip
    parser.add_argument(
        "--parity",
        nargs="*",
        default=["full", "chunked", "fused"],
        help="logprob methods whose values to compare on one micro-batch",
    )
    args = parser.parse_args()
    if args.ab is None:
        args.ab = [[Setting.parse("full/8"), Setting.parse("chunked/8")]]
    if args.mfu is None:
        args.mfu = [Setting.parse(s) for s in ("chunked/8", "chunked/16")]
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: torch.cuda.is_available() is false; --device cpu for a smoke run")
        return 2
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    result: dict[str, Any] = {
        "torch": torch.__version__,
        "device": name,
        "args": {k: ([[str(s) for s in p] for p in v] if k == "ab" else
                     [str(s) for s in v] if k in ("mfu", "profile") else v)
                 for k, v in vars(args).items()},
        "not_measured": (
            "publish-to-serving time: needs vLLM's CUDA build on the GPU machine, whose wheel "
            "(vllm 0.33.0, 336 MB) is over what a lent machine can be sent"
        ),
        "ab": {},
        "mfu": {},
    }  # fmt: skip
    tables = []
    with tempfile.TemporaryDirectory(prefix="laminar-trainer-gpu-") as d:
        plan = Plan(args, make_model(Path(d) / "model", args.preset), name)
        if args.parity:
            first = plan.bench(Setting("full", 8, False, False))
            values = {m: first.logprobs(m, 8) for m in args.parity}
            ref = values[args.parity[0]]
            result["parity_max_abs_diff"] = {
                m: float((v - ref).abs().max()) for m, v in values.items()
            }
            print(f"logprobs against {args.parity[0]}: {result['parity_max_abs_diff']}")
        for a, b in args.ab:
            ab = plan.pairs(a, b)
            result["ab"][f"{b} over {a}"] = ab
            if "out_of_memory" in ab:
                print(f"{b} over {a}: out of memory", flush=True)
                continue
            peaks = {str(s): plan.bench(s).peak.get(str(s)) for s in (a, b)}
            ab["peak_memory_gib"] = peaks
            print(pairs.describe(f"{b} over {a}:", ab) + f"; peak GiB {peaks}", flush=True)
        for s in args.mfu:
            result["mfu"][str(s)] = f = plan.mfu(s)
            print_mfu(str(s), f)
        for s in args.profile:
            tables.append(f"== {s} ==\n{plan.bench(s).profile(s)}")
        first_bench = next(iter(plan.benches.values()))
        result["params"] = sum(p.numel() for p in first_bench.trainer.model.parameters())
        result["linear_weights"] = first_bench.linear
        result["tokens_per_section"] = first_bench.tokens
        for bench in plan.benches.values():
            bench.trainer.close()
    if args.profile_out:
        Path(args.profile_out).write_text("\n".join(tables))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
