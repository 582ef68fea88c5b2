"""The engine interface: one contract for every generation backend (vLLM, sim).

Shape (after vLLM v1's engine clients): requests go in with :meth:`Engine.add_request`; *one*
multiplexed stream, :meth:`Engine.outputs`, yields each step's new tokens for every running
request; :meth:`Engine.stats` is cheap and synchronous. The rollout role is the only consumer.

What the base class owns, so that every backend behaves the same:

* the per-request record (prompt, params, tokens and logprobs produced so far), updated from the
  deltas a backend emits. ``abort`` and ``export_sequences`` answer from it, so their result is
  exactly what the output stream already delivered — never a token the caller did not see.
* the one-version rule: ``load_weights`` refuses while any request is in flight, and
  ``import_sequences`` refuses sequences of another version. A trajectory never mixes versions.
* refusing a request the model cannot take (an empty prompt, one of ``max_model_len`` tokens or
  more, token ids outside ``[0, vocab_size)``): one bad request must fail alone, never take the
  engine (and every other request in it) down. ``add_request`` does not raise for these: the
  request finishes at once on the output stream with ``error`` saying why and no tokens. A
  backend that learns of a refusal only after submitting (vLLM validates inside ``generate``)
  reports it the same way through :meth:`Engine._refuse`. An imported sequence that already fills
  the context finishes with ``"length"``, as it would have where it came from.
* resumption: an imported sequence continues under its own request id; the backend sees a new
  request whose prompt is the original prompt plus the tokens so far, with the remaining token
  budget. Without KV state the backend recomputes that prefix (re-prefill). With a
  :class:`KvState` exported by the same backend (``export_sequences(..., with_kv=True)``) it
  loads the prefix's KV cache instead and recomputes only what the state does not cover; a backend
  that cannot export KV returns ``kv=None`` and the importer re-prefills. Either way the tokens
  that follow are those the sequence would have produced without the move.

A backend implements the underscored hooks and calls :meth:`Engine._emit` with deltas.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel, Field

from laminar.runtime.errors import LaminarError
from laminar.runtime.executor import LOOP_DEFAULT, Executor

from ..trajectory import FinishReason, SamplingParams
from ..transport import Blob
from ..transport.shm import SegmentGone
from ..weights.manifest import WeightManifest
from ..weights.shared import CorruptVersion, map_verified


class EngineError(LaminarError):
    """A request the engine cannot take (duplicate id, wrong version, weights while busy)."""


class EngineRequest(BaseModel):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(slots=True)
class EngineOutput:
    """New tokens of one request since its last output. ``finished`` outputs are its last."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None  # set (with ``finished``, no tokens): the engine refused the request


class EngineStats(BaseModel):
    kv_cache_usage: float  # 0..1 of the KV-cache capacity in use
    running: int  # requests being decoded
    waiting: int  # requests queued for admission
    decode_batch_size: int  # sequences in the last decode step
    weight_version: int
    generated_tokens: int  # total since start


class KvState(BaseModel):
    """The KV cache of a sequence's first ``tokens`` tokens (prompt + response), as raw bytes.

    ``layout`` and the byte order of ``data`` are the exporting backend's own; only an engine of
    the same backend, model and version imports it. The bytes travel as raw frame buffers.
    """

    backend: str
    tokens: int
    layout: dict[str, Any] = Field(default_factory=dict)
    data: list[Blob] = Field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.data)


class InflightSequence(BaseModel):
    """An unfinished request as it leaves one engine for another (tokens, and maybe KV)."""

    request_id: str
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    response_logprobs: list[float]
    params: SamplingParams
    version: int
    kv: KvState | None = None  # None: the importer re-prefills


@dataclass(slots=True)
class _Record:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    backend_id: str = ""  # "{request_id}@{n}": unique per submission, so a late output of an
    # aborted submission can never be mistaken for one of its successor


