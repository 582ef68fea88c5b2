"""The vLLM internals accessors (laminar.engines.vllm_compat) on stand-in runners: what
``missing_internals`` names, and the version check. The real runner is checked by
tests/slow/test_vllm_engine.py."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from laminar.doctor.checks import TESTED_VLLM_CPU
from laminar.engines import vllm_compat


def runner(**drop: bool) -> SimpleNamespace:
    layer = SimpleNamespace(kv_cache=object())
    r = SimpleNamespace(
        requests={"a-1234abcd": SimpleNamespace(num_computed_tokens=5, block_ids=([3, 4],))},
        input_batch=SimpleNamespace(req_id_to_index={"a-1234abcd": 0}),
        reload_weights=lambda weights_iterator: None,
        get_model=lambda: None,
        compilation_config=SimpleNamespace(static_forward_context={"l0": layer}),
        kv_cache_config=SimpleNamespace(
            kv_cache_groups=[SimpleNamespace(layer_names=["l0"])], num_blocks=8
        ),
        cache_config=SimpleNamespace(block_size=16),
    )
    for name in drop:
        delattr(r, name)
    return r


def test_a_complete_runner_misses_nothing_and_resolves_suffixed_ids() -> None:
    r = runner()
    assert vllm_compat.missing_internals(r) == []
    internal = vllm_compat.internal_ids(r)["a"]
    state = vllm_compat.scheduled_request(r, internal)
    assert vllm_compat.computed_blocks(state) == (5, [[3, 4]])
    assert vllm_compat.num_blocks(r) == 8 and vllm_compat.block_size(r) == 16


def test_each_missing_internal_is_named() -> None:
    assert vllm_compat.missing_internals(runner(requests=True)) == ["model_runner.requests"]
    assert vllm_compat.missing_internals(runner(input_batch=True)) == [
        "model_runner.input_batch.req_id_to_index"
    ]
    r = runner()
    r.compilation_config.static_forward_context["l0"].kv_cache = None
    assert vllm_compat.missing_internals(r) == ["static_forward_context[layer].kv_cache"]


def test_an_unscheduled_request_has_no_state() -> None:
    r = runner()
    r.input_batch.req_id_to_index.clear()
    assert vllm_compat.scheduled_request(r, "a-1234abcd") is None


def test_versions() -> None:
    assert vllm_compat.version_problem(TESTED_VLLM_CPU) is None  # the pin doctor checks
    assert vllm_compat.version_problem("0.32.1+cpu") is None
    assert "untested" in (vllm_compat.version_problem("0.33.0") or "")
    assert vllm_compat.version_problem(None)


def test_the_reload_warning_every_rotary_model_gives_is_dropped_and_others_are_not(
    caplog: pytest.LogCaptureFixture,
) -> None:
    vllm_compat.quiet_expected_reload_warnings()
    vllm_compat.quiet_expected_reload_warnings()  # once is enough: no second filter
    logger = logging.getLogger(vllm_compat.RELOAD_LOGGER)
    assert len(logger.filters) == 1
    with caplog.at_level(logging.WARNING, logger=vllm_compat.RELOAD_LOGGER):
        logger.warning("%s: Failed to load weights", "RotaryEmbedding")
        logger.warning("%s: Failed to load weights", "QKVParallelLinear")
    assert [r.getMessage() for r in caplog.records] == ["QKVParallelLinear: Failed to load weights"]
