"""RollMux (arXiv 2512.11306, ``shared/paper-notes.md`` §7.4): two jobs sharing one pair of pools.

Why it is here: Laminar's answer to the idle trainer of synchronous RL is asynchrony within one
job; RollMux's is to fill one job's idle phase with another job's busy phase. A capacity planner
comparing the two wants both on the same cost models, so this runs RollMux's schedule on the
sweep's engines and trainer (:mod:`.batches`, :mod:`.costs`).

The setting (RollMux's): synchronous on-policy jobs on a disaggregated cluster, a rollout pool and
a training pool (Table 2's one-step placement of the model and scale). One job alone (*solo*,
"standard disaggregation") alternates: generate its batch on the rollout pool, train on the
training pool, broadcast the new weights, generate again; each pool idles while the other works.
Two jobs *multiplexed* (RollMux's intra-group round robin) share both pools: the rollout pool
generates job A's batch, then job B's, then A's again as soon as A's new weights are there; the
training pool trains each batch as it completes. Switching the rollout pool to the other job
costs a load of that job's weights from host memory (RollMux's residency constraint: every job's
weights stay cached in host memory, a "warm" switch over PCIe), and each job's broadcast of new
weights goes to its host-memory copy while the pool serves the other job.

Both jobs run the same model and workload (different prompts: different seeds). The figure is
RollMux's: cost efficiency, trained tokens/s per GPU, multiplexed over solo (the paper reports a
gain of 1.84 over standard disaggregation on its H20 + H800 clusters).
"""

from __future__ import annotations

from dataclasses import dataclass

from .batches import Batches, generate, tokens_of
from .cells import cell_setup
from .continuous import PCIE_BPS
from .costs import ring_broadcast
from .engine import SimEngine
from .workload import PROMPTS, Setup

__all__ = ["Multiplexed", "run_jobs", "run_multiplexed"]


@dataclass
class Multiplexed:
    model: str
    gpus: int
    solo_tokens_per_s: float  # one job on the pools
    multiplexed_tokens_per_s: float  # both jobs together, on the same pools
    efficiency_gain: float  # multiplexed / solo: tokens/s per GPU, same GPUs
    rollout_busy_solo: float  # share of time the rollout pool generates
    rollout_busy_multiplexed: float


def run_jobs(setup: Setup, jobs: int, iterations: int, seed: int) -> tuple[float, float]:
    """Tokens/s of all ``jobs`` together after the first round (every pipeline full), and the
    share of the whole run the rollout pool spent generating."""
    engines = [SimEngine(setup.roofline) for _ in range(setup.place.engines)]
    workloads = [Batches(setup.lengths, seed + 1000 * j) for j in range(jobs)]
    weights = setup.roofline.model.weight_bytes
    sync = setup.cost(ring_broadcast(weights, setup.place.rollout))
    switch = setup.cost(weights / (PCIE_BPS * setup.roofline.tp)) if jobs > 1 else 0.0
    ready = [0.0] * jobs  # when each job's newest weights are at the rollouts' hosts
    pool_free, trainer_free, busy = 0.0, 0.0, 0.0
    trained: list[tuple[float, int]] = []  # (update done, tokens)
    for _ in range(iterations):
        for j in range(jobs):  # round robin: provably optimal for identical jobs (RollMux)
            start = max(pool_free, ready[j]) + switch
            seqs = [s for g in workloads[j].groups(PROMPTS) for s in g]
            done = generate(engines, seqs, start)
            end = max(done.values())
            busy += end - start
            pool_free = end
            trainer_free = max(trainer_free, end) + setup.train_time(tokens_of(seqs))
            trained.append((trainer_free, tokens_of(seqs)))
            ready[j] = trainer_free + sync
    first = trained[jobs - 1][0]  # from the end of the first round on
    later = trained[jobs:]
    span = later[-1][0] - first
    return sum(t for _, t in later) / span, busy / trained[-1][0]


def run_multiplexed(model: str, gpus: int, *, iterations: int = 6, seed: int = 0) -> Multiplexed:
    """One job alone vs two multiplexed on Table 2's one-step placement of ``model``."""
    setup = cell_setup("one_step", model, gpus)  # disaggregated, decoding eagerly
    solo, solo_busy = run_jobs(setup, 1, iterations, seed)
    both, both_busy = run_jobs(setup, 2, iterations, seed)
    return Multiplexed(model, gpus, solo, both, both / solo, solo_busy, both_busy)
