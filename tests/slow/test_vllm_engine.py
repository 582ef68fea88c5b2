"""The vLLM backend against transformers on the same weights (fp32, CPU or GPU).

The session's engine serves the module (``vllm_engine`` in tests/slow/conftest.py: starting vLLM
takes ~25 s here). Checks:
- sampled tokens' behaviour logprobs equal transformers' log-softmax within 1e-4;
- an in-place reload to new weights: greedy tokens and logprobs equal transformers' with the new
  weights, and the prefix cache does not serve stale KV from the old ones;
- abort returns exactly the tokens already streamed; EOS stops a request and is kept;
- a request the model cannot take (too long for max_model_len, a token id outside the
  vocabulary) fails alone with its reason, whether we or vLLM refuse it, and the engine goes on.
"""

from __future__ import annotations

import asyncio
import re

import pytest

from laminar.engines import EngineRequest
from laminar.engines.base import EngineError
from laminar.trajectory import SamplingParams
from laminar.transport.shm import SharedBuffer
from laminar.weights.manifest import with_checksums
from laminar.weights.tensors import copy_into, plan_tensors
from tests.support.models import EOS
from tests.support.skips import skip_without_vllm

skip_without_vllm()
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.asyncio(loop_scope="session"),
    pytest.mark.timeout(300),
    pytest.mark.xdist_group("vllm-engine"),  # shares a session fixture: tests/slow/conftest.py
]

PROMPTS = [[3, 4, 5, 6], [10, 11, 12], [7, 7, 7, 7, 7, 8], [20, 30, 40]]


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model


@pytest.fixture(scope="module")
def engine(vllm_engine):
    return vllm_engine


async def generate(engine, prompts, params, prefix="r"):
    """Run requests to completion; returns {request_id: (tokens, logprobs, finish_reason)}."""
    results = {f"{prefix}{i}": ([], [], None) for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        await engine.add_request(
            EngineRequest(request_id=f"{prefix}{i}", prompt_token_ids=prompt, params=params)
        )
    pending = set(results)
    async with asyncio.timeout(120):
        async for batch in engine.outputs():
            for out in batch:
                tokens, logprobs, _ = results[out.request_id]
                tokens += out.token_ids
                logprobs += out.logprobs
                if out.finished:
                    results[out.request_id] = (tokens, logprobs, out.finish_reason)
                    pending.discard(out.request_id)
            if not pending:
                return results
    raise AssertionError("unreachable")


def reference_logprobs(model, prompt, response):
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
    return logp[positions, torch.tensor(response)].tolist()


def reference_greedy(model, prompt, n):
    out = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([out])).logits[0, -1]
        nxt = int(logits.argmax())
        out.append(nxt)
        if nxt == EOS:
            break
    return out[len(prompt) :]


def hf_model(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


async def test_seeded_prompts_over_one_steps_token_budget_all_finish(engine):
    """Prompts admitted together that exceed one step's token budget (the session engine's is
    256) with seeds, as the data role sends every trajectory: on CPU a chunked prefill of a seeded
    request killed vLLM's worker ("CPU Generator does not use offset"; engines/vllm_engine.py
    ``platform_args``). Each finishes, with the tokens a request of its own would sample."""
    prompts = [[3 + (i + j) % 37 for j in range(120)] for i in range(6)]  # 720 prompt tokens
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    together = await generate(engine, prompts, params, prefix="budget")
    assert [len(t) for t, _, _ in together.values()] == [8] * len(prompts)
    alone = await generate(engine, prompts[:1], params, prefix="budget-alone")
    assert alone["budget-alone0"][0] == together["budget0"][0]


async def test_every_vllm_internal_laminar_reads_is_there(engine):
    """Fails loudly when a vLLM upgrade moves an internal Laminar reads (laminar.engines.vllm_compat):
    the one test to fix then, rather than a KV migration that silently re-prefills."""
    assert await engine.compat_problems() == []


async def test_scheduler_stats_reach_the_engine_without_per_request_stats(engine):
    """The repack planner reads the scheduler's stats (running, KV use); the front end keeps
    none of its per-request timing (vllm_compat.scheduler_stats_only: 11% of a rollout's CPU)."""
    params = SamplingParams(max_tokens=64, temperature=1.0, seed=11, ignore_eos=True)
    for i in range(4):
        await engine.add_request(
            EngineRequest(request_id=f"k{i}", prompt_token_ids=[4, 5, 6], params=params)
        )
    seen: list[tuple[int, float]] = []
    request_stats = []
    finished = 0
    async with asyncio.timeout(60):
        async for batch in engine.outputs():
            states = engine._llm.output_processor.request_states.values()
            request_stats += [state.stats for state in states]
            stats = engine.stats()
            seen.append((stats.running, stats.kv_cache_usage))
            finished += sum(out.finished for out in batch)
            if finished == 4:
                break
    assert request_stats and not any(request_stats)
    assert max(running for running, _ in seen) == 4, seen
    assert max(usage for _, usage in seen) > 0, seen
    assert engine.in_flight == 0


async def test_sampled_logprobs_match_transformers(engine, model_dir):
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True)
    results = await generate(engine, PROMPTS, params, prefix="s")
    model = hf_model(model_dir)
    worst = 0.0
    for i, prompt in enumerate(PROMPTS):
        tokens, logprobs, reason = results[f"s{i}"]
        assert len(tokens) == len(logprobs) == 24 and reason == "length"
        ref = reference_logprobs(model, prompt, tokens)
        worst = max(worst, max(abs(a - b) for a, b in zip(logprobs, ref, strict=True)))
    assert worst < 1e-4, f"max |vLLM - transformers| logprob = {worst:.2e}"


