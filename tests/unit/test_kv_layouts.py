"""KV blocks move between paged-cache layouts with the same per-token K and V (CPU, synthetic).

Each layout's cache is written and read here by its own definition (which axis is the block,
the head, the slot, K/V), independently of ``laminar.engines.kv_layouts``, so a block gathered
from one layout and scattered into another is checked token by token. The GPU layouts are
plain strided tensors: nothing here needs a GPU.
"""

from __future__ import annotations

import pytest
import torch

from laminar.engines import kv_layouts as kl

B, N, H, D = 5, 8, 2, 4  # blocks, block size, KV heads, head size
DTYPE = torch.bfloat16


def reference(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as [block, token, head, dim]."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, N, H, D, generator=g).to(DTYPE)
    v = torch.randn(B, N, H, D, generator=g).to(DTYPE)
    return k, v


# Each case: a layout, a writer (K, V) -> cache, a reader cache -> (K, V). The writers build the
# physical tensors vLLM allocates and return the per-layer view vLLM hands the model.


def _lbhnc(k, v):  # vLLM 0.32 on CPU: contiguous [B, H, N, 2D]
    return torch.cat([k, v], -1).permute(0, 2, 1, 3).contiguous()


def _lbnhc(k, v):  # vLLM 0.32 CUDA default: physical [B, N, H, 2D], logical view [B, H, N, 2D]
    return torch.cat([k, v], -1).contiguous().permute(0, 2, 1, 3)


def _blhnc(k, v):  # block-outermost across 3 layers: physical [B, L, H, N, 2D], this layer 1
    phys = torch.zeros(B, 3, H, N, 2 * D, dtype=DTYPE)
    phys[:, 1] = _lbhnc(k, v)
    return phys[:, 1]


def _split2(k, v):  # kernel blocks of N/2 slots: [2B, H, N/2, 2D], block b = rows 2b, 2b+1
    return _lbhnc(k, v).unflatten(2, (2, N // 2)).transpose(1, 2).reshape(2 * B, H, N // 2, -1)


def _vllm_read(cache):
    if cache.shape[0] == 2 * B:  # kernel split
        cache = cache.unflatten(0, (B, 2)).transpose(1, 2).reshape(B, H, N, -1)
    kv = cache.permute(0, 2, 1, 3)  # [B, N, H, 2D]
    return kv[..., :D], kv[..., D:]


CASES = {
    "LBHNC": (kl.VLLM_BHNC, _lbhnc, _vllm_read),
    "LBNHC": (kl.VLLM_BHNC, _lbnhc, _vllm_read),
    "BLHNC": (kl.VLLM_BHNC, _blhnc, _vllm_read),
    "kernel-split": (kl.VLLM_BHNC, _split2, _vllm_read),
    "flash-attn-5d": (
        kl.FLASH_ATTN_5D,
        lambda k, v: torch.stack([k, v]),
        lambda c: (c[0], c[1]),
    ),
    "flashinfer-nhd": (
        kl.FLASHINFER_NHD,
        lambda k, v: torch.stack([k, v], 1),
        lambda c: (c[:, 0], c[:, 1]),
    ),
    "flashinfer-hnd": (
        kl.FLASHINFER_HND,
        lambda k, v: torch.stack([k, v], 1).transpose(2, 3).contiguous(),
        lambda c: (c[:, 0].transpose(1, 2), c[:, 1].transpose(1, 2)),
    ),
}


def _empty_like_case(name: str) -> torch.Tensor:
    _, write, _ = CASES[name]
    zeros = torch.zeros(B, N, H, D, dtype=DTYPE)
    return write(zeros, zeros)


@pytest.mark.parametrize("name", list(CASES))
def test_a_block_round_trips_within_a_layout(name):
    layout, write, read = CASES[name]
    k, v = reference()
    rows = kl.gather(write(k, v), layout, B, [3, 1])
    dest = _empty_like_case(name)
    kl.scatter(dest, layout, B, [0, 4], rows)
    dk, dv = read(dest)
    assert torch.equal(dk[0], k[3]) and torch.equal(dv[0], v[3])
    assert torch.equal(dk[4], k[1]) and torch.equal(dv[4], v[1])
    # the other blocks are untouched (a strided view wrote only where it should)
    assert not dk[1:4].any() and not dv[1:4].any()


@pytest.mark.parametrize("src", list(CASES))
@pytest.mark.parametrize("dst", list(CASES))
def test_a_block_moved_across_layouts_keeps_every_tokens_k_and_v(src, dst):
    k, v = reference(seed=1)
    src_layout, write, _ = CASES[src]
    dst_layout, _, read = CASES[dst]
    rows = kl.gather(write(k, v), src_layout, B, [2, 0, 4])
    dest = _empty_like_case(dst)
    kl.scatter(dest, dst_layout, B, [1, 2, 3], rows)
    dk, dv = read(dest)
    for got, want in ((1, 2), (2, 0), (3, 4)):
        assert torch.equal(dk[got], k[want]), (src, dst, got)
        assert torch.equal(dv[got], v[want]), (src, dst, got)


def test_the_wire_form_is_the_cpu_caches_block_rows_byte_for_byte():
    # what KV migration moved before layouts were generic: the raw rows of a contiguous cache
    k, v = reference(seed=2)
    cache = _lbhnc(k, v)
    raw_rows = cache.view(torch.uint8).view(B, -1)
    got = kl.gather(cache, kl.VLLM_BHNC, B, [4, 0, 2])
    assert torch.equal(got, raw_rows[[4, 0, 2]])
    assert kl.block_bytes(cache, kl.VLLM_BHNC, B) == raw_rows.shape[1]


@pytest.mark.parametrize("name", list(CASES))
def test_each_layout_is_detected_from_its_shape(name):
    layout, write, _ = CASES[name]
    k, v = reference()
    assert kl.detect(write(k, v).shape, B, N) is layout


def test_detect_refuses_unknown_and_ambiguous_shapes():
    with pytest.raises(ValueError, match="no known layout"):
        kl.detect((B, 3, N, H, D), B, N)  # a "kv" axis of 3
    with pytest.raises(ValueError, match="no known layout"):
        kl.detect((B, H, N, 2 * D), B, 2 * N)  # slots do not add up to the block size
    # FlashInfer with as many heads as slots: NHD or HND cannot be told from the shape
    with pytest.raises(ValueError, match="ambiguous"):
        kl.detect((B, 2, N, N, D), B, N)


def test_scatter_refuses_rows_of_the_wrong_size():
    cache = _empty_like_case("LBHNC")
    rows = kl.gather(cache, kl.VLLM_BHNC, B, [0])
    with pytest.raises(ValueError, match="do not fit"):
        kl.scatter(cache, kl.VLLM_BHNC, B, [0, 1], rows)
    with pytest.raises(ValueError, match="do not fit"):
        kl.scatter(cache, kl.VLLM_BHNC, B, [0], rows.view(torch.int8))


def test_a_layout_needs_its_axes():
    with pytest.raises(ValueError, match="bad axes"):
        kl.KvLayout("x", ("block", "head", "token", "kv"))
    with pytest.raises(ValueError, match="last axis"):
        kl.VLLM_BHNC.canonical(_lbhnc(*reference()).transpose(2, 3), B)


# -- tensor-parallel shards ------------------------------------------------------------------


def _shard(rank: int, size: int = 2, **over):
    layout = {
        "block_size": N,
        "layers": ["l0", "l1"],
        "row_bytes": [64, 64],
        "dtype": "bfloat16",
        "wire": kl.WIRE_FORM,
        "tp_rank": rank,
        "tp_size": size,
        "tokens": 20,
        "blocks": 3,
    }
    return (dict(layout, **over), ("seg", rank * 100, 384))


def test_shards_of_every_tp_rank_merge_in_rank_order():
    layout, order = kl.merge_ranks([_shard(1), _shard(0)])  # workers answer in any order
    assert order == [1, 0]  # rank 0 first: answer index 1
    assert layout["tp_size"] == 2 and "tp_rank" not in layout and layout["tokens"] == 20


def test_shards_that_do_not_make_one_state_give_a_reason():
    assert kl.merge_ranks([_shard(0), None]) is None  # not live on a rank: nothing to say
    assert kl.merge_ranks([_shard(0), "cannot slice"]) == "cannot slice"
    assert "TP ranks" in kl.merge_ranks([_shard(0), _shard(0)])
    assert "TP ranks" in kl.merge_ranks([_shard(0, size=3), _shard(1, size=3)])
    assert "differ in tokens" in kl.merge_ranks([_shard(0), _shard(1, tokens=19)])
    one, order = kl.merge_ranks([_shard(0, size=1)])  # no TP: one shard, as before
    assert order == [0] and one["tp_size"] == 1


def test_a_state_imports_only_into_the_same_tp_size_and_per_rank_layout():
    state, _ = kl.merge_ranks([_shard(0), _shard(1)])
    mine = _shard(1)[0]
    assert kl.refusal(state, mine) is None
    assert "tp_size: 2 != 4" in kl.refusal(state, _shard(1, size=4)[0])
    assert "row_bytes" in kl.refusal(state, _shard(0, row_bytes=[128, 128])[0])
    assert "dtype" in kl.refusal(state, _shard(0, dtype="float16")[0])
    # a state from before shards were described: one rank, CPU wire form
    old = {k: v for k, v in state.items() if k not in ("tp_size", "wire")}
    assert kl.refusal(old, _shard(0, size=1)[0]) is None
    assert "tp_size: 1 != 2" in kl.refusal(old, mine)


def test_the_engine_refuses_a_state_of_another_tp_size_and_logs_and_counts_why(tmp_path):
    from structlog.testing import capture_logs

    from laminar.engines import KvState, VllmEngineConfig
    from laminar.engines.vllm_engine import VllmEngine
    from laminar.transport import Blob

    def engine(**over):
        return VllmEngine(
            VllmEngineConfig(**{"model": str(tmp_path), "kv_migration": True, **over})
        )

    state, _ = kl.merge_ranks([_shard(0), _shard(1)])
    two = KvState(backend="vllm", tokens=20, layout=dict(state, model=str(tmp_path)),
                  data=[Blob(b"a"), Blob(b"b")])  # fmt: skip
    assert engine(extra={"tensor_parallel_size": 2})._kv_refusal(two) is None
    one = engine()
    why = one._kv_refusal(two)
    assert why == "KV state of 2 TP shards, this engine has 1 TP ranks"
    assert "kv_migration is off" in engine(kv_migration=False)._kv_refusal(two)
    with capture_logs() as logs:
        one._kv_fallback("r1@1", why, "import")
    assert one.kv_fallbacks == {why: 1}
    assert [(e["event"], e["reason"]) for e in logs] == [
        ("kv migration falls back to re-prefill", why)
    ]
