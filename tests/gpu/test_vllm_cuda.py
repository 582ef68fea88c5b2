"""vLLM on CUDA: a published version loaded from shared memory (through pinned staging, no disk),
and KV migration between two CUDA engines (FlashAttention's cache layout, or whichever backend
vLLM picks), at TP 1 and, given two GPUs, TP 2 (each rank's head shard).

Mirrors tests/slow/test_vllm_engine.py (the shared-memory load) and tests/slow/test_kv_migration.py
on the tiny random Qwen2. The KV check is byte-level and so holds in bf16: right after an import,
the destination exports the same sequence again and its full blocks must be the very bytes the
source sent (they were loaded, not recomputed), and the connector counts the loaded tokens.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import pytest_asyncio

from laminar.engines import EngineRequest, VllmEngineConfig, create_engine
from laminar.trajectory import SamplingParams
from laminar.transport.shm import SharedBuffer
from laminar.weights.manifest import with_checksums
from laminar.weights.tensors import copy_into, plan_tensors

from ..support.models import tiny_qwen2
from ..support.skips import skip_without_vllm
from .conftest import gpus

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# A GPU machine without vLLM's CUDA build (`make setup VLLM=vllm`) skips these with the reason
# rather than failing on the import inside the engine.
skip_without_vllm("vLLM is not installed (`make setup VLLM=vllm` on a GPU)")

BLOCK = 16
PARAMS = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
PROMPTS = [[3, 4, 5, 6, 9, 9, 10], [10, 11, 12], [7, 7, 7, 7, 7, 8, 20, 21, 22, 23, 24]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_qwen2(tmp_path_factory.mktemp("tiny"))


def engine_config(model: Path, tp: int = 1, **over) -> VllmEngineConfig:  # type: ignore[no-untyped-def]
    extra = {"block_size": BLOCK, **({"tensor_parallel_size": tp} if tp > 1 else {})}
    return VllmEngineConfig(
        model=str(model),
        max_model_len=256,
        max_num_seqs=8,
        gpu_memory_utilization=0.2,  # two engines share one GPU
        kv_cache_bytes="256MiB",
        extra=extra,
        **over,
    )


async def run(engine, prefix: str, *, until: int | None = None):  # type: ignore[no-untyped-def]
    ids = [f"{prefix}{i}" for i in range(len(PROMPTS))]
    for rid, prompt in zip(ids, PROMPTS, strict=True):
        await engine.add_request(
            EngineRequest(request_id=rid, prompt_token_ids=prompt, params=PARAMS)
        )
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    done: set[str] = set()
    async with asyncio.timeout(120):
        async for batch in engine.outputs():
            for out in batch:
                if out.request_id in tokens:
                    tokens[out.request_id] += out.token_ids
                    if out.finished:
                        done.add(out.request_id)
            if (until is not None and all(len(t) >= until for t in tokens.values())) or (
                len(done) == len(ids)
            ):
                return tokens
    raise AssertionError("unreachable")


async def test_a_published_version_loads_from_shared_memory_on_cuda(model_dir, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    engine = create_engine(engine_config(model_dir, dtype="float32"))
    await engine.start()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        gen = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
        named = list(model.state_dict().items())
        manifest = plan_tensors(named, 1)
        segment = SharedBuffer(manifest.total_bytes)
        try:
            copy_into(named, manifest, segment.view)
            manifest = with_checksums(manifest, segment.view)
            before = await engine.weight_digest()
            await engine.load_shared(1, segment.name, manifest)
        finally:
            segment.close()
        assert engine.version == 1 and await engine.weight_digest() != before
        got = await run(engine, "w")
        model.eval()
        for i, prompt in enumerate(PROMPTS):  # greedy, fp32: transformers on the CPU agrees
            out = list(prompt)
            for _ in range(PARAMS.max_tokens):
                with torch.no_grad():
                    out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
            assert got[f"w{i}"] == out[len(prompt) :], i
    finally:
        await engine.close()


@pytest_asyncio.fixture(params=[1, pytest.param(2, marks=gpus(2))], ids=["tp1", "tp2"])
async def engines(request, model_dir):  # type: ignore[no-untyped-def]
    tp = request.param
    source = create_engine(engine_config(model_dir, tp, dtype="bfloat16", kv_migration=True))
    dest = create_engine(engine_config(model_dir, tp, dtype="bfloat16", kv_migration=True))
    await source.start()
    await dest.start()
    try:
        yield source, dest, tp
    finally:
        await dest.close()
        await source.close()


async def test_kv_moves_between_cuda_engines_byte_for_byte(engines):
    source, dest, tp = engines
    await run(source, "m", until=40)
    seqs = await source.export_sequences([f"m{i}" for i in range(len(PROMPTS))], with_kv=True)
    assert len(seqs) == len(PROMPTS)
    for seq in seqs:
        assert seq.kv is not None, source.kv_fallbacks
        assert len(seq.kv.data) == tp and seq.kv.layout["tp_size"] == tp
    before = await dest.kv_loaded()
    await dest.import_sequences(seqs)
    assert not dest.kv_fallbacks, dest.kv_fallbacks
    # once each has produced a token there, its imported prefix sits in the destination's cache
    async with asyncio.timeout(120):
        seen: set[str] = set()
        async for batch in dest.outputs():
            seen |= {o.request_id for o in batch if o.token_ids}
            if len(seen) == len(seqs):
                break
    after = await dest.kv_loaded()
    assert after["requests"] - before["requests"] == len(seqs)
    expected = sum(
        min(s.kv.tokens, len(s.prompt_token_ids) + len(s.response_token_ids) - 1) for s in seqs
    )
    assert after["tokens"] - before["tokens"] == expected
    moved = await dest.export_sequences([s.request_id for s in seqs], with_kv=True)
    for old, new in zip(seqs, moved, strict=True):
        assert new.kv is not None
        full = old.kv.tokens // BLOCK  # full blocks: the last one's tail was the source's
        rows = old.kv.layout["row_bytes"]
        for shard_old, shard_new in zip(old.kv.data, new.kv.data, strict=True):
            a, b = bytes(shard_old.view), bytes(shard_new.view)
            oa = ob = 0
            for row in rows:  # per layer: the first `full` blocks of each state
                assert a[oa : oa + full * row] == b[ob : ob + full * row], old.request_id
                oa += old.kv.layout["blocks"] * row
                ob += new.kv.layout["blocks"] * row
