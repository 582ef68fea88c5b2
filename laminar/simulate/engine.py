"""One rollout engine in closed form: continuous batching from one event to the next.

Why no per-token loop: a 1024-GPU cell generates millions of tokens per iteration. Between two
events (a sequence finishes, the KV cache fills, the caller asks for a time) every running
sequence gains one token per decode step and nothing else changes, so the engine jumps straight
to the next event: ``n`` steps of a batch of ``b`` sequences whose context grows by ``b`` tokens
a step take ``sum_{i<n} step(b, ctx + b i)``, which for a step time linear in the context (the
memory-bound roofline, :class:`.costs.Roofline`) is ``n`` times the step at the midpoint. Numpy
arrays hold the running sequences, so an event costs one vectorised update of the batch.

What it models, as vLLM does:

* **Admission** (FIFO): a waiting sequence starts once its whole context (prompt, plus what it had
  generated before an abort or a preemption, recomputed) fits in the free KV cache less a 1%
  watermark and the batch is below ``max_running``; admitted sequences are prefilled together
  before the next step (the engine's time advances by the prefill; decode waits, as without
  chunked prefill).
* **Preemption**: when the running batch's context reaches the KV capacity, the most recently
  admitted sequence is preempted (its KV dropped, recomputed when it is admitted again).
* **Taking sequences out** (an abort at a weight update, a migration): :meth:`take` returns them
  with their progress; with ``keep_kv`` the destination skips the recompute (:meth:`add`).

Times are absolute seconds of the simulation; the engine keeps its own ``now`` (it is advanced
lazily: the caller says up to when).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .costs import Roofline

#: Admission keeps this fraction of the KV cache free (vLLM's default watermark), so a sequence
#: just preempted is not admitted again at once only to be preempted on the next step.
WATERMARK = 0.01


@dataclass
class Sequence:
    """A trajectory's generation state, as it moves between queues and engines."""

    id: int
    prompt: int  # prompt tokens
    target: int  # response tokens it will end at
    generated: int = 0  # response tokens so far
    has_kv: bool = False  # its KV cache comes along (a migration): no recompute on admission

    @property
    def context(self) -> int:
        return self.prompt + self.generated


@dataclass
class EngineStats:
    prefill_tokens: int = 0  # prefilled, recomputes included
    recompute_tokens: int = 0  # of which prefilled again (abort, preemption, migration w/o KV)
    decode_tokens: int = 0
    preemptions: int = 0
    busy_s: float = 0.0  # time spent prefilling, decoding or loading


