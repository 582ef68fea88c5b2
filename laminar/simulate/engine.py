"""One rollout engine in closed form: continuous batching from one event to the next.

Why no per-token loop: a 1024-GPU cell generates millions of tokens per iteration. Between two
events (a sequence finishes, the KV cache fills, the caller asks for a time) every running
sequence gains one token per decode step and nothing else changes, so the engine jumps straight
to the next event: ``n`` steps of a batch of ``b`` sequences whose context grows by ``b`` tokens
a step take ``sum_{i<n} step(b, ctx + b i)``, which for a step time linear in the context (the
memory-bound roofline, :class:`.costs.Roofline`) is ``n`` times the step at the midpoint.

Why a heap and a step counter: every running sequence advances by the same number of steps, so a
sequence admitted at engine step ``s`` with ``g`` of its ``t`` response tokens done finishes at
step ``s + t - g`` whatever happens meanwhile, short of a preemption. The running batch is a heap
of those finish steps (plus the admission order, for preemption and for what :meth:`take`
returns), and an event costs O(log n) for what it changes, not a pass over the whole batch. A
paper cell has ~70k events over batches of hundreds of sequences; the numpy arrays this replaced
spent most of a cell's time in numpy's per-call overhead. ``benchmarks/simulator.py`` compares
the two on the same cells (docs/benchmarks.md, *The simulator's engine*).

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

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

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


class _Running:
    """A sequence in the running batch: it finishes at engine step ``finish``; ``order`` is its
    admission number; ``alive`` is False once it finished, was preempted or taken (the heap and
    the admission list drop such entries lazily)."""

    __slots__ = ("alive", "finish", "order", "seq", "start")

    def __init__(self, seq: Sequence, start: int, order: int) -> None:
        self.seq = seq  # its ``generated`` as at admission
        self.start = start  # the engine step it was admitted at
        self.order = order
        self.finish = start + seq.target - seq.generated
        self.alive = True

    def generated(self, step: int) -> int:
        return self.seq.generated + step - self.start


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
        self._step = 0  # decode steps so far: every running sequence gained one token in each
        #: (finish step, admission number, sequence): tuples, so the heap compares in C
        self._heap: list[tuple[int, int, _Running]] = []
        self._admitted: list[_Running] = []  # in admission order (dead entries dropped lazily)
        self._running = 0
        self._orders = 0  # admissions so far
        self._ctx = 0  # tokens of KV the running batch holds: sum(prompt + generated)

    # -- what the caller sees ------------------------------------------------------------------

    @property
    def running(self) -> int:
        return self._running

    @property
    def in_flight(self) -> int:
        return self._running + len(self.waiting)

    @property
    def kv_tokens(self) -> int:
        """Tokens of KV cache the running batch holds (its prompts and what they generated)."""
        return self._ctx

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
        step = self._step
        out = [
            Sequence(r.seq.id, r.seq.prompt, r.seq.target, r.generated(step), keep_kv)
            for r in self._admitted
            if r.alive
        ]
        out.extend(self.waiting)
        self.waiting.clear()
        self._heap.clear()
        self._admitted.clear()
        self._running = 0
        self._ctx = 0
        return out

    def next_finish(self) -> float:
        """When the next sequence finishes if nothing else happens (inf: nothing runs)."""
        if self._running == 0:
            return math.inf
        steps, _ = self._steps_to_event()  # a preemption may come first: then a lower bound
        return self.now + self._steps_time(steps)

    def run_until(self, until: float) -> list[tuple[int, float, int]]:
        """Advance to ``until`` (or as close as a whole step allows); returns the sequences that
        finished: (id, finish time, response tokens)."""
        done: list[tuple[int, float, int]] = []
        while self._running and self.now < until:
            steps, full = self._steps_to_event()
            elapsed = self._steps_time(steps)
            if self.now + elapsed > until:  # the event is past `until`: go as far as allowed
                k = self._steps_within(until - self.now, steps)
                self._decode(k, self._steps_time(k))
                break
            self._decode(steps, elapsed)
            finished = self._pop_finished()
            if finished:
                for r in finished:  # in admission order
                    g = r.generated(self._step)
                    done.append((r.seq.id, self.now, g))
                    self._ctx -= r.seq.prompt + g
            elif full:
                self._preempt()
            self._admit()
        return done

    # -- the closed form -------------------------------------------------------------------------

    def _top(self) -> _Running:
        """The next running sequence to finish (dropping dead entries off the heap's top)."""
        heap = self._heap
        while not heap[0][2].alive:
            heapq.heappop(heap)
        return heap[0][2]

    def _pop_finished(self) -> list[_Running]:
        """The running sequences whose last token came by now, out of the batch."""
        heap, step, out = self._heap, self._step, []
        while heap and (heap[0][0] <= step or not heap[0][2].alive):
            r = heapq.heappop(heap)[2]
            if r.alive:
                r.alive = False
                out.append(r)
        if out:
            self._running -= len(out)
            out.sort(key=lambda r: r.order)
            if len(self._admitted) > 2 * self._running + 64:  # keep the list about the batch
                self._admitted = [r for r in self._admitted if r.alive]
        return out

    def _steps_to_event(self) -> tuple[int, bool]:
        """Steps to the next finish, or to a full KV cache if that comes first (then True)."""
        to_finish = self._top().finish - self._step
        room = self.capacity - self._ctx
        to_full = room // self._running
        if to_full < to_finish:
            return max(to_full, 1), True
        return max(to_finish, 1), False

    def _steps_time(self, steps: int) -> float:
        """Seconds of ``steps`` decode steps of the current batch, its context growing."""
        b = self._running
        mid = self._ctx + b * (steps - 1) / 2
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
        self._step += steps
        self._ctx += steps * self._running
        self.stats.decode_tokens += steps * self._running
        self.stats.busy_s += seconds
        self.now += seconds

    def _preempt(self) -> None:
        """The most recently admitted sequence gives its KV back and waits at the front."""
        admitted = self._admitted
        while not admitted[-1].alive:
            admitted.pop()
        r = admitted.pop()
        r.alive = False  # its heap entry goes when it reaches the top
        self._running -= 1
        seq = Sequence(r.seq.id, r.seq.prompt, r.seq.target, r.generated(self._step))
        self._ctx -= seq.context
        self.waiting.appendleft(seq)
        self.stats.preemptions += 1

    def _admit(self) -> None:
        """FIFO admission while the batch has room and the KV cache fits the next context."""
        used = self._ctx
        new: list[Sequence] = []
        while self.waiting and self._running + len(new) < self.max_running:
            seq = self.waiting[0]
            if used + seq.context > self.capacity * (1 - WATERMARK):
                if self._running + len(new) == 0:
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
        for seq in new:
            r = _Running(seq, self._step, self._orders)
            self._orders += 1
            self._admitted.append(r)
            heapq.heappush(self._heap, (r.finish, r.order, r))
        self._running += len(new)
