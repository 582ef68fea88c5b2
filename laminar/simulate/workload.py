"""The paper's workloads and placements (``shared/paper-notes.md`` §6): what each cell runs.

**Batches** (§6.1): a global batch of 8192 trajectories = 512 prompts x 16 responses; prompts of
DAPO-Math-17k are short (we take 256 tokens), responses up to 16K tokens.

**Response lengths** (Fig. 17, the checkpoints of the throughput runs), per model:

* 7B: bimodal, peaks near 0.5-1K and 7-8K, tail to 16K (:class:`laminar.engines.lengths.
  PaperLength`, 25% in the long mode);
* 32B: one peak near 2-3K, tail to ~15K (lognormal, median 2.5K, sigma 0.6);
* 72B: one peak near 1K, little beyond ~4K (lognormal, median 1K, sigma 0.6: 1% beyond 4K, and
  the longest of a batch of 8192 near 10K).

Lengths are drawn per prompt and per response: a prompt's difficulty sets a common factor of its
16 responses (``prompt_share`` of the log-variance; in the 7B mixture, the mode is the prompt's),
so long-tail prompts exist, which tail batching (RollPacker) relies on.

**Placements** (Table 2): total / train / rollout GPUs per system and scale, and each system's
rollout tensor parallelism (7B: TP 1 for AReaL and Laminar, 2 for the verl-based systems).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from laminar.engines.costmodel import TrainCostModel

from .costs import MODELS, ModelShape, Roofline

PROMPTS, SAMPLES = 512, 16
BATCH = PROMPTS * SAMPLES
PROMPT_TOKENS = 256
MAX_RESPONSE = 16384
MINI_BATCHES = 16  # mini-batch updates per iteration (§6.1)

SYSTEMS = ("verl", "one_step", "stream", "areal", "rollpacker", "laminar")

# Table 2: (total, train, rollout) per scale; verl and RollPacker colocate (train = rollout = all).
_TABLE2: dict[str, dict[str, list[tuple[int, int, int]]]] = {
    "7B": {
        "one_step": [(16, 8, 8), (32, 8, 24), (64, 16, 48), (128, 32, 96), (256, 40, 216)],
        "areal": [(16, 8, 8), (32, 16, 16), (64, 32, 32), (128, 64, 64), (256, 128, 128)],
        "laminar": [(16, 8, 8), (32, 24, 8), (64, 40, 24), (128, 80, 48), (256, 192, 64)],
    },
    "32B": {
        "one_step": [(32, 16, 16), (64, 32, 32), (128, 48, 80), (256, 64, 192), (512, 80, 432)],
        "areal": [(g, g // 2, g // 2) for g in (32, 64, 128, 256, 512)],
        "laminar": [(g, g // 2, g // 2) for g in (32, 64, 128, 256, 512)],
    },
    "72B": {
        "one_step": [
            (64, 32, 32), (128, 64, 64), (256, 96, 160), (512, 192, 320), (1024, 256, 768),
        ],
        "areal": [(64, 32, 32), (128, 64, 64), (256, 128, 128), (512, 320, 192), (1024, 640, 384)],
        "laminar": [
            (64, 32, 32), (128, 64, 64), (256, 128, 128), (512, 320, 192), (1024, 768, 256),
        ],
    },
}  # fmt: skip
_ROLLOUT_TP = {"7B": 1, "32B": 4, "72B": 8}
SCALES = {model: [p[0] for p in rows["laminar"]] for model, rows in _TABLE2.items()}


@dataclass(frozen=True)
class Placement:
    total: int
    train: int
    rollout: int
    tp: int
    colocated: bool = False

    @property
    def engines(self) -> int:
        return self.rollout // self.tp


def placement(system: str, model: str, total: int) -> Placement:
    """Table 2's placement of ``system`` for ``model`` at ``total`` GPUs."""
    tp = _ROLLOUT_TP[model]
    if model == "7B" and system not in ("areal", "laminar"):
        tp = 2
    if system in ("verl", "rollpacker"):
        return Placement(total, total, total, tp, colocated=True)
    rows = _TABLE2[model]["one_step" if system == "stream" else system]
    for row in rows:
        if row[0] == total:
            return Placement(*row, tp=tp)
    raise ValueError(f"Table 2 has no {total}-GPU placement of {system} for {model}")


@dataclass(frozen=True)
class Lengths:
    """Response lengths of one model (see the module docstring)."""

    model: str
    prompt_share: float = 0.5  # of log-length variance that is the prompt's

    def prompts(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """One difficulty per prompt (a log-length offset; 7B: the mode, then an offset)."""
        return rng.standard_normal(n)

    def responses(
        self, rng: np.random.Generator, difficulty: np.ndarray, per_prompt: int
    ) -> np.ndarray:
        """``per_prompt`` response lengths for each prompt, shape (prompts, per_prompt)."""
        n = difficulty.size
        noise = rng.standard_normal((n, per_prompt))
        a, b = np.sqrt(self.prompt_share), np.sqrt(1 - self.prompt_share)
        z = a * difficulty[:, None] + b * noise
        if self.model == "7B":  # the prompt picks the mode (25% long), then lognormal within
            long = rng.random(n) < 0.25
            median = np.where(long, 8192.0, 1024.0)[:, None]
            sigma = np.where(long, 0.35, 0.5)[:, None]
        elif self.model == "32B":
            median, sigma = np.full((n, 1), 2500.0), np.full((n, 1), 0.6)
        else:
            median, sigma = np.full((n, 1), 1000.0), np.full((n, 1), 0.6)
        out = np.rint(median * np.exp(sigma * z)).astype(np.int64)
        return np.clip(out, 1, MAX_RESPONSE)


def model_shape(model: str) -> ModelShape:
    return MODELS[model]


@dataclass(frozen=True)
class Setup:
    """What a cell's systems run on: each rollout engine's costs, the GPU placement, the
    trainer's update cost and the response lengths.

    ``overheads=False`` charges nothing but the engines' own steps: no training time, no weight
    movement (broadcasts, the relay chain, loads, the trainer's copy, colocated switches) and no
    KV transfer. Only decode (and prefill, which the roofline prices) then takes time, and each
    system's throughput has a closed form: the simulator's own check."""

    roofline: Roofline
    place: Placement
    train: TrainCostModel
    lengths: Lengths
    overheads: bool = True

    def cost(self, seconds: float) -> float:
        """An overhead's ``seconds`` (0 with overheads off)."""
        return seconds if self.overheads else 0.0

    def train_time(self, tokens: int) -> float:
        """Seconds of one update on ``tokens`` tokens."""
        return self.cost(self.train.train_time(tokens))
