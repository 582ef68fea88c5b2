"""The model-free engine: cost model, length distributions, and the engine under virtual time.

Quantile checks use a binomial bound rather than a hand-picked tolerance: of n samples, the count
below the true quantile Q(q) has standard deviation sqrt(n q (1-q)), so the empirical q-quantile
lies in [Q(q - d), Q(q + d)] with d = 4 sqrt(q (1-q) / n) except with probability ~6e-5 (and the
seeds are fixed, so the tests are deterministic). One more token each side covers the rounding of
samples to integers.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from pydantic import TypeAdapter, ValidationError

from laminar.engines import (
    EngineConfig,
    EngineError,
    EngineOutput,
    EngineRequest,
    SimEngineConfig,
    create_engine,
)
from laminar.engines.costmodel import CostModel, prefill_time, step_time
from laminar.engines.lengths import (
    FixedLength,
    LognormalComponent,
    LognormalLength,
    LongtailLength,
    MixtureLength,
    PaperLength,
    QuantilesLength,
)
from laminar.engines.sim import SimEngine
from laminar.runtime.clock import get_clock, run_virtual
from laminar.trajectory import SamplingParams
from tests.support.virtual import run_virtual_recording

BIG = 1 << 30


def quantile_bounds(dist: Any, q: float, n: int) -> tuple[float, float]:
    d = 4 * math.sqrt(q * (1 - q) / n)
    return dist.quantile(max(0.0, q - d)) - 1, dist.quantile(min(1.0, q + d)) + 1


def request(rid: str, prompt_len: int = 16, max_tokens: int = BIG) -> EngineRequest:
    return EngineRequest(
        request_id=rid,
        prompt_token_ids=[7] * prompt_len,
        params=SamplingParams(max_tokens=max_tokens),
    )


def engine(**overrides: Any) -> SimEngine:
    cfg = SimEngineConfig.model_validate({"kv_capacity_tokens": BIG, **overrides})
    eng = create_engine(cfg)
    assert isinstance(eng, SimEngine)
    return eng


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reason: str | None = None


async def drain(
    eng: SimEngine,
    n_finished: int,
    on_batch: Callable[[float, list[EngineOutput]], Any] | None = None,
) -> dict[str, Result]:
    """Read outputs until ``n_finished`` requests finished; ``on_batch`` may stop early (True)."""
    results: dict[str, Result] = {}
    finished = 0
    async with aclosing(eng.outputs()) as stream:
        async for batch in stream:
            for out in batch:
                r = results.setdefault(out.request_id, Result())
                r.tokens += out.token_ids
                r.logprobs += out.logprobs
                if out.finished:
                    r.reason = out.finish_reason
                    finished += 1
            if on_batch is not None and on_batch(get_clock().time(), batch):
                break
            if finished >= n_finished:
                break
    return results


# -- cost model --------------------------------------------------------------------------------


def test_cost_model_is_the_paper_table_interpolated() -> None:
    for batch, seconds in [(1, 0.007), (64, 0.0125), (128, 0.018), (256, 0.030)]:
        assert step_time(batch, 0) == pytest.approx(seconds, abs=1e-15)
    assert step_time(96, 0) == pytest.approx((0.0125 + 0.018) / 2)
    assert step_time(512, 0) == pytest.approx(0.030 + 256 * 0.012 / 128)  # last segment
    assert step_time(0, 0) == 0.0
    model = CostModel(context_s_per_token=1e-8, prefill_s_per_token=1e-4, prefill_base_s=0.5)
    assert model.step_time(64, 1000) == pytest.approx(0.0125 + 1e-5)
    assert model.prefill_time(0) == 0.0
    assert model.prefill_time(100) == pytest.approx(0.51)
    assert prefill_time(1000) == pytest.approx(0.02)
    assert CostModel(batch_points=[(8, 0.01)]).step_time(100) == 0.01
    with pytest.raises(ValidationError):
        CostModel(batch_points=[(64, 0.01), (32, 0.02)])


# -- length distributions ----------------------------------------------------------------------

DISTRIBUTIONS = [
    PaperLength(),
    LongtailLength(median=1024),
    LognormalLength(median=300, sigma=0.7, max_length=2000),
    MixtureLength(
        components=[
            LognormalComponent(weight=3, median=200, sigma=0.3),
            LognormalComponent(weight=1, median=3000, sigma=0.5),
        ]
    ),
    QuantilesLength(points=[(0, 10), (0.5, 500), (0.9, 2000), (1, 16000)]),
    FixedLength(value=77),
]


@pytest.mark.parametrize("dist", DISTRIBUTIONS, ids=lambda d: d.kind)
def test_sampled_quantiles_match_the_distribution(dist: Any) -> None:
    n = 20_000
    x = dist.sample(np.random.default_rng(1), n)
    assert x.dtype == np.int64 and len(x) == n and x.min() >= 1
    for q in (0.1, 0.5, 0.9, 0.99):
        lo, hi = quantile_bounds(dist, q, n)
        emp = float(np.quantile(x, q, method="inverted_cdf"))
        assert lo <= emp <= hi, (q, lo, emp, hi)
    same = dist.sample(np.random.default_rng(1), n)
    assert np.array_equal(x, same)  # seeded


def test_paper_lengths_are_bimodal_near_1k_and_8k_up_to_16k() -> None:
    x = PaperLength().sample(np.random.default_rng(2), 20_000)
    assert x.max() == 16384 and (x == 16384).sum() > 20  # the tail reaches the bound (~0.6%)
    counts, edges = np.histogram(np.log2(x), bins=np.arange(7, 14.5, 0.25))
    centers = 2 ** ((edges[:-1] + edges[1:]) / 2)
    short, long_ = centers < 2**11.5, centers > 2**11.5
    short_peak = int(np.argmax(np.where(short, counts, -1)))
    long_peak = int(np.argmax(np.where(long_, counts, -1)))
    assert 2**9.5 <= centers[short_peak] <= 2**10.5  # ~1K
    assert 2**12.5 <= centers[long_peak] <= 2**13.5  # ~8K
    valley = counts[short_peak:long_peak].min()
    assert valley < 0.3 * counts[long_peak] < counts[short_peak]
    p50, p99 = PaperLength().quantile(0.5), PaperLength().quantile(0.99)
    assert 1100 < p50 < 1400 and 14_000 < p99 < 16_384


def test_longtail_p99_is_ten_times_the_median() -> None:
    dist = LongtailLength(median=1024)
    assert dist.quantile(0.99) / dist.quantile(0.5) == pytest.approx(10.0, rel=1e-12)
    x = dist.sample(np.random.default_rng(3), 20_000)
    ratio = np.quantile(x, 0.99) / np.quantile(x, 0.5)
    assert 8 < ratio < 12


def test_length_configs_validate() -> None:
    cfg = TypeAdapter(EngineConfig).validate_python(
        {"backend": "sim", "lengths": {"kind": "longtail", "median": 50}}
    )
    assert isinstance(cfg, SimEngineConfig) and isinstance(cfg.lengths, LongtailLength)
    assert isinstance(SimEngineConfig().lengths, PaperLength)
    with pytest.raises(ValidationError):
        QuantilesLength(points=[(0.1, 10), (1, 20)])  # must start at q=0
    with pytest.raises(ValidationError):
        QuantilesLength(points=[(0, 30), (1, 20)])  # decreasing lengths
    with pytest.raises(ValidationError):
        SimEngineConfig.model_validate({"lengths": {"kind": "nope"}})
    assert QuantilesLength(points=[(0, 10), (0.5, 20), (1, 40)]).quantile(0.75) == 30


# -- the engine under virtual time -------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 64, 128, 256])
def test_measured_step_times_equal_the_cost_model(batch: int) -> None:
    prompt, length = 32, 4
    cost = CostModel(context_s_per_token=1e-9)

    async def main() -> list[float]:
        eng = engine(lengths={"kind": "fixed", "value": length}, cost=cost.model_dump())
        await eng.start()
        t0 = get_clock().time()
        for i in range(batch):
            await eng.add_request(request(f"r{i}", prompt))
        times = [t0]

        def on_batch(t: float, outs: list[EngineOutput]) -> None:
            assert len(outs) == batch and all(len(o.token_ids) == 1 for o in outs)
            times.append(t)

        await drain(eng, batch, on_batch)
        await eng.close()
        return times

    times = run_virtual(main())
    assert len(times) == length + 1
    for k in range(length):
        expected = cost.step_time(batch, batch * (prompt + k))
        if k == 0:
            expected += cost.prefill_time(batch * prompt)
        assert abs((times[k + 1] - times[k]) - expected) < 1e-9


def test_engine_lengths_follow_the_distribution_and_max_tokens() -> None:
    n = 2000
    dist = LongtailLength(median=64)

    async def main() -> tuple[dict[str, Result], SimEngine]:
        eng = engine(lengths=dist.model_dump(), seed=5)
        await eng.start()
        for i in range(n):
            await eng.add_request(request(f"q{i}", 8))
        out = await drain(eng, n)
        await eng.close()
        return out, eng

    results, eng = run_virtual(main())
    lengths = np.array([len(r.tokens) for r in results.values()])
    for rid, r in results.items():  # deterministic: the request id fixes the length
        assert len(r.tokens) == eng.response_length(rid) and r.reason == "stop"
        assert all(0 <= t < 32_000 for t in r.tokens) and all(lp < 0 for lp in r.logprobs)
    for q in (0.1, 0.5, 0.9, 0.99):
        lo, hi = quantile_bounds(dist, q, n)
        assert lo <= np.quantile(lengths, q, method="inverted_cdf") <= hi

    async def clipped() -> dict[str, Result]:
        eng = engine(lengths={"kind": "fixed", "value": 100})
        await eng.start()
        await eng.add_request(request("short", max_tokens=30))
        await eng.add_request(request("fits", max_tokens=200))
        await eng.add_request(request("exact", max_tokens=100))
        out = await drain(eng, 3)
        await eng.close()
        return out

    res = run_virtual(clipped())
    assert (len(res["short"].tokens), res["short"].reason) == (30, "length")
    assert (len(res["fits"].tokens), res["fits"].reason) == (100, "stop")
    assert (len(res["exact"].tokens), res["exact"].reason) == (100, "length")


def test_kv_usage_counts_held_tokens() -> None:
    cap, prompt = 10_000, 100

    async def main() -> None:
        eng = engine(lengths={"kind": "fixed", "value": 20}, kv_capacity_tokens=cap)
        await eng.start()
        await eng.add_request(request("a", prompt))
        seen: list[float] = []

        def on_batch(t: float, outs: list[EngineOutput]) -> None:
            seen.append(eng.stats().kv_cache_usage)

        await drain(eng, 1, on_batch)
        assert seen[:-1] == [(prompt + i) / cap for i in range(1, 20)]
        assert seen[-1] == 0.0 and eng.stats().generated_tokens == 20
        await eng.close()

    run_virtual(main())


def test_over_capacity_requests_wait_and_preemption_keeps_tokens() -> None:
    # Two 300-token prompts fit with the 256-token reserve, a third does not; growing to 700
    # tokens each, the pair overflows 1000 and the newer one is preempted (and later resumed).
    cap, prompt, n = 1000, 300, 6
    common = {"lengths": {"kind": "fixed", "value": 400}, "seed": 9}

    async def run(capacity: int, watch: bool) -> dict[str, Result]:
        eng = engine(kv_capacity_tokens=capacity, **common)
        await eng.start()
        for i in range(n):
            await eng.add_request(request(f"r{i}", prompt))
        stats = []
        out = await drain(eng, n, lambda t, o: stats.append(eng.stats()))
        if watch:
            assert (stats[0].running, stats[0].waiting) == (2, 4)
            assert max(s.kv_cache_usage for s in stats) <= 1.0
            assert max(s.kv_cache_usage for s in stats) > 0.9
            assert eng.preemptions > 0 and eng.prefill_tokens > n * prompt  # re-prefilled
        else:
            assert eng.preemptions == 0 and eng.prefill_tokens == n * prompt
        await eng.close()
        return out

    tight = run_virtual(run(cap, True))
    roomy = run_virtual(run(BIG, False))
    assert set(tight) == set(roomy) == {f"r{i}" for i in range(n)}
    for rid in tight:
        assert tight[rid] == roomy[rid] and len(tight[rid].tokens) == 400


def test_abort_returns_tokens_so_far_and_frees_kv() -> None:
    cap, prompt = 10_000, 100

    async def main() -> None:
        eng = engine(lengths={"kind": "fixed", "value": 50}, kv_capacity_tokens=cap)
        await eng.start()
        await eng.add_request(request("keep", prompt))
        await eng.add_request(request("drop", prompt))
        steps = 0

        def on_batch(t: float, outs: list[EngineOutput]) -> bool:
            nonlocal steps
            steps += 1
            return steps == 10

        got = await drain(eng, 2, on_batch)
        seq = await eng.abort("drop")
        assert seq is not None and seq.response_token_ids == got["drop"].tokens
        assert len(seq.response_token_ids) == 10 and seq.response_logprobs == got["drop"].logprobs
        st = eng.stats()
        assert st.running == 1 and st.kv_cache_usage == (prompt + 10) / cap
        rest = await drain(eng, 1)
        assert set(rest) == {"keep"} and len(rest["keep"].tokens) == 40
        assert await eng.abort("drop") is None

        # a queued request aborts with nothing produced
        small = engine(lengths={"kind": "fixed", "value": 5}, max_num_seqs=1)
        await small.start()
        await small.add_request(request("first"))
        await small.add_request(request("queued"))
        await asyncio.sleep(0)  # let the loop admit "first"
        assert small.stats().waiting == 1
        queued = await small.abort("queued")
        assert queued is not None and queued.response_token_ids == []
        assert small.stats().waiting == 0
        assert set(await drain(small, 1)) == {"first"}
        await small.close()
        await eng.close()

    run_virtual(main())


@pytest.mark.parametrize("max_tokens", [BIG, 25])
def test_export_import_continues_to_the_same_sequence(max_tokens: int) -> None:
    common = {"lengths": {"kind": "longtail", "median": 40}, "seed": 3}

    async def main() -> tuple[Result, Result]:
        probe = engine(**common)
        rid = next(f"x{i}" for i in range(1000) if probe.response_length(f"x{i}") > 30)
        whole_eng = engine(**common)
        await whole_eng.start()
        await whole_eng.add_request(request(rid, max_tokens=max_tokens))
        whole = (await drain(whole_eng, 1))[rid]

        src, dst = engine(**common), engine(**common)
        await src.start()
        await dst.start()
        await src.add_request(request(rid, max_tokens=max_tokens))
        steps = 0

        def on_batch(t: float, outs: list[EngineOutput]) -> bool:
            nonlocal steps
            steps += 1
            return steps == 10

        first = (await drain(src, 1, on_batch))[rid]
        (seq,) = await src.export_sequences([rid])
        assert seq.response_token_ids == first.tokens and src.stats().kv_cache_usage == 0
        await dst.import_sequences([seq])
        rest = (await drain(dst, 1))[rid]
        for e in (whole_eng, src, dst):
            await e.close()
        joined = Result(first.tokens + rest.tokens, first.logprobs + rest.logprobs, rest.reason)
        return whole, joined

    whole, joined = run_virtual(main())
    assert joined == whole
    if max_tokens == 25:
        assert (len(whole.tokens), whole.reason) == (25, "length")
    else:
        assert len(whole.tokens) > 30 and whole.reason == "stop"


def test_load_weights_only_when_idle_and_takes_its_time() -> None:
    async def main() -> None:
        eng = engine(lengths={"kind": "fixed", "value": 3}, load_time_s=2.5)
        await eng.start()
        await eng.add_request(request("a"))
        with pytest.raises(EngineError):
            await eng.load_weights(1, [])
        await drain(eng, 1)
        consumed = []

        def weights() -> Any:
            for name in ("w1", "w2"):
                consumed.append(name)
                yield name, b"\0"

        t0 = get_clock().time()
        await eng.load_weights(4, weights())
        assert get_clock().time() - t0 == 2.5 and consumed == ["w1", "w2"]
        assert eng.version == 4 and eng.stats().weight_version == 4
        await eng.close()

    run_virtual(main())


def test_idle_engine_takes_no_steps_and_burns_no_virtual_time() -> None:
    async def main() -> None:
        eng = engine(lengths={"kind": "fixed", "value": 2}, cost={"prefill_s_per_token": 0})
        await eng.start()
        clock = get_clock()
        await clock.sleep(1000.0)
        assert eng.steps == 0 and clock.time() == 1000.0
        await eng.add_request(request("a"))
        await drain(eng, 1)
        assert clock.time() == pytest.approx(1000.0 + 2 * step_time(1))
        await clock.sleep(1000.0)
        assert eng.steps == 2 and eng.stats().decode_batch_size == 0
        await eng.close()

    _, real_timeouts = run_virtual_recording(main())
    assert real_timeouts and all(t == 0 for t in real_timeouts), set(real_timeouts)


async def test_runs_on_the_real_clock() -> None:
    eng = engine(
        lengths={"kind": "fixed", "value": 3},
        cost={"batch_points": [(1, 0.002)], "prefill_s_per_token": 0},
    )
    await eng.start()
    t0 = time.monotonic()
    await eng.add_request(request("a"))
    res = await drain(eng, 1)
    assert len(res["a"].tokens) == 3 and time.monotonic() - t0 >= 0.006
    await eng.close()


def test_thousand_requests_in_virtual_time_never_wait_for_real() -> None:
    n = 1000

    async def main() -> tuple[float, dict[str, Result]]:
        eng = engine(lengths={"kind": "longtail", "median": 128}, kv_capacity_tokens=1_000_000)
        await eng.start()
        for i in range(n):
            await eng.add_request(request(f"p{i}", 100, max_tokens=4096))
        out = await drain(eng, n)
        st = eng.stats()
        assert st.running == st.waiting == 0 and st.kv_cache_usage == 0
        assert st.generated_tokens == sum(len(r.tokens) for r in out.values())
        await eng.close()
        return get_clock().time(), out

    (virtual, results), real_timeouts = run_virtual_recording(main())
    assert len(results) == n and all(r.reason in ("stop", "length") for r in results.values())
    assert virtual > 10.0  # tens of seconds of simulated decoding...
    # ...without the loop ever waiting for real: every select it made was non-blocking.
    assert real_timeouts and all(t == 0 for t in real_timeouts), set(real_timeouts)


@pytest.mark.parametrize("capacity", [BIG, 3000])
def test_chunked_steps_finish_like_single_steps(capacity: int) -> None:
    """``chunk_steps`` (the simulator's speed-up) changes the events, not the outcome: the same
    tokens, logprobs, finish reasons and finish times as one step at a time, with the context
    term on and, at 3000 tokens, preemptions."""
    cost = {"batch_points": [[1, 0.007], [64, 0.0125]], "context_s_per_token": 1e-7}
    lengths = {"kind": "lognormal", "median": 120, "sigma": 0.8, "max_length": 600}

    async def run(chunk: int) -> tuple[dict[str, Result], dict[str, float], int]:
        eng = engine(
            lengths=lengths, cost=cost, kv_capacity_tokens=capacity, chunk_steps=chunk, seed=4
        )
        await eng.start()
        for i in range(24):
            await eng.add_request(request(f"r{i}", 40))
        finished: dict[str, float] = {}

        def on_batch(t: float, outs: list[EngineOutput]) -> None:
            finished.update((o.request_id, t) for o in outs if o.finished)

        out = await drain(eng, 24, on_batch)
        await eng.close()
        return out, finished, eng.steps

    one, one_t, one_steps = run_virtual(run(1))
    many, many_t, many_steps = run_virtual(run(64))
    assert one == many and one_steps == many_steps
    assert one_t.keys() == many_t.keys()
    for rid, t in one_t.items():
        assert many_t[rid] == pytest.approx(t, rel=1e-9)


def test_tool_calls_pause_a_sequence_while_the_others_decode() -> None:
    """Hand-computed, with a constant 10 ms step and free prefill. Alone, a 100-token response
    making tool calls finishes at 100 steps plus the sum of its calls' latencies. Beside others,
    a response without calls finishes at its own 100 steps, undelayed, and one with calls at most
    one step later per call (it rejoins at the next step boundary). Chunked steps agree."""
    tools = {"max_calls": 2, "latency_median_s": 0.3, "latency_sigma": 1.0, "output_tokens": 5}
    cost = {"batch_points": [[1, 0.01], [256, 0.01]], "prefill_s_per_token": 0.0}
    step = 0.01

    async def run(chunk: int, ids: tuple[str, ...]) -> tuple[dict[str, float], dict, dict]:
        eng = engine(lengths={"kind": "fixed", "value": 100}, cost=cost, tools=tools,
                     chunk_steps=chunk, seed=1)  # fmt: skip
        calls = {rid: eng.tool_calls(rid, 0, 100) for rid in ids}
        await eng.start()
        for rid in ids:
            await eng.add_request(request(rid, 10))
        finished: dict[str, float] = {}

        def on_batch(t: float, outs: list[EngineOutput]) -> None:
            finished.update((o.request_id, t) for o in outs if o.finished)

        out = await drain(eng, len(ids), on_batch)
        assert eng.tool_calls_made == sum(len(c) for c in calls.values())
        await eng.close()
        return finished, out, calls

    ids = tuple("abcdefgh")
    for chunk in (1, 64):
        finished, out, calls = run_virtual(run(chunk, ids))
        assert all(len(r.tokens) == 100 for r in out.values())
        quiet = [rid for rid in ids if not calls[rid]]
        busy = [rid for rid in ids if calls[rid]]
        assert quiet and busy  # seed 1 draws both kinds among eight
        for rid in quiet:
            assert finished[rid] == pytest.approx(100 * step)
        for rid in busy:
            alone = 100 * step + sum(t for _, t in calls[rid])
            assert alone - 1e-9 <= finished[rid] <= alone + len(calls[rid]) * step + 1e-9
        lone, _, lone_calls = run_virtual(run(chunk, (busy[0],)))
        assert lone[busy[0]] == pytest.approx(100 * step + sum(t for _, t in lone_calls[busy[0]]))
