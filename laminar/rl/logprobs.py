"""Per-token log-probabilities (and entropies) of a batch under the trainer's model.

Why a dedicated function: the same computation serves three purposes — the differentiable
``logp`` inside the loss, the no-grad ``old_logprobs`` (the proximal policy) recomputed at the
start of a step, and a reference model's ``ref_logprobs`` — and all three must sit on exactly the
grid of :class:`laminar.rl.PackedBatch` (value at ``t`` = ``log p(input_ids[t] | input_ids[:t])``;
position 0 has no prediction and is 0). Logits are divided by the sampling temperature and
normalised in float32 so that they match what the rollout engine sampled from, whatever the
model's dtype.

Three ways to the same numbers (``method``):

* ``chunked`` (the default here, and the trainer's on CUDA: ``trainer.logprobs: auto``; on a
  CPU the trainer uses ``full``, which measured faster there for small vocabularies): for a
  model whose logits are its hidden states times a linear head (:func:`linear_head`: Qwen,
  Llama, Mistral, Phi-3, OLMo-2), :class:`ChunkedLinearLogprobs` runs the decoder and then the
  head a few hundred positions at a time, so the logits never exist whole; for any other,
  :class:`ChunkedLogprobs` works through the model's logits a chunk at a time, in float32,
  keeping only the logits themselves (in the model's dtype) for the backward pass. The plain way
  keeps five or six float32 copies of ``[B, T, vocab]`` alive until backward (the upcast, the
  log-softmax, its exponent, the entropy's product): with a 152k vocabulary that is 6 GB per copy
  for one micro-batch of 10k tokens, more than the 0.5B model and its optimizer together.
* ``fused``: the same, with its two chunk functions compiled by ``torch.compile`` (a kernel or
  two per chunk instead of a dozen passes over memory); compiles on first use.
* ``full``: autograd through ``log_softmax`` on the whole upcast tensor; the reference the
  others are tested against.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch.distributed.tensor import DTensor

from .batch import PackedBatch

#: elements of float32 work per chunk (64 MiB): the positions per chunk are this over the vocab;
#: a chunk backward holds a handful of tensors this size at once
CHUNK_ELEMENTS = 1 << 24

Method = Literal["chunked", "fused", "full"]


def token_logprobs(
    model: torch.nn.Module,
    batch: PackedBatch,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    method: Method = "chunked",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[B, T]`` logprobs of ``batch.input_ids`` (and the entropy of each predicting distribution).

    Differentiable through ``model`` unless called under ``torch.no_grad()``. Positions that are
    padding or position 0 are 0 in both outputs. ``model`` is an HF causal LM (anything whose call
    with ``input_ids``/``attention_mask`` returns an object with ``.logits`` of ``[B, T, V]``).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
    targets = batch.input_ids[:, 1:]
    head = linear_head(model) if method in ("chunked", "fused") else None
    if head is not None:
        decoder, weight = head
        kernels = EAGER if method == "chunked" else fused_kernels()
        hidden = decoder(**inputs, use_cache=False).last_hidden_state
        logp, entropy = ChunkedLinearLogprobs.apply(hidden, weight, targets, temperature, kernels)
        return _placed(logp, entropy, batch, with_entropy)
    out = model(**inputs, use_cache=False)
    if method == "chunked":
        logp, entropy = ChunkedLogprobs.apply(out.logits, targets, temperature, EAGER)
    elif method == "fused":
        logp, entropy = ChunkedLogprobs.apply(out.logits, targets, temperature, fused_kernels())
    elif method == "full":
        logp, entropy = _full(out.logits, targets, temperature, with_entropy)
    else:
        raise ValueError(f"method must be 'chunked', 'fused' or 'full', got {method!r}")
    return _placed(logp, entropy, batch, with_entropy)


def _placed(
    logp: torch.Tensor, entropy: torch.Tensor | None, batch: PackedBatch, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[B, T-1]`` predictions on the batch's grid: padding zeroed, position 0 empty."""
    valid = batch.attention_mask[:, 1:].bool()
    logp = _shift_in(torch.where(valid, logp, torch.zeros_like(logp)))
    if not with_entropy or entropy is None:
        return logp, None
    entropy = _shift_in(torch.where(valid, entropy, torch.zeros_like(entropy)))
    return logp, entropy


