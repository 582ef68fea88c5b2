"""The weight path's settings, apart from the code that moves weights (which imports torch):
validating a trainer's config before a run starts must not import torch."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from laminar.runtime.config import Strict


class PublishConfig(Strict):
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Dtype of the floating tensors of a published version. Unset in the file: "
        "the rollouts' rollout.engine.dtype (laminar.runtime.config.DERIVED), the dtype the "
        "engines cast to anyway; auto: the trainer's parameters' own (fp32). bf16 halves every "
        "staging buffer, relay copy and transfer of a version.",
    )
    chunks: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Chunks per version; unset: the paper's k* for the current chain."
    )
    link_gbps: Annotated[float, Field(gt=0)] = Field(
        10.0,
        description="Relay link rate assumed by k* (T_byte = 8 / (link_gbps * 1e9)).",
    )
    chunk_start_us: Annotated[float, Field(gt=0)] = Field(
        200.0,
        description="Per-chunk start cost assumed by k* (a Python frame on TCP).",
    )
    max_chunk_mib: Annotated[int, Field(ge=1, le=1024)] = Field(
        64, description="Upper bound on one chunk's size."
    )
    master: str | None = Field(
        None,
        description="Fixed master weights address (default: follow the manager's chain).",
    )
    transfer_timeout_s: Annotated[float, Field(gt=0)] = Field(
        120.0, description="Timeout of one version's push to the master relay."
    )
    retry_s: Annotated[float, Field(gt=0)] = Field(
        0.2, description="Pause before retrying a failed push or chain watch."
    )
