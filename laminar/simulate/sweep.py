"""The paper's Fig. 11 on cost models: every system at every scale of every model.

``laminar simulate sweep --json OUT.json --plot OUT.png`` runs the cells (:func:`.cells.run_cell`),
prints a table beside the paper's numbers, and writes:

* ``cells``: tokens/s (and iteration seconds, placement) per model, GPU count and system;
* ``speedup``: Laminar over each baseline per cell; ``avg_speedup`` per baseline (mean over the
  cells, as the paper averages) and ``max_speedup``; ``laminar_over_verl_max``;
* ``scaling_efficiency``: Laminar's, per model and averaged, by the paper's definition
  ((throughput at the largest scale / at the smallest) / (GPUs largest / GPUs smallest));
* ``paper``: the paper's figures for the same quantities (``shared/paper-notes.md`` §6.4).
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from laminar.runtime.errors import ConfigError

from .cells import run_cell
from .workload import SCALES, SYSTEMS

BASELINES = tuple(s for s in SYSTEMS if s != "laminar")

#: The paper's figures (§6.4): average and maximum speedup of Laminar per baseline, the top-scale
#: maxima per model (over all baselines), and Laminar's strong-scaling efficiency on math.
PAPER: dict[str, Any] = {
    "avg_speedup": {"verl": 2.56, "one_step": 1.98, "stream": 1.93, "areal": 1.39},
    "max_speedup": {"verl": 5.49, "one_step": 4.09, "stream": 4.06, "areal": 1.81},
    "top_scale_max": {"7B": 5.48, "32B": 4.52, "72B": 4.51},
    "scaling_efficiency": {"mean": 0.537, "32B": 0.682},
    "laminar_tokens_per_s_1e5": {
        "7B": [0.35, 0.67, 1.38, 2.08, 2.6],
        "32B": [0.2, 0.4, 0.68, 1.22, 2.28],
        "72B": [0.2, 0.39, 0.54, 0.88, 1.49],
    },
}


def sweep(
    models: tuple[str, ...] = ("7B", "32B", "72B"),
    systems: tuple[str, ...] = SYSTEMS,
    seed: int = 0,
    warmup: int = 2,
    measured: int = 4,
    log: Any = print,
    gpus_only: tuple[int, ...] | None = None,
) -> dict[str, Any]:
    """Every system at every Table 2 scale of each model (``gpus_only``: at those of them)."""
    start = time.perf_counter()
    cells: dict[str, dict[str, dict[str, Any]]] = {}
    for model in models:
        cells[model] = {}
        for gpus in scales_of(model, gpus_only):
            row = {}
            for system in systems:
                cell = run_cell(system, model, gpus, seed=seed, warmup=warmup, measured=measured)
                row[system] = asdict(cell)
            cells[model][str(gpus)] = row
            log(
                f"{model:>4} {gpus:5d} GPUs  "
                + "  ".join(f"{s} {row[s]['tokens_per_s'] / 1e5:.2f}" for s in systems)
            )
    result: dict[str, Any] = {"cells": cells, "paper": PAPER, "seed": seed}
    if "laminar" in systems:
        result.update(_speedups(cells, models, [s for s in systems if s != "laminar"]))
    result["wall_s"] = time.perf_counter() - start
    return result


def scales_of(model: str, only: tuple[int, ...] | None = None) -> list[int]:
    """``model``'s Table 2 GPU counts, or those of ``only`` (each must be one of them)."""
    if model not in SCALES:
        raise ConfigError(f"no Table 2 scales for model {model!r}; models: {', '.join(SCALES)}")
    if only is None:
        return list(SCALES[model])
    unknown = sorted(set(only) - set(SCALES[model]))
    if unknown:
        known = ", ".join(map(str, SCALES[model]))
        raise ConfigError(f"{model} has no Table 2 scale of {unknown} GPUs; its scales: {known}")
    return [g for g in SCALES[model] if g in only]


def _speedups(
    cells: dict[str, Any], models: tuple[str, ...], baselines: list[str]
) -> dict[str, Any]:
    speedup: dict[str, dict[str, dict[str, float]]] = {}
    per_baseline: dict[str, list[float]] = {b: [] for b in baselines}
    top: dict[str, float] = {}
    efficiency: dict[str, float] = {}
    for model in models:
        speedup[model] = {}
        scales = sorted(cells[model], key=int)
        for gpus in scales:
            row = cells[model][gpus]
            mine = row["laminar"]["tokens_per_s"]
            speedup[model][gpus] = {b: mine / row[b]["tokens_per_s"] for b in baselines}
            for b in baselines:
                per_baseline[b].append(speedup[model][gpus][b])
        top[model] = max(speedup[model][scales[-1]].values(), default=0.0)
        low, high = cells[model][scales[0]], cells[model][scales[-1]]
        growth = high["laminar"]["tokens_per_s"] / low["laminar"]["tokens_per_s"]
        efficiency[model] = growth / (int(scales[-1]) / int(scales[0]))
    efficiency["mean"] = sum(efficiency[m] for m in models) / len(models)
    verl = per_baseline.get("verl", [])
    return {
        "speedup": speedup,
        "avg_speedup": {b: sum(v) / len(v) for b, v in per_baseline.items() if v},
        "max_speedup": {b: max(v) for b, v in per_baseline.items() if v},
        "top_scale_max": top,
        "laminar_over_verl_max": max(verl) if verl else None,
        "scaling_efficiency": efficiency,
    }


def describe(result: dict[str, Any]) -> list[str]:
    """The headline lines: each figure beside the paper's."""
    if "avg_speedup" not in result:
        return []
    lines = ["average speedup of laminar (paper):"]
    for b, v in result["avg_speedup"].items():
        paper = PAPER["avg_speedup"].get(b)
        lines.append(f"  over {b:10s} {v:5.2f}x" + (f"  ({paper}x)" if paper else ""))
    lines.append("top-scale maximum (paper):")
    for m, v in result["top_scale_max"].items():
        lines.append(f"  {m:4s} {v:5.2f}x  ({PAPER['top_scale_max'].get(m, '-')}x)")
    eff = result["scaling_efficiency"]
    lines.append(
        f"laminar strong-scaling efficiency {eff['mean']:.1%} "
        f"(paper {PAPER['scaling_efficiency']['mean']:.1%}); "
        + ", ".join(f"{m} {v:.1%}" for m, v in eff.items() if m != "mean")
    )
    return lines


def plot(result: dict[str, Any], path: str | Path) -> Path:
    """Fig. 11's shape: tokens/s against GPUs, one panel per model, one line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(result["cells"])
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        rows = result["cells"][model]
        scales = sorted(rows, key=int)
        for system in rows[scales[0]]:
            ax.plot(
                [int(g) for g in scales],
                [rows[g][system]["tokens_per_s"] / 1e5 for g in scales],
                marker="o",
                label=system,
                linewidth=2.5 if system == "laminar" else 1.2,
            )
        paper = PAPER["laminar_tokens_per_s_1e5"].get(model)
        if paper:  # the paper's figure at the scales run (its points follow Table 2's)
            at = [SCALES[model].index(int(g)) for g in scales]
            ax.plot(
                [int(g) for g in scales], [paper[i] for i in at], "k--", label="laminar (paper)"
            )
        ax.set_xscale("log", base=2)
        ax.set_title(f"Qwen2.5-{model}")
        ax.set_xlabel("GPUs")
        ax.set_ylabel("tokens/s (x1e5)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
