"""The model-free engine: vLLM's scheduling shape, lengths from a distribution, time from a model.

Why: emulated and simulated clusters (design.md, "Three ways to run the same role code") need an
engine that behaves like a GPU rollout — continuous batching, a KV cache that fills up, step times
that depend on the batch — without a model, so that schedules can be compared on a laptop and a
1024-GPU cluster can run in seconds under the virtual clock. It implements :class:`Engine`; the
base class keeps the per-request records, so abort/export/import behave as for vLLM.

What a request gets:

* a *target length* drawn from ``config.lengths`` by an rng seeded with ``(config.seed,
  hash(request id))``: the same request id always gets the same length, and an exported sequence
  continues elsewhere to the same total length. The target is clipped to the request's
  ``max_tokens`` (finish reason ``"length"`` when the drawn length reaches the budget, ``"stop"``
  otherwise) and to what the KV cache could ever hold (``kv_capacity_tokens - prompt``, also
  ``"length"``, like vLLM's ``max_model_len``). A sequence always produces at least one token.
* the same refusals as vLLM (:class:`Engine`): a prompt that fills the context, or holds a token
  id outside ``[0, vocab_size)``, finishes at once with ``error`` set; the engine goes on.
* token ids and logprobs from a 64-bit hash of (seed, request id, position): deterministic,
  identical after a migration, ids in ``[0, vocab_size)``, logprobs ``log(u)`` with u uniform in
  (0, 1) (mean -1). A token among the request's ``stop_token_ids`` ends it there (``"stop"``),
  as in vLLM: with a small ``vocab_size`` that makes multi-turn episodes of random lengths.

The step loop (one task, started by :meth:`start`, cancelled by :meth:`close`), each iteration:

1. **admit** waiting requests first-come-first-served while ``max_num_seqs`` allows and the KV
   cache has room for the request's held tokens plus ``admission_reserve_tokens`` of headroom
   (into an empty engine: its held tokens plus one). The head of the queue blocks the rest, as in
   vLLM.
2. **preempt**: the step adds one token per running sequence; while that would overflow the
   capacity, the newest running sequence goes back to the *front* of the queue, keeping its
   tokens and freeing its KV (vLLM's recompute preemption: it is re-prefilled on readmission).
3. **sleep** ``cost.step_time(batch, context) + cost.prefill_time(prefill)`` on the clock, where
   context = KV tokens held by the batch at the start of the step and prefill = held tokens of
   sequences admitted (or readmitted) into this step. Requests arriving meanwhile join at the next
   step boundary.
4. **decode**: each sequence still running gets one token; one ``_emit`` carries the whole step.

With ``chunk_steps`` k > 1 (the simulator's setting) steps 3 and 4 cover up to k steps at once,
as long as nothing would change in between: no more steps than the batch's shortest remaining
sequence needs, nor than the free KV cache holds at one token per sequence per step. The sleep is
the sum of the k steps' times (the context term grows by the batch size each step: an arithmetic
series) and each sequence gets k tokens in one output. The tokens, the finish times and the KV
use at chunk boundaries are those of k single steps; what differs is that a request arriving
mid-chunk is admitted at the chunk's end instead of the next step, and an abort mid-chunk loses
the chunk's tokens. One event per chunk instead of per step is what lets a cluster of tens of
rollouts run minutes of cluster time in seconds (``laminar simulate run``).

With ``tools`` set (:class:`~.configs.ToolCalls`, multi-turn episodes), a sequence reaching one
of its tool calls (positions and latencies drawn from its request id) leaves the batch after the
step, its KV released; when the latency has passed it queues again with the tool's output added
to its context (prefilled on readmission). An idle engine with calls out waits for the first to
return. Chunks end at the batch's next call and near the first return.

KV use = tokens held (prompt + generated of every running sequence) / ``kv_capacity_tokens``; it
never exceeds 1. When there is nothing to do the loop waits on an event — no polling, which under
the virtual clock would burn virtual time. All time goes through the injected :class:`Clock`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import heapq
import itertools
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import structlog

from laminar.runtime.clock import Clock, get_clock

from ..trajectory import FinishReason, SamplingParams
from ..weights.manifest import WeightManifest
from .base import Engine, EngineError, EngineOutput, EngineStats
from .configs import SimEngineConfig

__all__ = ["SimEngine"]

log = structlog.get_logger("laminar.engines.sim")

_M64 = (1 << 64) - 1
_INV_2_32 = 1.0 / (1 << 32)


def _hash64(text: str) -> int:
    """A stable 64-bit hash (Python's ``hash`` is salted per process)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _mix64(x: int) -> int:
    """splitmix64's finaliser: consecutive inputs give independent-looking 64-bit outputs."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


@dataclass(slots=True, eq=False)
class _Seq:
    """One submission as the scheduler sees it."""

    backend_id: str
    key: int  # hash of (seed, request id): drives token ids and logprobs
    position: int  # index in the response of the next token (continues across migrations)
    held: int  # KV tokens held while running: prompt (incl. earlier tokens) + generated here
    remaining: int  # tokens still to generate in this submission
    finish_reason: FinishReason
    needs_prefill: bool = True  # set at submission and by preemption
    calls: list[tuple[int, float]] = field(default_factory=list)  # (position, latency) ahead
    stops: frozenset[int] = frozenset()  # token ids that end it (``stop_token_ids``)


class SimEngine(Engine):
    """A model-free engine under the injectable clock; see the module docstring."""

    backend: ClassVar[str] = "sim"

    def __init__(self, config: SimEngineConfig, *, clock: Clock | None = None) -> None:
        super().__init__()
        self.config = config
        self._clock = clock
        self._running: dict[str, _Seq] = {}  # by backend id, in admission order (newest last)
        self._waiting: deque[_Seq] = deque()
        self._paused: list[tuple[float, int, _Seq]] = []  # in a tool call: (resume at, n, seq)
        self._pause_order = itertools.count()
        self._kv_held = 0
        self._last_batch = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.steps = 0
        self.preemptions = 0
        self.prefill_tokens = 0  # prompt tokens prefilled, re-prefills after preemption included
        self.tool_calls_made = 0
        self.max_model_len = config.kv_capacity_tokens  # what the KV cache could ever hold
        self.vocab_size = config.vocab_size

    @property
    def clock(self) -> Clock:
        """The injected clock, else the running loop's (virtual inside a VirtualTimeLoop)."""
        return self._clock if self._clock is not None else get_clock()

    def response_length(self, request_id: str) -> int:
        """The total response length drawn for ``request_id`` (before any clipping)."""
        rng = np.random.default_rng([self.config.seed, _hash64(request_id)])
        return int(self.config.lengths.sample(rng, 1)[0])

    def tool_calls(self, request_id: str, start: int, end: int) -> list[tuple[int, float]]:
        """The tool calls of ``request_id`` between positions ``start`` and ``end`` (exclusive):
        (position, latency), drawn from the request id like its length, so a sequence continued
        elsewhere makes the same calls."""
        tools = self.config.tools
        if tools is None:
            return []
        full = self.response_length(request_id)
        rng = np.random.default_rng([self.config.seed, _hash64(request_id), 7])
        n = int(rng.integers(0, tools.max_calls + 1))
        latencies = rng.lognormal(math.log(tools.latency_median_s), tools.latency_sigma, n)
        points = [round(full * (i + 1) / (n + 1)) for i in range(n)]
        return [
            (p, min(float(t), tools.latency_max_s))
            for p, t in zip(points, latencies, strict=True)
            if start < p < end
        ]

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the step loop. Requests added before this wait in the queue."""
        if self._task is None:
            self._clock = self.clock  # pin the loop's clock now that a loop is running
            self._task = asyncio.create_task(self._step_loop(), name="sim-engine-steps")
            self._task.add_done_callback(_report_crash)

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait([task])
        self._running.clear()
        self._waiting.clear()
        self._paused.clear()
        self._kv_held = 0
        self._last_batch = 0

    # -- backend hooks -----------------------------------------------------------------------

    async def _submit(self, backend_id: str, prompt: list[int], params: SamplingParams) -> None:
        cfg = self.config
        room = cfg.kv_capacity_tokens - len(prompt)
        if room < 1:  # never: add_request refuses these, and an import that fills it finishes
            raise EngineError(
                f"a prompt of {len(prompt)} tokens leaves no room in a KV cache of "
                f"{cfg.kv_capacity_tokens} tokens"
            )
        record = self._by_backend_id.get(backend_id)
        request_id = record.request_id if record else backend_id.rpartition("@")[0]
        produced = len(record.tokens) if record else 0  # > 0 for an imported sequence
        want = max(1, self.response_length(request_id) - produced)
        budget = min(params.max_tokens, room)
        reason: FinishReason = "length" if want >= budget else "stop"
        remaining = min(want, budget)
        key = _hash64(f"{cfg.seed}:{request_id}")
        seq = _Seq(backend_id, key, produced, len(prompt), remaining, reason)
        seq.stops = frozenset(params.stop_token_ids)
        seq.calls = self.tool_calls(request_id, produced, produced + remaining)
        self._waiting.append(seq)
        self._wake.set()

    async def _cancel(self, backend_id: str) -> None:
        seq = self._running.pop(backend_id, None)
        if seq is not None:
            self._kv_held -= seq.held
            return
        for seq in self._waiting:
            if seq.backend_id == backend_id:
                self._waiting.remove(seq)
                return
        for i, (_, _, seq) in enumerate(self._paused):
            if seq.backend_id == backend_id:
                self._paused.pop(i)
                heapq.heapify(self._paused)
                return

    async def _load_shared(self, segment: str, manifest: WeightManifest) -> None:
        """Mapped and verified as by every backend; with no model to hand tensors to, no tensors
        are made (a sim rollout never pays torch's import, seconds of CPU at its first
        version)."""
        await self._map_verified(segment, manifest)
        await self._load_weights(())

    async def _load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        for _ in weights:  # drain: a streaming producer (the relay) sees its weights consumed
            pass
        if self.config.load_time_s > 0:
            await self.clock.sleep(self.config.load_time_s)

    def stats(self) -> EngineStats:
        return EngineStats(
            kv_cache_usage=self._kv_held / self.config.kv_capacity_tokens,
            running=len(self._running),
            waiting=len(self._waiting),
            decode_batch_size=self._last_batch,
            weight_version=self.version,
            generated_tokens=self.generated_tokens,
        )

    # -- the step loop -----------------------------------------------------------------------

    async def _step_loop(self) -> None:
        clock = self.clock
        cost = self.config.cost
        while True:
            self._unpause(clock.time())
            self._admit()
            self._preempt()
            if not self._running:  # idle (or, defensively, nothing admissible): wait, no polling
                self._last_batch = 0
                self._wake.clear()
                if not self._paused:
                    await self._wake.wait()
                    continue
                with contextlib.suppress(TimeoutError):  # until a tool call returns
                    async with asyncio.timeout(self._paused[0][0] - clock.time()):
                        await self._wake.wait()
                continue
            batch = list(self._running.values())
            prefill = 0
            for seq in batch:
                if seq.needs_prefill:
                    prefill += seq.held
                    seq.needs_prefill = False
            self._last_batch = size = len(batch)
            self.prefill_tokens += prefill
            k = self._chunk(batch)
            context = k * self._kv_held + size * k * (k - 1) // 2  # summed over the k steps
            seconds = k * cost.batch_time(size) + cost.context_s_per_token * context
            seconds += cost.prefill_time(prefill)
            await clock.sleep(seconds)
            self.steps += k
            self._emit(self._decode(batch, k, clock.time()))

    def _unpause(self, now: float) -> None:
        """Sequences whose tool call has returned queue again (their context to prefill)."""
        while self._paused and self._paused[0][0] <= now:
            _, _, seq = heapq.heappop(self._paused)
            self._waiting.append(seq)

    def _chunk(self, batch: list[_Seq]) -> int:
        """Steps to take as one event (module docstring): >= 1, since after :meth:`_preempt` the
        cache holds one more token per running sequence. A chunk ends at the batch's next tool
        call, and near the time the first tool call returns."""
        k = self.config.chunk_steps
        if k == 1:
            return 1
        room = (self.config.kv_capacity_tokens - self._kv_held) // len(batch)
        k = min(k, room, min(seq.remaining for seq in batch))
        for seq in batch:
            if seq.calls:
                k = min(k, seq.calls[0][0] - seq.position)
        if self._paused:
            step = self.config.cost.batch_time(len(batch))
            k = min(k, int((self._paused[0][0] - self.clock.time()) / step) + 1)
        return max(1, k)

    def _admit(self) -> None:
        cfg = self.config
        while self._waiting and len(self._running) < cfg.max_num_seqs:
            seq = self._waiting[0]
            headroom = max(1, cfg.admission_reserve_tokens) if self._running else 1
            if self._kv_held + seq.held + headroom > cfg.kv_capacity_tokens:
                break  # first come, first served: the head blocks the queue
            self._waiting.popleft()
            self._running[seq.backend_id] = seq
            self._kv_held += seq.held

    def _preempt(self) -> None:
        # A lone sequence always fits (held + 1 <= capacity, by the clip in _submit), so this
        # never empties the running set.
        while self._kv_held + len(self._running) > self.config.kv_capacity_tokens:
            _, seq = self._running.popitem()  # the newest
            self._kv_held -= seq.held
            seq.needs_prefill = True
            self._waiting.appendleft(seq)
            self.preemptions += 1

    def _decode(self, batch: list[_Seq], k: int = 1, now: float = 0.0) -> list[EngineOutput]:
        """``k`` tokens for each sequence of ``batch`` still running (k <= its remaining); one
        that reaches a tool call leaves for it (``ToolCalls``)."""
        vocab = self.config.vocab_size
        running = self._running
        outputs = []
        for seq in batch:
            if running.get(seq.backend_id) is not seq:  # cancelled during the step
                continue
            tokens, logprobs = [], []
            n = k  # this sequence's tokens this step (fewer if it writes a stop token)
            for position in range(seq.position, seq.position + k):
                x = _mix64((seq.key + position) & _M64)
                tokens.append((x >> 32) % vocab)
                logprobs.append(math.log(((x & 0xFFFFFFFF) + 0.5) * _INV_2_32))
                if tokens[-1] in seq.stops:  # a stop token ends it here, as in vLLM
                    n = len(tokens)
                    seq.remaining, seq.finish_reason = n, "stop"
                    break
            seq.position += n
            seq.held += n
            seq.remaining -= n
            if seq.remaining > 0:
                self._kv_held += n
                outputs.append(EngineOutput(seq.backend_id, tokens, logprobs))
                if seq.calls and seq.position >= seq.calls[0][0]:
                    self._call_tool(seq, now)
            else:
                del running[seq.backend_id]
                self._kv_held -= seq.held - n
                outputs.append(
                    EngineOutput(seq.backend_id, tokens, logprobs, True, seq.finish_reason)
                )
        return outputs

    def _call_tool(self, seq: _Seq, now: float) -> None:
        """``seq`` ends its turn: out of the batch, KV released, back after the tool's latency
        with the tool's output in its context."""
        _, latency = seq.calls.pop(0)
        tools = self.config.tools
        assert tools is not None
        del self._running[seq.backend_id]
        self._kv_held -= seq.held
        capacity = self.config.kv_capacity_tokens
        seq.held = min(seq.held + tools.output_tokens, capacity - 1)
        if seq.remaining > capacity - seq.held:  # the output filled the context: cut, as vLLM
            seq.remaining, seq.finish_reason = capacity - seq.held, "length"
            seq.calls = [c for c in seq.calls if c[0] < seq.position + seq.remaining]
        seq.needs_prefill = True
        self.tool_calls_made += 1
        heapq.heappush(self._paused, (now + latency, next(self._pause_order), seq))


def _report_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("sim engine step loop failed", exc_info=task.exception())
