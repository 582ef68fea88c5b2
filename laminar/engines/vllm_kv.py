"""KV-cache migration between vLLM engines: export a live request's KV blocks, import them.

Why: moving an in-flight sequence to another engine otherwise costs a re-prefill of its whole
prefix (prompt + response so far). With its KV cache carried along, the destination computes only
the tokens the state does not cover (at least the last one, whose logits it needs).

Mechanism, on the two sides of vLLM's process boundary:

* **Export** (worker RPC, no connector needed): ``LaminarWorkerExtension.laminar_export_kv`` runs
  in every worker between two engine steps. The worker's own per-request state
  (``model_runner.requests[id].block_ids`` / ``num_computed_tokens``) names the request's KV
  blocks; we copy those blocks of every attention layer, in the layout-independent wire form of
  :mod:`laminar.engines.kv_layouts` (so CPU and GPU caches alike), into a shared-memory segment
  the worker owns, and return only its name and offsets through ``collective_rpc``. The engine
  maps the segment (its ``KvState`` blobs are views of that mapping), then tells the workers to
  unlink it. ``num_computed_tokens`` is the value at the start of the last step, so the state may
  lag the sequence by a token or two: the importer recomputes those.
* **Import** (a KV connector, :class:`LaminarKvConnector`, enabled by ``kv_migration``): the
  engine client writes the state's shards into one shared-memory segment and stages them in the
  workers (``laminar_stage_kv``, keyed by a fresh key: each rank maps its own shard), then
  submits the request with ``kv_transfer_params={"laminar_kv": key, "tokens": n}``.
  In the scheduler, ``get_num_new_matched_tokens`` reports those ``n`` tokens (less whatever the
  local prefix cache already holds, and never the last prompt token) as externally computed, so
  vLLM allocates blocks and schedules only the rest. ``build_connector_meta`` sends the allocated
  block ids to the worker, whose ``start_load_kv`` copies the staged rows into them before the
  forward pass — a synchronous load, so no async-transfer bookkeeping.

Tensor parallelism: each TP rank's cache holds its shard of the KV heads, and the scheduler is
one, so every rank exports the same blocks of its own shard; a state is one blob per rank, in
rank order (``layout["tp_size"]``). It imports only into an engine of the same TP size and
per-rank layout, rank r's shard into rank r.

Limits:

* Whole blocks travel. The last block may be partly filled: its tail slots hold whatever the
  source had there, which the destination overwrites when it computes those tokens before any
  attention reads them (a block is only hashed into the prefix cache once full and computed).
* Same model, dtype, block size, tensor-parallel size and per-rank layout on both sides (checked
  from ``layout``: :func:`laminar.engines.kv_layouts.refusal`); otherwise the importer falls back
  to re-prefill, logging why and counting it (``VllmEngine.kv_fallbacks``).
* KV bytes never cross vLLM's msgpack RPC; between rollouts they travel as the transport's raw
  frame buffers. The workers must share the rollout's host (``/dev/shm``), as vLLM's local
  executors do: a worker whose segment the engine cannot map exports nothing (re-prefill).
* A staged state whose request is aborted before it is scheduled is dropped on cancel.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

import laminar.engines.kv_layouts as kv_layouts
import laminar.engines.vllm_compat as vllm_compat  # not via the package: it leads back here

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

CONNECTOR = "LaminarKvConnector"
PARAMS_KEY = "laminar_kv"

# Worker process: staged KV bytes by key (set by laminar_stage_kv, consumed by start_load_kv):
# this rank's shard, a read-only mapping of the engine's shared-memory segment.
STAGED: dict[str, tuple[dict[str, Any], Any]] = {}
# Worker process: exported states' shared-memory segments, kept until the engine has mapped them
# (laminar_release_kv), by segment name.
EXPORTS: dict[str, Any] = {}
# Worker process: how many tokens' KV the connector loaded in total (an observable for tests).
LOADED = {"tokens": 0, "requests": 0}


def transfer_config() -> dict[str, Any]:
    """The ``kv_transfer_config`` engine argument that enables this connector."""
    return {
        "kv_connector": CONNECTOR,
        "kv_role": "kv_both",
        "kv_connector_module_path": __name__,
    }


# -- tensor access (worker process) ------------------------------------------------------------


def layer_caches(model_runner: Any) -> dict[str, torch.Tensor]:
    """Per-layer KV cache tensors, by layer name (one per distinct storage)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, kv in vllm_compat.layer_kv_caches(model_runner):
        if not isinstance(kv, torch.Tensor) or kv.data_ptr() in seen:
            continue
        seen.add(kv.data_ptr())
        out[name] = kv
    return out


def layer_layouts(
    caches: dict[str, torch.Tensor], num_blocks: int, block_size: int
) -> dict[str, kv_layouts.KvLayout]:
    """Each cache's layout (see :mod:`laminar.engines.kv_layouts`); ValueError for a cache whose
    layout is not known (the exporter then answers why, and the importer re-prefills)."""
    return {name: kv_layouts.detect(t.shape, num_blocks, block_size) for name, t in caches.items()}


