"""KV migration for the ``vllm`` backend: export a sequence's KV state, stage one to import.

The half of :class:`laminar.engines.vllm_engine.VllmEngine` that moves KV state, kept apart so
that the engine module reads as "run vLLM" and this one as "move its cache". What crosses which
boundary, and why:

* **Export**: every tensor-parallel worker writes its shard of each sequence's blocks into a
  shared-memory segment it owns and answers with only the segment's name and offsets
  (:mod:`laminar.engines.vllm_worker`); this process maps the segments, the KV state's blobs are
  views of them, and the workers unlink the names. No KV byte crosses vLLM's msgpack RPC.
* **Import**: the shards go into one segment, each rank maps only its own slice
  (``laminar_stage_kv``), and the request is submitted with the staged key in its
  ``kv_transfer_params`` (:mod:`laminar.engines.vllm_kv`, the connector).
* **Refusals**: a state of another model, another TP size or layout, or one whose shard cannot be
  mapped here (a worker on another host) is re-prefilled instead, with the reason logged once and
  counted in ``kv_fallbacks``.
"""

from __future__ import annotations

import collections
import uuid
from typing import Any, ClassVar, cast

import structlog

from ..trajectory import SamplingParams
from ..transport import Blob
from .base import KvState, _Record
from .configs import VllmEngineConfig

log = structlog.get_logger("laminar.engines.vllm")


def _ref(item: Any) -> bool:
    """Whether a worker's export answer for one request is a state (``(layout, shm ref)``)."""
    return isinstance(item, (list, tuple)) and bool(item[1][2])


def _segment_bytes(results: list[list[Any]], name: str) -> int:
    """How much of export segment ``name`` the answers refer to."""
    return max(
        item[1][1] + item[1][2]
        for answers in results
        for item in answers
        if _ref(item) and item[1][0] == name
    )


class VllmKvMigration:
    """The engine's KV-migration methods (a mixin: they use its ``_llm`` and ``_submit``)."""

    backend: ClassVar[str]
    config: VllmEngineConfig
    _llm: Any
    _staged: dict[str, str]  # backend id -> key of a KV state staged in the worker
    kv_fallbacks: collections.Counter[str]

    async def _submit(
        self,
        backend_id: str,
        prompt: list[int],
        params: SamplingParams,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> None:
        raise NotImplementedError

    async def kv_loaded(self) -> dict[str, int]:
        """Tokens / requests whose KV the connector loaded rather than computed (since start)."""
        (loaded,) = await self._llm.collective_rpc("laminar_kv_loaded")
        return dict(loaded)

    async def _export_kv(self, records: list[_Record]) -> dict[str, KvState | None]:
        """Each record's KV state: one shard per TP rank (``data[r]``), read from the shared
        memory the workers wrote them to; None (re-prefill, the reason logged and counted)
        where a request or a rank could not export."""
        from ..transport.frames import FrameError
        from ..transport.shm import map_segment
        from .kv_layouts import merge_ranks

        ids = [r.backend_id for r in records]
        limits = [len(r.prompt) + len(r.tokens) for r in records]
        results = await self._llm.collective_rpc("laminar_export_kv", args=(ids, limits))
        segments = sorted({item[1][0] for answers in results for item in answers if _ref(item)})
        try:
            mapped: dict[str, memoryview | str] = {}
            for name in segments:
                try:
                    mapped[name] = map_segment(name, 0, _segment_bytes(results, name))
                except FrameError as exc:  # a worker on another host: not our shared memory
                    mapped[name] = f"KV shard not readable here: {exc}"
        finally:
            if segments:
                await self._llm.collective_rpc("laminar_release_kv", args=(segments,))
        out: dict[str, KvState | None] = {}
        for i, record in enumerate(records):
            merged = merge_ranks([answers[i] for answers in results])
            if merged is None or isinstance(merged, str):
                self._kv_fallback(record.request_id, merged or "not exportable now", "export")
                out[record.request_id] = None
                continue
            layout, order = merged
            shards = [results[rank][i][1] for rank in order]
            views = [mapped.get(name, "") for name, _, _ in shards]
            bad = next((v for v in views if isinstance(v, str)), None)
            if bad is not None:
                self._kv_fallback(record.request_id, bad, "export")
                out[record.request_id] = None
                continue
            data = [
                Blob(view[offset : offset + nbytes])
                for view, (_, offset, nbytes) in zip(views, shards, strict=True)
            ]
            described: dict[str, Any] = dict(layout, model=self.config.model)
            out[record.request_id] = KvState(
                backend=self.backend, tokens=int(described["tokens"]), layout=described, data=data
            )
        return out

    def _kv_fallback(self, request_id: str, reason: str, side: str) -> None:
        """A migrated sequence goes (or will go) through re-prefill: say why, once, and count."""
        self.kv_fallbacks[reason] += 1
        log.info("kv migration falls back to re-prefill", request_id=request_id, side=side,
                 reason=reason)  # fmt: skip

    async def _submit_with_kv(
        self, backend_id: str, prompt: list[int], params: SamplingParams, kv: KvState
    ) -> None:
        from ..transport.shm import SharedBuffer

        why = self._kv_refusal(kv)
        if why is not None:
            self._kv_fallback(backend_id, why, "import")
            await self._submit(backend_id, prompt, params)
            return
        key = f"{backend_id}#{uuid.uuid4().hex[:8]}"
        # The shards go through one shared-memory segment, each rank mapping its own slice: the
        # bytes never cross vLLM's RPC channel, and no rank receives another's shard.
        segment = SharedBuffer(max(kv.nbytes, 1))
        try:
            slices, offset = [], 0
            for blob in kv.data:
                segment.view[offset : offset + blob.nbytes] = blob.view
                slices.append((offset, blob.nbytes))
                offset += blob.nbytes
            refused = await self._llm.collective_rpc(
                "laminar_stage_kv", args=(key, kv.layout, segment.name, slices)
            )
        finally:
            segment.close()  # the ranks' mappings outlive the name
        why = next((r for r in refused if r), None)
        if why is not None:
            await self._llm.collective_rpc("laminar_drop_kv", args=(key,))  # ranks that took it
            self._kv_fallback(backend_id, why, "import")
            await self._submit(backend_id, prompt, params)  # layout mismatch: re-prefill
            return
        from .vllm_kv import PARAMS_KEY

        self._staged[backend_id] = key
        transfer = {PARAMS_KEY: key, "tokens": min(kv.tokens, len(prompt))}
        await self._submit(backend_id, prompt, params, kv_transfer_params=transfer)

    def _kv_refusal(self, kv: KvState) -> str | None:
        """Why this engine cannot take ``kv`` before asking its workers (they check the rest)."""
        if not self.config.kv_migration:
            return "kv_migration is off on this engine"
        if kv.layout.get("model") != self.config.model:
            theirs = kv.layout.get("model")
            return f"KV state of model {theirs}, this engine runs {self.config.model}"
        tp = int(cast("int | str", self.config.extra.get("tensor_parallel_size", 1)))
        if len(kv.data) != tp or int(kv.layout.get("tp_size", 1)) != tp:
            return f"KV state of {len(kv.data)} TP shards, this engine has {tp} TP ranks"
        return None