@dataclass
class SimEngine:
    """One engine (``roofline.tp`` GPUs); see the module docstring."""

    roofline: Roofline
    max_running: int = 1024
    now: float = 0.0
    version: int = 0
    stats: EngineStats = field(default_factory=EngineStats)

    def __post_init__(self) -> None:
        self.capacity = self.roofline.kv_capacity_tokens
        self.waiting: deque[Sequence] = deque()
        self._ids = np.zeros(0, dtype=np.int64)
        self._prompt = np.zeros(0, dtype=np.int64)
        self._target = np.zeros(0, dtype=np.int64)
        self._generated = np.zeros(0, dtype=np.int64)
        self._ctx = 0  # tokens of KV the running batch holds: sum(prompt + generated)

    # -- what the caller sees ------------------------------------------------------------------

    @property
    def running(self) -> int:
        return int(self._ids.size)

    @property
    def in_flight(self) -> int:
        return self.running + len(self.waiting)

    @property
    def kv_used(self) -> float:
        """Fraction of the KV cache the running batch holds."""
        return self._ctx / self.capacity if self.capacity else 0.0

    def add(self, sequences: list[Sequence], at: float) -> None:
        """Queue ``sequences`` (FIFO) at time ``at``; they start as room allows."""
        self.now = max(self.now, at)
        self.waiting.extend(sequences)
        self._admit()

    def busy_until(self, until: float) -> None:
        """The engine does nothing else until ``until`` (loading weights)."""
        if until > self.now:
            self.stats.busy_s += until - self.now
            self.now = until

    def take(self, at: float, keep_kv: bool = False) -> list[Sequence]:
        """Everything in flight at ``at`` (running first, then waiting), out of this engine."""
        self.run_until(at)
        self.now = max(self.now, at)
        out = [
            Sequence(int(i), int(p), int(t), int(g), keep_kv)
            for i, p, t, g in zip(
                self._ids, self._prompt, self._target, self._generated, strict=True
            )
        ]
        out.extend(self.waiting)
        self.waiting.clear()
        self._set(np.zeros(0, dtype=np.int64), *(np.zeros(0, dtype=np.int64),) * 3)
        self._ctx = 0
        return out

    def next_finish(self) -> float:
        """When the next sequence finishes if nothing else happens (inf: nothing runs)."""
        if self.running == 0:
            return math.inf
        steps, _ = self._steps_to_event()  # a preemption may come first: then a lower bound
        return self.now + self._steps_time(steps)

    def run_until(self, until: float) -> list[tuple[int, float, int]]:
        """Advance to ``until`` (or as close as a whole step allows); returns the sequences that
        finished: (id, finish time, response tokens)."""
        done: list[tuple[int, float, int]] = []
        while self.running and self.now < until:
            steps, full = self._steps_to_event()
            elapsed = self._steps_time(steps)
            if self.now + elapsed > until:  # the event is past `until`: go as far as allowed
                k = self._steps_within(until - self.now, steps)
                self._decode(k, self._steps_time(k))
                break
            self._decode(steps, elapsed)
            finished = self._target - self._generated <= 0
            if finished.any():
                for i, g in zip(self._ids[finished], self._generated[finished], strict=True):
                    done.append((int(i), self.now, int(g)))
                self._ctx -= int((self._prompt[finished] + self._generated[finished]).sum())
                keep = ~finished
                self._set(*(a[keep] for a in self._arrays()))
            elif full:
                self._preempt()
            self._admit()
        return done

    # -- the closed form -------------------------------------------------------------------------

    def _arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return self._ids, self._prompt, self._target, self._generated

    def _set(
        self, ids: np.ndarray, prompt: np.ndarray, target: np.ndarray, gen: np.ndarray
    ) -> None:
        self._ids, self._prompt, self._target, self._generated = ids, prompt, target, gen

    def _context(self) -> int:
        return self._ctx

    def _steps_to_event(self) -> tuple[int, bool]:
        """Steps to the next finish, or to a full KV cache if that comes first (then True)."""
        to_finish = int((self._target - self._generated).min())
        room = self.capacity - self._context()
        to_full = room // self.running if self.running else to_finish
        if to_full < to_finish:
            return max(to_full, 1), True
        return max(to_finish, 1), False

    def _steps_time(self, steps: int) -> float:
        """Seconds of ``steps`` decode steps of the current batch, its context growing."""
        b = self.running
        mid = self._context() + b * (steps - 1) / 2
        return steps * self.roofline.decode_step(b, mid)

    def _steps_within(self, seconds: float, limit: int) -> int:
        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._steps_time(mid) <= seconds:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _decode(self, steps: int, seconds: float) -> None:
        if steps <= 0:
            return
        self._generated = self._generated + steps
        self._ctx += steps * self.running
        self.stats.decode_tokens += steps * self.running
        self.stats.busy_s += seconds
        self.now += seconds

    def _preempt(self) -> None:
        """The most recently admitted sequence gives its KV back and waits at the front."""
        last = self.running - 1
        seq = Sequence(
            int(self._ids[last]), int(self._prompt[last]), int(self._target[last]),
            int(self._generated[last]),
        )  # fmt: skip
        self._set(*(a[:last] for a in self._arrays()))
        self._ctx -= seq.context
        self.waiting.appendleft(seq)
        self.stats.preemptions += 1

    def _admit(self) -> None:
        """FIFO admission while the batch has room and the KV cache fits the next context."""
        used = self._context()
        new: list[Sequence] = []
        while self.waiting and self.running + len(new) < self.max_running:
            seq = self.waiting[0]
            if used + seq.context > self.capacity * (1 - WATERMARK):
                if self.running + len(new) == 0:
                    raise ValueError(
                        f"sequence {seq.id} needs {seq.context} tokens of KV cache; the engine "
                        f"holds {self.capacity}"
                    )
                break
            self.waiting.popleft()
            used += seq.context
            new.append(seq)
        if not new:
            return
        prefill = sum(s.context for s in new if not s.has_kv)
        recompute = sum(s.generated for s in new if not s.has_kv)
        self.stats.prefill_tokens += prefill
        self.stats.recompute_tokens += recompute
        seconds = self.roofline.prefill(prefill)
        self._ctx = used
        self.stats.busy_s += seconds
        self.now += seconds
        self._set(
            np.concatenate([self._ids, [s.id for s in new]]).astype(np.int64),
            np.concatenate([self._prompt, [s.prompt for s in new]]).astype(np.int64),
            np.concatenate([self._target, [s.target for s in new]]).astype(np.int64),
            np.concatenate([self._generated, [s.generated for s in new]]).astype(np.int64),
        )