async def test_in_place_reload_matches_transformers_with_new_weights(engine, model_dir, tmp_path):
    before = await generate(
        engine, PROMPTS, SamplingParams(max_tokens=16, temperature=0), prefix="a"
    )
    digest_before = await engine.weight_digest()
    # new weights: the old ones plus seeded noise, saved as a second checkpoint for transformers
    model = hf_model(model_dir)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    model.save_pretrained(tmp_path / "v1")
    await engine.load_weights(1, model.state_dict().items())
    assert engine.version == 1 and await engine.weight_digest() != digest_before

    after = await generate(
        engine, PROMPTS, SamplingParams(max_tokens=16, temperature=0), prefix="b"
    )
    new_model = hf_model(tmp_path / "v1")
    changed = 0
    for i, prompt in enumerate(PROMPTS):
        tokens, logprobs, _ = after[f"b{i}"]
        assert tokens == reference_greedy(new_model, prompt, 16)
        ref = reference_logprobs(new_model, prompt, tokens)
        assert max(abs(a - b) for a, b in zip(logprobs, ref, strict=True)) < 1e-4
        changed += tokens != before[f"a{i}"][0]
    assert changed, "the new weights should change some greedy continuation"


async def test_load_from_shared_memory_verifies_then_matches_transformers(
    engine, model_dir, tmp_path
):
    """The relay path: the worker maps a shared segment itself and checks every CRC first."""
    model = hf_model(model_dir)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    model.save_pretrained(tmp_path / "v2")
    named = list(model.state_dict().items())
    manifest = plan_tensors(named, 2)
    segment = SharedBuffer(manifest.total_bytes)
    try:
        copy_into(named, manifest, segment.view)
        manifest = with_checksums(manifest, segment.view)
        version = engine.version
        corrupt = manifest.model_copy(
            update={
                "tensors": [
                    manifest.tensors[0].model_copy(update={"crc32": 1}),
                    *manifest.tensors[1:],
                ]
            }
        )
        with pytest.raises(EngineError, match="checksums"):
            await engine.load_shared(2, segment.name, corrupt)
        assert engine.version == version  # nothing loaded
        digest = await engine.load_shared(2, segment.name, manifest)
        assert engine.version == 2 and digest == manifest.digest()
    finally:
        segment.close()
    after = await generate(
        engine, PROMPTS, SamplingParams(max_tokens=16, temperature=0), prefix="c"
    )
    new_model = hf_model(tmp_path / "v2")
    for i, prompt in enumerate(PROMPTS):
        assert after[f"c{i}"][0] == reference_greedy(new_model, prompt, 16)


async def test_abort_returns_what_was_streamed_and_eos_stops(engine):
    params = SamplingParams(max_tokens=200, temperature=1.0, seed=3, ignore_eos=True)
    await engine.add_request(
        EngineRequest(request_id="long", prompt_token_ids=[5, 6, 7], params=params)
    )
    seen: list[int] = []
    async with asyncio.timeout(60):
        async for batch in engine.outputs():
            for out in batch:
                seen += out.token_ids
            if len(seen) >= 5:
                break
    seq = await engine.abort("long")
    assert seq is not None and seq.response_token_ids[: len(seen)] == seen
    assert len(seq.response_logprobs) == len(seq.response_token_ids)
    assert engine.in_flight == 0
    # EOS as a stop token: request a greedy continuation that is forced to hit EOS early by
    # adding it as an explicit stop id too; the finish reason is "stop" and EOS is kept.
    stopper = SamplingParams(max_tokens=64, temperature=1.0, seed=5, stop_token_ids=list(range(64)))
    res = await generate(engine, [[9, 9, 9]], stopper, prefix="e")
    tokens, logprobs, reason = res["e0"]
    assert reason == "stop" and len(tokens) == 1 and len(logprobs) == 1

    # Bad requests fail alone, each with its reason, while a normal one completes beside them.
    limit, vocab = engine.max_model_len, engine.vocab_size
    assert limit == 256 and vocab is not None
    ok = SamplingParams(max_tokens=8, temperature=1.0, seed=1, ignore_eos=True)
    requests = {"fine": [5, 6, 7], "long": [3] * limit, "vocab": [3, vocab]}
    for rid, prompt in requests.items():
        await engine.add_request(EngineRequest(request_id=rid, prompt_token_ids=prompt, params=ok))
    engine.max_model_len = None  # skip our check: vLLM refuses it inside generate()
    try:
        await engine.add_request(
            EngineRequest(request_id="late", prompt_token_ids=[3] * (limit + 1), params=ok)
        )
    finally:
        engine.max_model_len = limit
    outcome: dict[str, tuple[list[int], str | None]] = {}
    async with asyncio.timeout(60):
        async for batch in engine.outputs():
            for out in batch:
                tokens = outcome.setdefault(out.request_id, ([], None))[0] + out.token_ids
                outcome[out.request_id] = (tokens, out.error or out.finish_reason)
            if len(outcome) == 4 and all(why is not None for _, why in outcome.values()):
                break
    assert len(outcome["fine"][0]) == 8 and outcome["fine"][1] == "length"
    assert outcome["long"][0] == [] and "max_model_len 256" in outcome["long"][1]
    assert "outside the vocabulary" in outcome["vocab"][1] and outcome["vocab"][0] == []
    late_tokens, late_why = outcome["late"]
    assert late_tokens == [] and "vLLM refused the request" in late_why
    assert re.search(r"maximum (model|context) length", late_why) and "256" in late_why
    assert engine.in_flight == 0 and engine.refused == 3