def describe(model_runner: Any) -> dict[str, Any]:
    """This worker's KV layout as a migrated state carries it (:data:`kv_layouts.MUST_MATCH`):
    ``row_bytes`` are per layer of one block in the wire form, of this rank's KV heads."""
    caches = layer_caches(model_runner)
    if not caches:
        raise ValueError("this worker has no KV cache tensors")
    num_blocks = vllm_compat.num_blocks(model_runner)
    block_size = vllm_compat.block_size(model_runner)
    layouts = layer_layouts(caches, num_blocks, block_size)
    tp_rank, tp_size = vllm_compat.tensor_parallel()
    return {
        "block_size": block_size,
        "layers": list(caches),
        "row_bytes": [kv_layouts.block_bytes(t, layouts[n], num_blocks) for n, t in caches.items()],
        "dtype": str(next(iter(caches.values())).dtype).removeprefix("torch."),
        "wire": kv_layouts.WIRE_FORM,
        "tp_rank": tp_rank,
        "tp_size": tp_size,
    }


def export_blocks(model_runner: Any, block_ids: list[int]) -> torch.Tensor:
    """The wire-form rows of ``block_ids`` of every layer, layer after layer: one flat uint8
    host tensor (gathered on the cache's device, then one copy to the host)."""
    caches = layer_caches(model_runner)
    num_blocks = vllm_compat.num_blocks(model_runner)
    layouts = layer_layouts(caches, num_blocks, vllm_compat.block_size(model_runner))
    parts = [
        kv_layouts.gather(t, layouts[name], num_blocks, block_ids).reshape(-1)
        for name, t in caches.items()
    ]
    return torch.cat(parts).cpu() if parts else torch.empty(0, dtype=torch.uint8)


def import_blocks(
    caches: dict[str, torch.Tensor],
    num_blocks: int,
    block_size: int,
    layout: dict[str, Any],
    data: Any,
    first: int,
    block_ids: list[int],
) -> None:
    """Copy rows ``first .. first + len(block_ids)`` of the exported state (``data``: any buffer)
    into ``block_ids``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a read-only mapping: we only read it
        src = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0)
    exported = layout["blocks"]
    offset = 0
    layouts = layer_layouts({n: caches[n] for n in layout["layers"]}, num_blocks, block_size)
    for name, row in zip(layout["layers"], layout["row_bytes"], strict=True):
        rows = src[offset : offset + exported * row].view(exported, row)
        offset += exported * row
        chosen = rows[first : first + len(block_ids)]
        kv_layouts.scatter(caches[name], layouts[name], num_blocks, block_ids, chosen)


# -- the connector -----------------------------------------------------------------------------


@dataclass
class _Load:
    key: str
    block_ids: list[int]
    first_block: int  # index of block_ids[0] within the exported state
    tokens: int  # tokens loaded (for the counter)


@dataclass
class LaminarKvMetadata(KVConnectorMetadata):
    loads: list[_Load] = field(default_factory=list)


class LaminarKvConnector(KVConnectorBase_V1):
    """Loads staged KV rows for requests that carry ``kv_transfer_params["laminar_kv"]``."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._block_size = vllm_config.cache_config.block_size
        self._num_blocks = kv_cache_config.num_blocks if kv_cache_config is not None else 0
        # scheduler: request id -> (key, first token to load, end token)
        self._matched: dict[str, tuple[str, int, int]] = {}
        self._need_load: dict[str, tuple[str, int, int]] = {}
        self._caches: dict[str, torch.Tensor] = {}

    # scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        key = params.get(PARAMS_KEY)
        if not key:
            return 0, False
        # never the last token: vLLM must compute it to sample the next one
        end = min(int(params.get("tokens", 0)), request.num_tokens - 1)
        if end <= num_computed_tokens:
            self._matched.pop(request.request_id, None)
            return 0, False
        self._matched[request.request_id] = (key, num_computed_tokens, end)
        return end - num_computed_tokens, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        matched = self._matched.pop(request.request_id, None)
        if matched is not None and num_external_tokens > 0:
            key, start, _ = matched
            self._need_load[request.request_id] = (key, start, start + num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = LaminarKvMetadata()
        bs = self._block_size
        for new_req in scheduler_output.scheduled_new_reqs:
            load = self._need_load.pop(new_req.req_id, None)
            if load is None:
                continue
            key, start, end = load
            first, last = start // bs, -(-end // bs)
            meta.loads.append(
                _Load(key, list(new_req.block_ids[0][first:last]), first, end - start)
            )
        self._need_load.clear()  # a request not scheduled now will be matched again
        return meta

    # worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._caches = dict(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, LaminarKvMetadata)
        for load in meta.loads:
            staged = STAGED.pop(load.key, None)
            if staged is None:  # cannot happen unless the staging RPC was lost
                raise RuntimeError(f"no staged KV state {load.key!r}")
            layout, data = staged
            import_blocks(
                self._caches,
                self._num_blocks,
                self._block_size,
                layout,
                data,
                load.first_block,
                load.block_ids,
            )
            LOADED["tokens"] += load.tokens
            LOADED["requests"] += 1

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return

    def wait_for_save(self) -> None:
        return
