"""Bare vLLM tokens/s under two engine settings, in alternating segments (``benchmarks/pairs.py``).

Both engines start once, on the example task's model (``benchmarks/generation.py``'s ``prepare``:
``laminar model init``, arith test problems), and stay up; each pair runs the same requests
(``--prompts`` x ``--samples``, per-trajectory seeds as the data role gives them) through the
baseline engine, then through the subject, ``--settle`` seconds apart so the idle engine has
stopped polling. A side is a JSON object of :class:`VllmEngineConfig` fields (``extra`` for vLLM
arguments of its own) plus ``concurrency``, the requests kept in flight (default: the side's
``max_num_seqs``). Reports the median subject/baseline ratio of tokens/s and its spread.

    python benchmarks/engine_settings.py --baseline '{"extra": {"enable_chunked_prefill": true}}' \\
        --subject '{}' --json runs/bench/chunked-prefill.json
    python benchmarks/engine_settings.py --baseline '{"max_num_seqs": 32}' \\
        --subject '{"max_num_seqs": 64}'
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import generation
import pairs

from laminar.engines.configs import VllmEngineConfig
from laminar.engines.vllm_engine import engine_args, eos_token_ids
from laminar.roles.data.prompts import load_tokenizer, read_records


def side_config(model: Path, max_model_len: int, side: dict[str, Any]) -> tuple[Any, int]:
    """A side's ``VllmEngineConfig`` and its concurrency."""
    fields = {k: v for k, v in side.items() if k != "concurrency"}
    fields.setdefault("max_num_seqs", 32)
    cfg = VllmEngineConfig(model=str(model), max_model_len=max_model_len, **fields)
    return cfg, int(side.get("concurrency", cfg.max_num_seqs))


async def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    segments = args.warmup_pairs + args.pairs
    model, prompts = generation.prepare(args, work, args.prompts * segments)
    tok = load_tokenizer(model)
    records = read_records(prompts)
    eos = eos_token_ids(str(model))
    sides = {"baseline": json.loads(args.baseline), "subject": json.loads(args.subject)}
    engines: dict[str, tuple[Any, int, Path]] = {}
    figures: dict[str, list[dict[str, float]]] = {"baseline": [], "subject": []}
    try:
        for name, side in sides.items():
            cfg, concurrency = side_config(model, args.max_model_len, side)
            llm, ipc = generation.bare_llm(engine_args(cfg))
            engines[name] = (llm, concurrency, ipc)
            await generation.bare_warm(llm, argparse.Namespace(concurrency=concurrency))
        for k in range(segments):
            chunk = records[k * args.prompts : (k + 1) * args.prompts]
            jobs = [(f"{r['id']}/{s}", tok.encode(r["prompt"]).ids)
                    for r in chunk for s in range(args.samples)]  # fmt: skip
            line = []
            for name in ("baseline", "subject"):
                llm, concurrency, _ = engines[name]
                await asyncio.sleep(args.settle)
                ns = argparse.Namespace(max_tokens=args.max_tokens, seed=args.seed,
                                        concurrency=concurrency)  # fmt: skip
                out = await generation.bare_generate(llm, jobs, ns, eos)
                line.append(f"{name} {out['tokens'] / out['seconds']:.0f}")
                if k >= args.warmup_pairs:
                    figures[name].append(out)
            print(f"{'warm-up ' if k < args.warmup_pairs else ''}pair {k}: " + ", ".join(line)
                  + " tokens/s", flush=True)  # fmt: skip
    finally:
        for name in list(engines):
            engine, _, ipc = engines.pop(name)
            generation.bare_stop(engine, ipc)
    rate = {n: [f["tokens"] / f["seconds"] for f in figs] for n, figs in figures.items()}
    summary = pairs.summarise(rate["baseline"], rate["subject"])
    return {"sides": sides, "tokens_per_s": summary, "runs": figures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", default="{}", help="JSON: the baseline side's settings")
    parser.add_argument("--subject", required=True, help="JSON: the subject side's settings")
    parser.add_argument("--model", help="model directory (default: a fresh `laminar model init`)")
    parser.add_argument("--prompts", type=int, default=256, help="prompts per segment")
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--warmup-pairs", type=int, default=1)
    parser.add_argument("--settle", type=float, default=3.0)
    parser.add_argument("--work", help="scratch directory (default: a temporary one)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    if args.pairs < 3:
        parser.error("--pairs: at least three, for a median and a spread")
    work = Path(args.work or tempfile.mkdtemp(prefix="laminar-bench-engine-"))
    work.mkdir(parents=True, exist_ok=True)
    result = asyncio.run(run(args, work))
    s = result["tokens_per_s"]
    print(json.dumps({"ratio_median": s["ratio_median"], "spread": s["spread"],
                      "pairs_agree": s["pairs_agree"]}))  # fmt: skip
    print(f"subject / baseline tokens/s: {s['ratio_median']:.3f} (pairs {s['ratio_min']:.3f}-"
          f"{s['ratio_max']:.3f}{'' if s['pairs_agree'] else ', they disagree'})")  # fmt: skip
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
