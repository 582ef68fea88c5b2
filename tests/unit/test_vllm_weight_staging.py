"""A published version's tensors reach the engine's device through two reused staging buffers
(``staged_to_device``, pinned on CUDA; here on CPU, unpinned, the same copies): every tensor
arrives whole and unchanged, however it is chunked, and none aliases a staging buffer (vLLM's
layerwise reload holds each until its layer is complete, while the buffers are refilled)."""

from __future__ import annotations

import torch

from laminar.engines.vllm_worker import staged_to_device


def named() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("embed", torch.randn(37, 11, generator=g).to(torch.bfloat16)),  # 814 B: many chunks
        ("empty", torch.empty(0, 4)),
        ("norm", torch.randn(5, generator=g)),  # smaller than one chunk
        ("ids", torch.arange(24, dtype=torch.int64).view(2, 3, 4)),
        ("scalar", torch.tensor(3.5)),
    ]


def test_every_tensor_arrives_whole_across_chunks_and_owns_its_memory():
    source = named()
    out = list(staged_to_device(source, torch.device("cpu"), chunk_bytes=64))
    # the loader keeps them all until the end: compare only after every chunk was staged
    assert [n for n, _ in out] == [n for n, _ in source]
    for (_, got), (_, want) in zip(out, source, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)
        assert got.numel() == 0 or got.data_ptr() != want.data_ptr()


def test_a_tensor_bigger_than_both_buffers_together_is_still_exact():
    big = torch.arange(1000, dtype=torch.float32)
    ((_, got),) = staged_to_device([("w", big)], torch.device("cpu"), chunk_bytes=100)
    assert torch.equal(got, big)
