"""Methods Laminar adds to every vLLM worker (vLLM's ``worker_extension_cls`` hook).

vLLM runs the model in a worker process behind its engine core; the only way in is
``collective_rpc(method_name, ...)``, which calls a method of the worker. vLLM mixes this class
into its worker class, so ``self`` here is the worker (``self.model_runner`` is vLLM's). Arguments
cross vLLM's msgpack channel, which turns nested tensors into lists; so each tensor travels as
``(name, dtype, shape, raw bytes)`` and is rebuilt here without a copy (``torch.frombuffer``).

vLLM imports this module by dotted name inside its worker process; Laminar modules are imported
inside the methods that need them, so loading the extension stays cheap.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import torch


class LaminarWorkerExtension:
    model_runner: Any

    def laminar_load_weights(self, packed: Iterable[tuple[str, str, list[int], bytes]]) -> int:
        """Reload the model in place from HF-named tensors; returns how many were given."""
        items = [(name, unpack_tensor(dtype, shape, raw)) for name, dtype, shape, raw in packed]
        self.model_runner.reload_weights(weights_iterator=iter(items))
        return len(items)

    def laminar_load_shared(self, segment: str, manifest: dict[str, Any]) -> str:
        """Reload from a relay's shared-memory segment, mapped here: the bytes cross no socket.

        Every tensor's CRC is checked before loading. Returns "" once loaded, else why nothing
        was loaded (the segment was evicted meanwhile, or its bytes are corrupt).
        """
        from laminar.transport.shm import SegmentGone
        from laminar.weights.manifest import WeightManifest
        from laminar.weights.tensors import CorruptVersion, map_verified, tensors_from

        version = WeightManifest.model_validate(manifest)
        try:
            view = map_verified(segment, version)
        except (SegmentGone, CorruptVersion) as exc:
            return str(exc)
        self.model_runner.reload_weights(weights_iterator=tensors_from(version, view))
        return ""

    def laminar_export_kv(self, request_ids: list[str], limits: list[int]) -> list[Any]:
        """KV rows of live requests: per id ``(layout, bytes)``, or None where not exportable.

        ``limits[i]`` caps the tokens exported for ``request_ids[i]`` (what the client has seen).
        Runs between engine steps; see :mod:`laminar.engines.vllm_kv`.
        """
        from laminar.engines.vllm_kv import describe, export_blocks

        runner = self.model_runner
        try:
            base = describe(runner)
        except ValueError:  # a cache layout we cannot slice by block: the importer re-prefills
            return [None] * len(request_ids)
        # vLLM appends "-<8 random chars>" to the ids it is given (unless told not to)
        internal = {rid.rsplit("-", 1)[0]: rid for rid in runner.requests}
        internal.update({rid: rid for rid in runner.requests})
        out: list[Any] = []
        for request_id, limit in zip(request_ids, limits, strict=True):
            rid = internal.get(request_id, request_id)
            state = runner.requests.get(rid)
            if state is None or rid not in runner.input_batch.req_id_to_index:
                out.append(None)  # finished, preempted or not yet scheduled
                continue
            tokens = min(int(state.num_computed_tokens), int(limit))
            blocks = -(-tokens // base["block_size"])
            if tokens <= 0 or len(state.block_ids) != 1 or len(state.block_ids[0]) < blocks:
                out.append(None)
                continue
            layout = dict(base, tokens=tokens, blocks=blocks)
            out.append((layout, export_blocks(runner, list(state.block_ids[0][:blocks]))))
        return out

    def laminar_stage_kv(self, key: str, layout: dict[str, Any], data: bytes) -> str:
        """Keep an imported state until the connector loads it; "" if accepted, else why not."""
        from laminar.engines import vllm_kv

        try:
            mine = vllm_kv.describe(self.model_runner)
        except ValueError as exc:
            return str(exc)
        for field in ("block_size", "layers", "row_bytes", "dtype"):
            if layout.get(field) != mine[field]:
                return f"KV layout differs in {field}: {layout.get(field)} != {mine[field]}"
        if len(data) != layout["blocks"] * sum(mine["row_bytes"]):
            return f"KV state has {len(data)} bytes, its layout says otherwise"
        vllm_kv.STAGED[key] = (layout, data)
        return ""

    def laminar_drop_kv(self, key: str) -> bool:
        from laminar.engines import vllm_kv

        return vllm_kv.STAGED.pop(key, None) is not None

    def laminar_kv_loaded(self) -> dict[str, int]:
        """Tokens / requests whose KV the connector loaded instead of computing (since start)."""
        from laminar.engines import vllm_kv

        return dict(vllm_kv.LOADED)

    def laminar_weight_digest(self) -> str:
        """sha256 over the model's parameters (names sorted), for tests that compare engines."""
        digest = hashlib.sha256()
        model = self.model_runner.get_model()
        for name, param in sorted(model.named_parameters()):
            digest.update(name.encode())
            digest.update(param.detach().float().contiguous().cpu().numpy().tobytes())
        return digest.hexdigest()


def pack_tensor(name: str, tensor: torch.Tensor) -> tuple[str, str, list[int], bytes]:
    t = tensor.detach().contiguous().cpu()
    raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return name, str(t.dtype).removeprefix("torch."), list(t.shape), raw


def unpack_tensor(dtype: str, shape: list[int], raw: bytes) -> torch.Tensor:
    torch_dtype = getattr(torch, dtype)
    if not raw:
        return torch.empty(shape, dtype=torch_dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch_dtype).reshape(shape)
