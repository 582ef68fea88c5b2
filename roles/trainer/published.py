"""What a published version holds: the policy's tensors as its HF checkpoint names them, in the
dtype the engines run.

An engine loads a version the way it loads a checkpoint directory (vLLM calls the model's own
``load_weights`` with HF names), so a version holds what ``save_pretrained`` would write and
nothing else:

* **no aliases of tied parameters.** A tied head shares the embedding's storage and the checkpoint
  stores it once, under the embedding's name; an engine whose model has no head module at all
  (Gemma's) refuses a tensor named for one, and one that has it skips it: either way the alias is
  bytes sent for nothing. transformers lists a model's live ties in ``all_tied_weights_keys``
  (target -> source).
* **no keys the model declines to save** (``_keys_to_ignore_on_save``).
* **the checkpoint's names**, where transformers renames tensors on load
  (``_weight_conversions``): a pure renaming is reversed here; a conversion that merges or splits
  tensors (fused experts) has no cheap per-tensor inverse, and is refused when the trainer starts
  rather than published wrong.

The dtype: floating tensors are published in ``publish.dtype`` (the engines' dtype: what they
would cast to anyway, so bf16 halves every copy, relay and transfer of a version for an engine
that runs bf16); other tensors keep theirs. See docs/training.md, *Publishing*.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from laminar.weights.manifest import TensorEntry

#: ``trainer.publish.dtype`` names -> torch dtypes (``auto``: the parameters' own dtype)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UnpublishableModel(ValueError):
    """The model's checkpoint layout is not its in-memory layout under a renaming."""


def published_keys(model: torch.nn.Module) -> dict[str, str]:
    """Published name -> the ``state_dict`` key it is read from, in state-dict order."""
    state = model.state_dict(keep_vars=True)  # references only: nothing is copied
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    keys = [
        k for k in state if k not in ignored and not (k in tied and tied[k] in state)
    ]  # a tie whose source is gone (it was the one ignored) keeps its target
    return _reverse_renames(model, keys)


def _reverse_renames(model: torch.nn.Module, keys: list[str]) -> dict[str, str]:
    """The checkpoint names of ``keys`` under the model's load-time conversions (identity when
    it has none, which is every dense decoder transformers ships today)."""
    if not getattr(model, "_weight_conversions", None):
        return {k: k for k in keys}
    from transformers.core_model_loading import revert_weight_conversion

    markers = {k: torch.empty(0, device="meta") for k in keys}
    hf: Any = model  # a PreTrainedModel: it has _weight_conversions
    reverted = revert_weight_conversion(hf, dict(markers))
    source = {id(t): k for k, t in markers.items()}
    names: dict[str, str] = {}
    for name, tensor in reverted.items():
        key = source.get(id(tensor))
        if key is None:
            raise UnpublishableModel(
                f"{type(model).__name__}'s checkpoint layout differs from its in-memory layout "
                f"by tensor operations ({name!r} is made from several tensors), which publishing "
                "does not invert: train a model whose checkpoint transformers loads as is"
            )
        names[name] = key
    return dict(sorted(names.items(), key=lambda item: keys.index(item[1])))


def published_dtype(dtype: torch.dtype, publish: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor of ``dtype`` is published in (``publish``: None keeps it)."""
    return publish if publish is not None and dtype.is_floating_point else dtype


def entry_dtype(entry: TensorEntry) -> torch.dtype:
    """The torch dtype a version's manifest entry holds."""
    dtype = getattr(torch, entry.dtype)
    assert isinstance(dtype, torch.dtype), entry.dtype
    return dtype


def resolve_dtype(name: str) -> torch.dtype | None:
    """``trainer.publish.dtype`` as a torch dtype; None for ``auto`` (the parameters' own)."""
    return DTYPES.get(name)


def published_state(model: torch.nn.Module) -> Iterator[tuple[str, Any]]:
    """(published name, the model's tensor) for each published tensor, in order: references
    only (a sharded model's are its ``DTensor`` s)."""
    state = model.state_dict()
    for name, key in published_keys(model).items():
        yield name, state[key]
