"""What an engine's checkpoint directory holds, and whether a published version fits it.

An engine loads a version in place with the model's own loader, as it loaded its checkpoint at
start (vLLM: ``load_weights`` with HF names). What that loader does with a name or a shape it
does not expect depends on the model: one skips it, another raises halfway through the load
(Gemma's has no ``lm_head``), leaving some tensors of the new version and some of the old. So a
version is checked against the checkpoint before any of it is loaded: the tensor names and shapes
come from the safetensors headers (eight bytes of length, then JSON; nothing else is read).

* a tensor the checkpoint does not have is left out of the load, and said once: an alias (a tied
  head published by another trainer) or a buffer the engine never reads;
* a checkpoint tensor the version lacks, or a tensor whose shape differs, refuses the whole
  version (:class:`IncompatibleWeights`): loading it would mix versions in one model, and the
  next version would fail the same way.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from laminar.runtime.errors import LaminarError

#: checkpoint names a tied model may hold although its engine reads the source tensor instead
TIED_ALIASES = ("lm_head.weight",)
_HEADER_LIMIT = 100 << 20  # a safetensors header is JSON; anything larger is not one


class IncompatibleWeights(LaminarError):
    """A version the engine must not load: it would mix versions in the model, and every later
    version would be refused the same way (the rollout stops with this reason)."""


@dataclass(frozen=True)
class CheckpointTensors:
    """Names and shapes of the tensors in a model directory's safetensors files."""

    path: str
    shapes: dict[str, tuple[int, ...]]
    tied: bool  # config.json's tie_word_embeddings

    def fit(self, published: dict[str, tuple[int, ...]], version: int | None = None) -> list[str]:
        """The published names to leave out (the checkpoint has no such tensor); raises
        :class:`IncompatibleWeights` when the version cannot be loaded whole."""
        extra = [name for name in published if name not in self.shapes]
        missing = [
            name
            for name in self.shapes
            if name not in published and not (self.tied and name in TIED_ALIASES)
        ]
        wrong = [
            f"{name} {list(published[name])} (checkpoint {list(shape)})"
            for name, shape in self.shapes.items()
            if name in published and tuple(published[name]) != shape
        ]
        if missing or wrong:
            problems = []
            if missing:
                problems.append(f"{len(missing)} tensor(s) missing: {_few(missing)}")
            if wrong:
                problems.append(f"{len(wrong)} of another shape: {_few(wrong)}")
            raise IncompatibleWeights(
                f"{'the weights' if version is None else f'version {version}'} cannot be "
                f"loaded into the engine's model {self.path} "
                f"({'; '.join(problems)}): the trainer's model is not the rollouts' "
                "(trainer.model and rollout.engine.model must be the same architecture and size)"
            )
        return extra


def _few(names: list[str], n: int = 4) -> str:
    shown = ", ".join(names[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")


def read_header(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, from one safetensors file's header."""
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        if size > _HEADER_LIMIT:
            raise ValueError(f"{path}: not a safetensors file (header of {size} bytes)")
        header = json.loads(f.read(size))
    return {
        name: tuple(int(d) for d in info["shape"])
        for name, info in header.items()
        if name != "__metadata__"
    }


def checkpoint_tensors(model_dir: str | Path) -> CheckpointTensors | None:
    """The tensors of ``model_dir``'s safetensors files; None when it has none to read (an
    engine that loaded something else cannot be checked this way)."""
    root = Path(model_dir)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        shapes.update(read_header(path))
    tied = False
    config = root / "config.json"
    if config.is_file():
        loaded = json.loads(config.read_text())
        text = loaded.get("text_config") if isinstance(loaded.get("text_config"), dict) else {}
        tied = bool(loaded.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    return CheckpointTensors(str(root), shapes, tied)


def eos_token_ids(model_dir: str | Path) -> list[int]:
    """The model's end-of-sequence ids (generation_config.json, else config.json).

    With ``skip_tokenizer_init`` vLLM does not know the EOS token, so without this it would never
    stop early; we pass these as stop token ids (the stop token is kept in the output).
    """
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return [eos] if isinstance(eos, int) else [int(e) for e in eos]
    return []