def _full(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    scaled = logits[:, :-1].float()
    if temperature != 1.0:
        scaled = scaled / temperature
    logp_all = torch.log_softmax(scaled, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None
    return logp, entropy


def chunk_forward(
    z: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk of positions, ``z`` ``[n, V]`` logits: (log-sum-exp, target logprob, entropy),
    each ``[n]`` float32, of ``s = z / temperature`` (``H = lse - sum(p * s)``)."""
    s = z.float()
    if temperature != 1.0:
        s = s / temperature
    lse = torch.logsumexp(s, dim=-1)
    logp = s.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    entropy = lse - (torch.exp(s - lse.unsqueeze(-1)) * s).sum(-1)
    return lse, logp, entropy


def chunk_backward(
    z: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    g: torch.Tensor | None,
    h: torch.Tensor | None,
    temperature: float,
) -> torch.Tensor:
    """The gradient of one chunk's logits, in their dtype, from the gradients ``g`` of its
    logprobs and ``h`` of its entropies (either may be None: nothing flows from it)::

        d/ds = g * onehot(target)  -  p * (g + h * (log p + H)),   d/dz = d/ds / temperature
    """
    s = z.float()
    if temperature != 1.0:
        s = s / temperature
    log_p = s - lse.unsqueeze(-1)
    p = torch.exp(log_p)
    if h is None:
        assert g is not None
        ds = p * -g.unsqueeze(-1)
    else:
        weight = (log_p + entropy.unsqueeze(-1)) * h.unsqueeze(-1)
        if g is not None:
            weight = weight + g.unsqueeze(-1)
        ds = -p * weight
    if g is not None:
        ds = ds.scatter_add(-1, targets.unsqueeze(-1), g.unsqueeze(-1))
    if temperature != 1.0:
        ds = ds / temperature
    return ds.to(z.dtype)


class Kernels:
    """The two chunk functions, as written (eager) or compiled by ``torch.compile`` (fused:
    one or two kernels per chunk instead of a dozen passes over ``[n, V]`` float32). Compiling
    needs inductor's backend for the device: Triton on CUDA, a C++ compiler on CPU."""

    def __init__(self, compiled: bool) -> None:
        if compiled:
            self.forward = torch.compile(chunk_forward, dynamic=True, fullgraph=True)
            self.backward = torch.compile(chunk_backward, dynamic=True, fullgraph=True)
        else:
            self.forward, self.backward = chunk_forward, chunk_backward


EAGER = Kernels(compiled=False)
_FUSED: Kernels | None = None


def fused_kernels() -> Kernels:
    """The compiled kernels, made on first use (one compilation per process, per shape kind)."""
    global _FUSED
    if _FUSED is None:
        _FUSED = Kernels(compiled=True)
    return _FUSED


def _flat(x: torch.Tensor | None) -> torch.Tensor | None:
    """``[B, T-1]`` per prediction -> ``[B * T]`` per position, 0 at each sequence's last (it
    predicts nothing): the row layout the chunk functions work in."""
    return None if x is None else torch.nn.functional.pad(x, (0, 1)).reshape(-1)


def _spans(positions: int, vocab: int) -> list[slice]:
    """Pieces of ``positions`` rows of ``[positions, vocab]``, each about ``CHUNK_ELEMENTS``."""
    step = max(1, CHUNK_ELEMENTS // vocab)
    return [slice(i, min(i + step, positions)) for i in range(0, positions, step)]


class ChunkedLogprobs(torch.autograd.Function):
    """``(logits [B, T, V], targets [B, T-1], temperature, kernels) -> (logp, entropy)``, each
    ``[B, T-1]`` in float32: position ``t`` of the outputs is predicted by ``logits[:, t]``.

    The logits are taken as ``[B * T, V]`` rows (a view) and worked through in chunks of rows
    (:func:`chunk_forward`); the last position of each sequence predicts nothing and is dropped
    (its target is a stand-in 0, and its gradient comes out 0). Saved for backward: the logits
    (the model's dtype), and the log-sum-exps and entropies (``[B, T]`` float32). Backward
    recomputes ``p`` chunk by chunk (:func:`chunk_backward`) into one gradient tensor the size
    of the logits, in their dtype (as the plain way's upcast would hand it back).
    """

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        kernels: Kernels = EAGER,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, width, vocab = logits.shape
        flat = logits.reshape(rows * width, vocab)
        flat_targets = _flat(targets)
        assert flat_targets is not None
        lse = torch.empty(rows * width, dtype=torch.float32, device=logits.device)
        logp, entropy = torch.empty_like(lse), torch.empty_like(lse)
        for span in _spans(rows * width, vocab):
            lse[span], logp[span], entropy[span] = kernels.forward(
                flat[span], flat_targets[span], temperature
            )
        ctx.save_for_backward(logits, flat_targets, lse, entropy)
        ctx.temperature, ctx.kernels = temperature, kernels
        ctx.set_materialize_grads(False)  # an unused entropy's gradient stays None: no pass
        return logp.view(rows, width)[:, :-1], entropy.view(rows, width)[:, :-1]

    @staticmethod
    def backward(
        ctx: Any, grad_logp: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, None, None, None]:
        logits, flat_targets, lse, entropy = ctx.saved_tensors
        if grad_logp is None and grad_entropy is None:
            return None, None, None, None
        rows, width, vocab = logits.shape

        g, h = _flat(grad_logp), _flat(grad_entropy)
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        out = grad.view(rows * width, vocab)
        source = logits.reshape(rows * width, vocab)
        for span in _spans(rows * width, vocab):
            out[span] = ctx.kernels.backward(
                source[span],
                flat_targets[span],
                lse[span],
                entropy[span],
                None if g is None else g[span],
                None if h is None else h[span],
                ctx.temperature,
            )
        return grad, None, None, None


def _shift_in(x: torch.Tensor) -> torch.Tensor:
    """Prepend a zero column: the value predicted from position ``t - 1`` lands at ``t``."""
    return torch.nn.functional.pad(x, (1, 0), value=0.0)


#: config attributes by which a model changes its logits after the head (soft-capping, scaling):
#: a model with any of them set computes its logits itself (``token_logprobs`` takes them whole)
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier")


def linear_head(model: Any) -> tuple[Any, torch.Tensor] | None:
    """``(decoder, head weight)`` of a causal LM whose logits are its final hidden states times a
    bias-free linear head and nothing more; None for any other (its logits are then taken
    whole). ``model`` may offer ``linear_head()`` itself (a wrapper that runs the decoder under
    autocast does). Not for a sharded head (FSDP2 gathers the root's parameters, the head's
    among them, only around the whole model's forward)."""
    own = getattr(model, "linear_head", None)
    if callable(own):
        return own()
    config = getattr(model, "config", None)
    head = getattr(model, "lm_head", None)
    get_decoder = getattr(model, "get_decoder", None)
    if config is None or get_decoder is None or not isinstance(head, torch.nn.Linear):
        return None
    if head.bias is not None or isinstance(head.weight, DTensor):
        return None
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in LOGIT_TRANSFORMS):
        return None
    return get_decoder(), head.weight


class ChunkedLinearLogprobs(torch.autograd.Function):
    """``(hidden [B, T, H], weight [V, H], targets [B, T-1], temperature, kernels) -> (logp,
    entropy)``: :class:`ChunkedLogprobs` with the head's matrix product moved inside, so the
    logits ``[B, T, V]`` never exist whole. Each chunk's logits are made, used and dropped in
    forward, and made again in backward, which writes the hidden states' gradient chunk by chunk
    and adds the chunk's share to the head weight's. Why: with a vocabulary of 152k, the logits
    of one micro-batch and their gradient were most of a trainer's transient memory (two tensors
    of rows x positions x 152k floats); recomputing a chunk's product costs one more pass of the
    head, a small part of a step.

    Under autocast the product runs in the autocast dtype (as the head module would), the rest
    in float32; the weight's gradient is accumulated in the weight's dtype."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        kernels: Kernels = EAGER,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, width, _ = hidden.shape
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        dtype = dtype or weight.dtype
        flat = hidden.reshape(rows * width, -1)
        w = weight.to(dtype)
        flat_targets = _flat(targets)
        assert flat_targets is not None
        lse = torch.empty(rows * width, dtype=torch.float32, device=hidden.device)
        logp, entropy = torch.empty_like(lse), torch.empty_like(lse)
        for span in _spans(rows * width, weight.shape[0]):
            z = flat[span].to(dtype) @ w.T
            lse[span], logp[span], entropy[span] = kernels.forward(
                z, flat_targets[span], temperature
            )
        ctx.save_for_backward(hidden, weight, flat_targets, lse, entropy)
        ctx.temperature, ctx.kernels, ctx.dtype = temperature, kernels, dtype
        ctx.set_materialize_grads(False)
        return logp.view(rows, width)[:, :-1], entropy.view(rows, width)[:, :-1]

    @staticmethod
    def backward(
        ctx: Any, grad_logp: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None]:
        hidden, weight, flat_targets, lse, entropy = ctx.saved_tensors
        if grad_logp is None and grad_entropy is None:
            return None, None, None, None, None
        rows, width, _ = hidden.shape

        g, h = _flat(grad_logp), _flat(grad_entropy)
        flat = hidden.reshape(rows * width, -1)
        w = weight.to(ctx.dtype)
        grad_hidden = torch.empty_like(flat)
        grad_weight = torch.zeros_like(weight)
        for span in _spans(rows * width, weight.shape[0]):
            x = flat[span].to(ctx.dtype)
            ds = ctx.kernels.backward(
                x @ w.T,
                flat_targets[span],
                lse[span],
                entropy[span],
                None if g is None else g[span],
                None if h is None else h[span],
                ctx.temperature,
            )
            grad_hidden[span] = (ds @ w).to(grad_hidden.dtype)
            grad_weight.add_((ds.T @ x).to(weight.dtype))
        return grad_hidden.view(hidden.shape), grad_weight, None, None, None
