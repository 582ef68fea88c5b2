"""The chunked logprob function's fused kernels against the eager ones: the same values and
gradients. Compiling the kernels runs the C++ compiler, so this is not a unit test; the rest is
``tests/unit/test_chunked_logprobs.py``."""

from __future__ import annotations

import pytest
import torch

from laminar.rl import logprobs as lp_module
from laminar.rl.logprobs import ChunkedLogprobs


@pytest.mark.slow  # torch.compile: about 15 s of one core for the two chunk functions
def test_fused_kernels_give_the_eager_values_and_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._inductor.config as inductor_config

    from laminar.rl.logprobs import EAGER, fused_kernels

    monkeypatch.setattr(lp_module, "CHUNK_ELEMENTS", 40 * 11)  # chunks of 40 positions
    # Inductor's CPU backend takes the vector ISAs /proc/cpuinfo lists, but first proves each by
    # compiling and loading a probe against ATen's vector headers (once per process and cache
    # directory: in every fresh clone's run). Here that is half of the test's cost (2026-11-28:
    # 33 CPU-s with the probes, 17 without; 13 compilations against 9). The kernels below are
    # compiled with the same flags either way, so a vector ISA this compiler lacks still fails.
    monkeypatch.setattr(inductor_config.cpp, "vec_isa_ok", True)
    gen = torch.Generator().manual_seed(5)
    logits = (3 * torch.randn(3, 50, 11, generator=gen)).to(torch.bfloat16)
    targets = torch.randint(0, 11, (3, 49), generator=gen)
    out = {}
    for name, kernels in (("eager", EAGER), ("fused", fused_kernels())):
        x = logits.clone().requires_grad_(True)
        logp, entropy = ChunkedLogprobs.apply(x, targets, 0.8, kernels)
        (logp.sum() + 0.1 * entropy.sum()).backward()
        out[name] = (logp.detach(), entropy.detach(), x.grad.float())
    for got, want in zip(out["fused"], out["eager"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)  # fp32 sums in another order
