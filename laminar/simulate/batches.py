"""Batch-synchronous systems: verl, one-step staleness, stream generation, RollPacker.

Each generates a batch on all its rollout engines at once and trains on it; they differ in what
overlaps (paper §6.2, ``shared/paper-notes.md`` §1.4 and §7.3):

* **verl** (synchronous, colocated): generate the batch on every GPU, switch the GPUs to training
  (reshard the weights), train, switch back. Iteration = generation + train + switches.
* **one-step** (disaggregated, staleness 1): batch i+1 is generated with the weights of step i-1
  while step i trains; a global NCCL broadcast hands each new version to every rollout.
* **stream** (staleness 1, streamed): as one-step, and the trainer starts each of the 16
  mini-batch updates as soon as enough of the batch has completed.
* **RollPacker** (tail batching, colocated, on-policy): short rounds launch 1.25 x the prompts x
  1.25 x the responses and keep the first 512 prompts whose 16 responses finish first, aborting
  the rest; the aborted prompts wait in a queue and, once it holds 512, run as one long round at
  full length.

A batch's sequences are dealt round-robin to the engines (the data-parallel split of the batch),
each engine is given its share at once and runs in closed form (:class:`.engine.SimEngine`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

import numpy as np

from .costs import NVLINK_BPS, Roofline, ring_broadcast
from .engine import Sequence, SimEngine
from .workload import MINI_BATCHES, PROMPT_TOKENS, PROMPTS, SAMPLES, Lengths, Setup

#: Colocated systems switch their GPUs between rollout and training twice per iteration
#: (offload / onload of weights and optimizer states, reshard): a fixed cost plus the weights
#: over NVLink. Not in the paper; an assumption, stated.
SWITCH_BASE_S = 2.0


class Batches:
    """Sequence ids and lengths for one run: prompts in groups of ``SAMPLES``."""

    def __init__(self, lengths: Lengths, seed: int) -> None:
        self.lengths, self.rng = lengths, np.random.default_rng(seed)
        self.next_id = 0

    def groups(self, prompts: int, per_prompt: int = SAMPLES) -> list[list[Sequence]]:
        difficulty = self.lengths.prompts(self.rng, prompts)
        targets = self.lengths.responses(self.rng, difficulty, per_prompt)
        out = []
        for row in targets:
            group = [Sequence(self.next_id + j, PROMPT_TOKENS, int(n)) for j, n in enumerate(row)]
            self.next_id += per_prompt
            out.append(group)
        return out


def generate(engines: list[SimEngine], sequences: list[Sequence], start: float) -> dict[int, float]:
    """Deal ``sequences`` round-robin to ``engines`` at ``start``; every finish time."""
    for i, engine in enumerate(engines):
        engine.now = start
        engine.add(sequences[i :: len(engines)], at=start)
    done: dict[int, float] = {}
    for engine in engines:
        done.update((i, t) for i, t, _ in engine.run_until(math.inf))
    return done


def tokens_of(sequences: list[Sequence]) -> int:
    return sum(s.prompt + s.target for s in sequences)


def switch_s(roofline: Roofline) -> float:
    """One switch of colocated GPUs between rollout and training (see SWITCH_BASE_S)."""
    return SWITCH_BASE_S + roofline.model.weight_bytes / NVLINK_BPS


def run_batches(
    system: str, setup: Setup, iterations: int, seed: int
) -> tuple[list[float], list[int]]:
    """Actor-update completion times and each update's tokens, for ``iterations`` updates."""
    if system not in ("verl", "one_step", "stream", "rollpacker"):
        raise ValueError(f"not a batch-synchronous system: {system}")
    roofline, train_time = setup.roofline, setup.train_time
    engines = [SimEngine(roofline) for _ in range(setup.place.engines)]
    batches = Batches(setup.lengths, seed)
    switch = setup.cost(switch_s(roofline))
    if system == "rollpacker":
        return _rollpacker(engines, switch, train_time, batches, iterations)
    sync = setup.cost(ring_broadcast(roofline.model.weight_bytes, setup.place.rollout))
    updates: list[float] = []
    tokens: list[int] = []
    gen_start, trained = 0.0, 0.0
    for _ in range(iterations):
        seqs = [s for g in batches.groups(PROMPTS) for s in g]
        done = generate(engines, seqs, gen_start)
        gen_end = max(done.values())
        size = tokens_of(seqs)
        if system == "verl":
            trained = gen_end + 2 * switch + train_time(size)
            gen_start = trained
        else:  # staleness 1: the next batch needs the version before this one, broadcast
            if system == "one_step":
                trained = max(gen_end, trained) + train_time(size)
            else:  # stream: each mini-batch once enough of the batch is done
                ends = sorted(done.values())
                per = len(ends) // MINI_BATCHES
                step = train_time(size) / MINI_BATCHES  # linear: its share of the base
                for j in range(MINI_BATCHES):
                    trained = max(trained, ends[(j + 1) * per - 1]) + step
            gen_start = max(gen_end, (updates[-1] if updates else 0.0) + sync)
        updates.append(trained)
        tokens.append(size)
    return updates, tokens


def _rollpacker(
    engines: list[SimEngine],
    switch: float,
    train_time: Callable[[int], float],
    batches: Batches,
    iterations: int,
) -> tuple[list[float], list[int]]:
    """Tail batching (see the module docstring), colocated like verl."""
    eta = 1.25
    launched_prompts, per_prompt = round(PROMPTS * eta), round(SAMPLES * eta)
    queue: deque[list[Sequence]] = deque()
    updates: list[float] = []
    tokens: list[int] = []
    now = 0.0
    while len(updates) < iterations:
        if len(queue) >= PROMPTS:  # a long round: no speculation, full length
            groups = [queue.popleft() for _ in range(PROMPTS)]
            seqs = [s for g in groups for s in g]
            done = generate(engines, seqs, now)
            end = max(done.values())
            kept = seqs
        else:  # a short round: the first 512 prompts with 16 of 20 responses done win
            groups = batches.groups(launched_prompts, per_prompt)
            seqs = [s for g in groups for s in g]
            done = generate(engines, seqs, now)
            complete = []
            for g in groups:
                times = sorted(done[s.id] for s in g)
                complete.append((times[SAMPLES - 1], g))
            complete.sort(key=lambda c: c[0])
            end = complete[PROMPTS - 1][0]
            kept = []
            for _, g in complete[:PROMPTS]:
                kept += sorted(g, key=lambda s: done[s.id])[:SAMPLES]
            for _, g in complete[PROMPTS:]:  # aborted: its prompt goes to the long queue
                queue.append([Sequence(s.id, s.prompt, s.target) for s in g[:SAMPLES]])
            # the engines ran every sequence to its end above; the round really ends at `end`
            # (the rest aborted), so only the time up to `end` is charged
        size = tokens_of(kept)
        now = end + 2 * switch + train_time(size)
        updates.append(now)
        tokens.append(size)
    return updates, tokens
