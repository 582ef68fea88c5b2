"""KV-cache migration between vLLM engines: export a live request's KV blocks, import them.

Why: moving an in-flight sequence to another engine otherwise costs a re-prefill of its whole
prefix (prompt + response so far). With its KV cache carried along, the destination computes only
the tokens the state does not cover (at least the last one, whose logits it needs).

Mechanism, on the two sides of vLLM's process boundary:

* **Export** (worker RPC, no connector needed): ``LaminarWorkerExtension.laminar_export_kv`` runs
  in the worker between two engine steps. The worker's own per-request state
  (``model_runner.requests[id].block_ids`` / ``num_computed_tokens``) names the request's KV
  blocks; we copy those block rows of every attention layer into one contiguous ``bytes`` (the
  block-major rows of vLLM's per-layer cache tensor, whatever its inner layout) and return it
  through ``collective_rpc``. ``num_computed_tokens`` is the value at the start of the last step,
  so the state may lag the sequence by a token or two: the importer recomputes those.
* **Import** (a KV connector, :class:`LaminarKvConnector`, enabled by ``kv_migration``): the
  engine client first stages the bytes in the worker (``laminar_stage_kv``, keyed by a fresh
  key), then submits the request with ``kv_transfer_params={"laminar_kv": key, "tokens": n}``.
  In the scheduler, ``get_num_new_matched_tokens`` reports those ``n`` tokens (less whatever the
  local prefix cache already holds, and never the last prompt token) as externally computed, so
  vLLM allocates blocks and schedules only the rest. ``build_connector_meta`` sends the allocated
  block ids to the worker, whose ``start_load_kv`` copies the staged rows into them before the
  forward pass — a synchronous load, so no async-transfer bookkeeping.

Limits:

* Whole blocks travel. The last block may be partly filled: its tail slots hold whatever the
  source had there, which the destination overwrites when it computes those tokens before any
  attention reads them (a block is only hashed into the prefix cache once full and computed).
* Same model, dtype, block size and tensor-parallel layout on both sides (checked from
  ``layout``); otherwise the importer falls back to re-prefill.
* The bytes cross vLLM's msgpack RPC channel (one copy per hop). Fine for this repository's
  CPU/tiny-model scale; for large models a shared-memory segment would avoid the copies.
* A staged state whose request is aborted before it is scheduled is dropped on cancel.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

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

# Worker process: staged KV bytes by key (set by laminar_stage_kv, consumed by start_load_kv).
STAGED: dict[str, tuple[dict[str, Any], bytes]] = {}
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


def block_rows(kv: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """``kv`` as ``[num_blocks, bytes_per_block]`` (uint8), a view of the same storage.

    vLLM's paged caches are block-major per layer on CPU (``[B, H, N, 2C]``); a cache whose block
    dimension is not the outermost (e.g. ``[2, B, ...]``) or that is not contiguous is refused.
    """
    if kv.shape[0] % num_blocks or not kv.is_contiguous():
        raise ValueError(f"unsupported KV cache layout {tuple(kv.shape)} for {num_blocks} blocks")
    return kv.view(torch.uint8).view(num_blocks, -1)


def describe(model_runner: Any) -> dict[str, Any]:
    caches = layer_caches(model_runner)
    num_blocks = vllm_compat.num_blocks(model_runner)
    return {
        "block_size": vllm_compat.block_size(model_runner),
        "layers": list(caches),
        "row_bytes": [block_rows(t, num_blocks).shape[1] for t in caches.values()],
        "dtype": str(next(iter(caches.values())).dtype).removeprefix("torch."),
    }


def export_blocks(model_runner: Any, block_ids: list[int]) -> bytes:
    """The rows of ``block_ids`` of every layer, layer after layer, as one bytes object."""
    num_blocks = vllm_compat.num_blocks(model_runner)
    index = torch.tensor(block_ids, dtype=torch.long)
    parts = [
        block_rows(t, num_blocks).index_select(0, index).reshape(-1)
        for t in layer_caches(model_runner).values()
    ]
    return torch.cat(parts).numpy().tobytes() if parts else b""


def import_blocks(
    caches: dict[str, torch.Tensor],
    num_blocks: int,
    layout: dict[str, Any],
    data: bytes,
    first: int,
    block_ids: list[int],
) -> None:
    """Copy rows ``first .. first + len(block_ids)`` of the exported state into ``block_ids``."""
    src = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0)
    exported = layout["blocks"]
    offset = 0
    index = torch.tensor(block_ids, dtype=torch.long)
    for name, row in zip(layout["layers"], layout["row_bytes"], strict=True):
        rows = src[offset : offset + exported * row].view(exported, row)
        offset += exported * row
        dst = block_rows(caches[name], num_blocks)
        dst.index_copy_(0, index, rows[first : first + len(block_ids)])


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
                self._caches, self._num_blocks, layout, data, load.first_block, load.block_ids
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
