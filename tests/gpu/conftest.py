"""The GPU suite (issue 17, item 6): what only a CUDA machine can check.

Every test here is skipped, with the reason below, where torch sees no CUDA device (this is how
the CPU suite collects them: ``make test`` and ``pytest tests/gpu`` report them as skipped). On a
GPU machine (``make setup VLLM=vllm``): ``pytest tests/gpu -q``. The FSDP test needs two GPUs
and says so. The CPU halves of each path (KV layouts, weight staging, bf16, FSDP2 on gloo) are
in the default suite.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

NO_CUDA = (
    "no CUDA device: torch.cuda.is_available() is false (a CPU build of torch, or no GPU); "
    "tests/gpu runs on a GPU machine"
)
HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=NO_CUDA)
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(skip)


def gpus(n: int) -> pytest.MarkDecorator:
    """Skip unless at least ``n`` CUDA devices are visible."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return pytest.mark.skipif(count < n, reason=f"needs {n} GPUs, torch sees {count}")