class Engine(abc.ABC):
    """Base class of generation backends; see the module docstring."""

    backend: ClassVar[str] = "?"
    exports_kv: ClassVar[bool] = False  # export_sequences(with_kv=True) can attach KvState

    def __init__(self) -> None:
        self.version = 0
        self.generated_tokens = 0
        self.refused = 0  # requests refused (see the module docstring), since start
        # The model's limits, set by the backend (None: not checked here).
        self.max_model_len: int | None = None  # prompt + response tokens
        self.vocab_size: int | None = None  # prompt token ids must lie in [0, vocab_size)
        self._submissions = 0
        self._records: dict[str, _Record] = {}  # by request id
        self._by_backend_id: dict[str, _Record] = {}
        self._queue: asyncio.Queue[list[EngineOutput] | BaseException] = asyncio.Queue()
        # Where blocking weight work runs (mapping and checking a version's CRCs): the rollout
        # role sets its own (``ctx.executor``); left alone, the loop's default executor.
        self.executor: Executor = LOOP_DEFAULT

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Load the model / start the step loop. Called once, inside the running event loop."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Stop generating and free resources."""

    # -- requests ----------------------------------------------------------------------------

    async def add_request(self, request: EngineRequest) -> None:
        """Start a request. One the model cannot take finishes at once with ``error`` set."""
        if request.request_id in self._records:
            raise EngineError(f"request {request.request_id!r} is already running")
        why = self.refusal(request.prompt_token_ids)
        if why is not None:
            self._refused(request.request_id, why)
            return
        record = _Record(request.request_id, list(request.prompt_token_ids), request.params)
        await self._start_record(record)

    def refusal(self, prompt: list[int]) -> str | None:
        """Why this engine cannot take ``prompt`` (None: it can)."""
        if not prompt:
            return "the prompt is empty"
        if self.max_model_len is not None and len(prompt) >= self.max_model_len:
            return (
                f"the prompt has {len(prompt)} tokens: no room for a response within "
                f"max_model_len {self.max_model_len}"
            )
        if self.vocab_size is not None:
            low, high = min(prompt), max(prompt)
            if low < 0 or high >= self.vocab_size:
                bad = low if low < 0 else high
                return f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})"
        return None

    async def abort(self, request_id: str) -> InflightSequence | None:
        """Stop a request; return what it produced so far (None if it is not running)."""
        record = self._records.get(request_id)
        if record is None:
            return None
        await self._cancel(record.backend_id)
        self._forget(record)
        return self._snapshot(record)

    async def export_sequences(
        self, request_ids: Iterable[str], *, with_kv: bool = False
    ) -> list[InflightSequence]:
        """Take requests out of this engine (to continue elsewhere); unknown ids are skipped.

        ``with_kv``: also export each sequence's KV cache where the backend can (``exports_kv``);
        the state may cover fewer tokens than the sequence has (the importer recomputes the rest).
        """
        ids = [i for i in request_ids if i in self._records]
        kv: dict[str, KvState | None] = {}
        if with_kv and self.exports_kv and ids:
            kv = await self._export_kv([self._records[i] for i in ids])
        out = []
        for request_id in ids:
            seq = await self.abort(request_id)
            if seq is not None:
                seq.kv = kv.get(request_id)
                out.append(seq)
        return out

    async def import_sequences(self, sequences: Iterable[InflightSequence]) -> None:
        """Continue sequences exported elsewhere; their outputs resume under the same ids."""
        sequences = list(sequences)
        for seq in sequences:
            if seq.version != self.version:
                raise EngineError(
                    f"sequence {seq.request_id!r} was generated by version {seq.version}; "
                    f"this engine holds version {self.version}"
                )
            if seq.request_id in self._records:
                raise EngineError(f"request {seq.request_id!r} is already running")
            if len(seq.response_token_ids) != len(seq.response_logprobs):
                raise EngineError(f"sequence {seq.request_id!r}: tokens and logprobs differ")
            if seq.kv is not None and seq.kv.backend != self.backend:
                raise EngineError(
                    f"sequence {seq.request_id!r} carries {seq.kv.backend} KV state; "
                    f"this is a {self.backend} engine"
                )
        for seq in sequences:
            record = _Record(
                seq.request_id,
                list(seq.prompt_token_ids),
                seq.params,
                list(seq.response_token_ids),
                list(seq.response_logprobs),
            )
            await self._start_record(record, seq.kv)

    async def outputs(self) -> AsyncIterator[list[EngineOutput]]:
        """Every step's deltas, for all requests. One consumer. Raises if the engine failed."""
        while True:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item

    @property
    def in_flight(self) -> int:
        return len(self._records)

    def running_ids(self) -> list[str]:
        return list(self._records)

    # -- weights -----------------------------------------------------------------------------

    async def load_weights(self, version: int, weights: Iterable[tuple[str, Any]]) -> None:
        """Replace the weights in place with ``version`` (named tensors). Only when idle."""
        self._require_idle(version)
        await self._load_weights(weights)
        self.version = version

    async def load_shared(self, version: int, segment: str, manifest: WeightManifest) -> str:
        """Load ``version`` from a relay's shared-memory ``segment``; returns the verified digest.

        The bytes are checked against the manifest's CRCs before anything is loaded (a corrupt
        or stale segment raises :class:`EngineError` and the old weights stay). Backends whose
        model lives in another process override ``_load_shared`` to map the segment there, so the
        bytes never cross a socket.
        """
        self._require_idle(version)
        await self._load_shared(segment, manifest)
        self.version = version
        return manifest.digest()

    def _require_idle(self, version: int) -> None:
        if self._records:
            raise EngineError(
                f"cannot load version {version} with {len(self._records)} requests in flight: "
                "a trajectory must not mix versions"
            )

    async def _load_shared(self, segment: str, manifest: WeightManifest) -> None:
        """Default: map here, verify, and load the tensor views (no copy before the engine's)."""
        view = await self._map_verified(segment, manifest)
        from ..weights.tensors import tensors_from  # torch: only where tensors are loaded

        await self._load_weights(tensors_from(manifest, view))

    async def _map_verified(self, segment: str, manifest: WeightManifest) -> memoryview:
        """The segment mapped here, every tensor's bytes checked against the manifest."""
        try:
            return await self.executor.run(map_verified, segment, manifest)
        except (SegmentGone, CorruptVersion) as exc:
            raise EngineError(str(exc)) from exc

    # -- stats -------------------------------------------------------------------------------

    @abc.abstractmethod
    def stats(self) -> EngineStats: ...

    # -- backend hooks -----------------------------------------------------------------------

    @abc.abstractmethod
    async def _submit(self, backend_id: str, prompt: list[int], params: SamplingParams) -> None:
        """Start generating ``params.max_tokens`` tokens after ``prompt``."""

    async def _submit_with_kv(
        self, backend_id: str, prompt: list[int], params: SamplingParams, kv: KvState
    ) -> None:
        """Like ``_submit``, with the KV of ``prompt[:kv.tokens]`` given. Default: re-prefill."""
        await self._submit(backend_id, prompt, params)

    async def _export_kv(self, records: list[_Record]) -> dict[str, KvState | None]:
        """The KV state of live requests, by request id (backends with ``exports_kv``)."""
        return {}

    @abc.abstractmethod
    async def _cancel(self, backend_id: str) -> None:
        """Stop a request; emitting nothing more for it."""

    @abc.abstractmethod
    async def _load_weights(self, weights: Iterable[tuple[str, Any]]) -> None: ...

    def _emit(self, outputs: Iterable[EngineOutput]) -> None:
        """Called by the backend with deltas keyed by backend id. Updates records, publishes."""
        batch = []
        for out in outputs:
            record = self._by_backend_id.get(out.request_id)
            if record is None:  # aborted or exported meanwhile
                continue
            record.tokens += out.token_ids
            record.logprobs += out.logprobs
            self.generated_tokens += len(out.token_ids)
            if out.finished:
                self._forget(record)
            out.request_id = record.request_id
            batch.append(out)
        if batch:
            self._queue.put_nowait(batch)

    def _fail(self, error: BaseException) -> None:
        """Called by the backend when it cannot go on: the output stream raises ``error``."""
        self._queue.put_nowait(error)

    def _refuse(self, backend_id: str, why: str) -> None:
        """Called by the backend when it refused one submitted request: it fails alone."""
        record = self._by_backend_id.get(backend_id)
        if record is None:  # aborted or exported meanwhile
            return
        self._forget(record)
        self._refused(record.request_id, why)

    def _refused(self, request_id: str, why: str) -> None:
        self.refused += 1
        self._queue.put_nowait(
            [EngineOutput(request_id, [], [], finished=True, finish_reason=None, error=why)]
        )

    # -- internals ---------------------------------------------------------------------------

    async def _start_record(self, record: _Record, kv: KvState | None = None) -> None:
        remaining = record.params.max_tokens - len(record.tokens)
        held = len(record.prompt) + len(record.tokens)
        full = self.max_model_len is not None and held >= self.max_model_len
        if remaining <= 0 or full:  # an imported sequence that had used its budget or context
            self._queue.put_nowait(
                [EngineOutput(record.request_id, [], [], finished=True, finish_reason="length")]
            )
            return
        self._submissions += 1
        record.backend_id = f"{record.request_id}@{self._submissions}"
        self._records[record.request_id] = record
        self._by_backend_id[record.backend_id] = record
        params = record.params.model_copy(update={"max_tokens": remaining})
        prompt = record.prompt + record.tokens
        try:
            if kv is not None and 0 < kv.tokens <= len(prompt):
                await self._submit_with_kv(record.backend_id, prompt, params, kv)
            else:
                await self._submit(record.backend_id, prompt, params)
        except BaseException:
            self._forget(record)
            raise

    def _forget(self, record: _Record) -> None:
        self._records.pop(record.request_id, None)
        self._by_backend_id.pop(record.backend_id, None)

    def _snapshot(self, record: _Record) -> InflightSequence:
        return InflightSequence(
            request_id=record.request_id,
            prompt_token_ids=record.prompt,
            response_token_ids=record.tokens,
            response_logprobs=record.logprobs,
            params=record.params,
            version=self.version,
        )
