"""The chunked logprob function against autograd through the whole log-softmax.

Both ways must give the same logprobs, entropies and gradients (to float32 rounding), for any
temperature, whether the entropy carries gradient or not, in float32 and in bfloat16, and however
the positions fall into chunks (``CHUNK_ELEMENTS`` is made small so a row spans several)."""

from __future__ import annotations

import pytest
import torch

from laminar.rl import logprobs as lp_module
from laminar.rl.logprobs import ChunkedLogprobs, _full, token_logprobs
from tests.support.models import tiny_qwen2

from .test_rl import traj


def reference(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    logp, entropy = _full(logits, targets, temperature, with_entropy=True)
    assert entropy is not None
    return logp, entropy


@pytest.mark.parametrize("chunk", [1 << 26, 40, 17])  # one chunk a row, several, ragged
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_weight", [0.0, 0.3])
def test_values_and_gradients_match_the_full_log_softmax(
    monkeypatch: pytest.MonkeyPatch, chunk: int, temperature: float, entropy_weight: float
) -> None:
    monkeypatch.setattr(lp_module, "CHUNK_ELEMENTS", chunk)
    gen = torch.Generator().manual_seed(int(temperature * 10) + chunk)
    logits = (3 * torch.randn(3, 9, 11, generator=gen, dtype=torch.float64)).float()
    targets = torch.randint(0, 11, (3, 8), generator=gen)
    g_logp = torch.randn(3, 8, generator=gen)
    g_ent = torch.randn(3, 8, generator=gen)
    grads = {}
    for name, fn in (("full", reference), ("chunked", ChunkedLogprobs.apply)):
        x = logits.clone().requires_grad_(True)
        logp, entropy = fn(x, targets, temperature)
        loss = (logp * g_logp).sum()
        if entropy_weight:
            loss = loss + entropy_weight * (entropy * g_ent).sum()
        loss.backward()
        grads[name] = (logp.detach(), entropy.detach(), x.grad)
    for got, want in zip(grads["chunked"], grads["full"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (grads["chunked"][2][:, -1] == 0).all()  # the last position predicts nothing


def test_bf16_logits_get_a_bf16_gradient_equal_to_the_upcast_path() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = (2 * torch.randn(2, 6, 50, generator=gen)).to(torch.bfloat16)
    targets = torch.randint(0, 50, (2, 5), generator=gen)
    out = {}
    for name, fn in (("full", reference), ("chunked", ChunkedLogprobs.apply)):
        x = logits.clone().requires_grad_(True)
        logp, entropy = fn(x, targets, 1.0)
        (logp.sum() + 0.1 * entropy.sum()).backward()
        assert x.grad is not None and x.grad.dtype == torch.bfloat16
        out[name] = (logp.detach(), x.grad.float())
    torch.testing.assert_close(out["chunked"][0], out["full"][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["chunked"][1], out["full"][1], atol=1e-2, rtol=1e-2)


def test_the_model_gets_the_same_gradients_either_way(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    import transformers

    from laminar.rl import pack

    monkeypatch.setattr(lp_module, "CHUNK_ELEMENTS", 3 * 64)  # a few positions a chunk
    path = tiny_qwen2(tmp_path / "m")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    rows = [([1, 5, 9], [10, 11, 12, 2]), ([1, 7], [3]), ([1, 4, 4, 4, 8], [20, 21])]
    batch = pack([traj(p, r) for p, r in rows], [1.0, -1.0, 0.5], pad_id=0)
    grads = {}
    for method in ("full", "chunked"):
        model.zero_grad()
        logp, ent = token_logprobs(model, batch, temperature=0.9, with_entropy=True, method=method)
        assert ent is not None
        ((logp * batch.advantages).sum() + 0.01 * ent.sum()).backward()
        grads[method] = {n: p.grad.clone() for n, p in model.named_parameters()}
    # float32 rounding, which the two ways accumulate in different orders: an element's error
    # scales with the terms summed into it, so with its tensor's largest element, not with its own
    # value (a suite run read 2.3e-6 on an element of 3.4e-3 in a gradient reaching ~3; both ways
    # were the same model, and alone with 1, 2 or 3 threads the worst error was 7e-7 of the scale)
    for name, want in grads["full"].items():
        scale = want.abs().max().item()
        torch.testing.assert_close(grads["chunked"][name], want, atol=1e-5 * scale, rtol=1e-4)


def test_an_unknown_method_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import transformers

    from laminar.rl import pack

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_qwen2(tmp_path / "m"))
    with pytest.raises(ValueError, match="'chunked', 'fused' or 'full'"):
        token_logprobs(model, pack([traj([1], [2])], [1.0]), method="fast")  # type: ignore[arg-type]


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "phi3"])
@pytest.mark.parametrize("chunk", [1 << 26, 100])
def test_the_head_inside_the_chunks_gives_the_logits_paths_numbers(
    monkeypatch: pytest.MonkeyPatch, tmp_path, family: str, chunk: int
) -> None:
    """A linear head (tied or not) is applied a chunk at a time; logprobs, entropies and every
    parameter's gradient (the head's and the embedding's included) are the whole-logits path's."""
    import transformers

    from laminar.rl.logprobs import linear_head
    from tests.support.models import tiny_model

    monkeypatch.setattr(lp_module, "CHUNK_ELEMENTS", chunk)
    from laminar.rl import pack

    path = tiny_model(tmp_path / "m", family, vocab=96)
    rows = [([1, 5, 9], [10, 11, 12, 2]), ([1, 7], [3]), ([1, 4, 4, 4, 8], [20, 21])]
    batch = pack([traj(p, r) for p, r in rows], [1.0, -1.0, 0.5], pad_id=0)
    grads = {}
    for method in ("full", "chunked"):
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        assert linear_head(model) is not None
        logp, entropy = token_logprobs(model, batch, temperature=0.8, with_entropy=True,
                                       method=method)  # fmt: skip
        assert entropy is not None
        (logp.sum() + 0.1 * entropy.sum()).backward()
        grads[method] = (logp.detach(), entropy.detach(),
                         {n: p.grad for n, p in model.named_parameters()})  # fmt: skip
    torch.testing.assert_close(grads["chunked"][0], grads["full"][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads["chunked"][1], grads["full"][1], atol=1e-5, rtol=1e-5)
    for name, grad in grads["full"][2].items():  # float32 rounding, to each tensor's scale
        scale = grad.abs().max().item()
        torch.testing.assert_close(grads["chunked"][2][name], grad, atol=1e-5 * scale, rtol=1e-4)


def test_a_model_that_transforms_its_logits_keeps_the_logits_path(tmp_path) -> None:
    import transformers

    from laminar.rl.logprobs import linear_head
    from tests.support.models import tiny_model

    gemma = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_model(tmp_path / "g", "gemma2", vocab=96), dtype=torch.float32
    )
    assert gemma.config.final_logit_softcapping  # soft-capped: not a plain product
    assert linear_head(gemma) is None
