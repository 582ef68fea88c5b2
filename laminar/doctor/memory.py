"""What each role of a run will hold in memory, predicted from the model and the config, and the
check that the machine has it: ``laminar doctor`` refuses, with the numbers, a run that does not
fit instead of letting the kernel's OOM killer end its biggest process (the trainer) again and
again.

Each prediction is a sum of parts that a reader can check against the config (docs/deploy.md,
*Memory*; the parts were measured on ``benchmarks/real_size.py``'s 0.5B model, per role, in
docs/benchmarks.md, *A model of real size*):

* **trainer**: per parameter, the fp32 weights, their gradients and the optimizer's states
  (AdamW: two moments; 16 bytes in all), plus a frozen reference copy under a KL term; the
  publisher's staging buffers (the newest version the master relay acknowledged, kept to heal a
  master that dies before passing it on, and the one being filled) in ``publish.dtype``; one
  micro-batch's activations (every layer's, or with activation checkpointing the layers' inputs
  and one layer's); the logprob pass (whole logits and their gradient, or chunks of them, plus
  the head's and the embedding's weight gradients); the Python, torch and transformers runtime.
  Every rank on the machine holds its share (sharded: 1/W of the per-parameter bytes).
* **relay**: ``keep`` versions (the one arriving counts; the newest complete one always stays).
* **rollout** (vLLM): the weights in the engine's dtype, a second copy of a tied head (vLLM's CPU
  kernels pack it apart from the embedding), the KV cache, and the runtime of the rollout's
  process, vLLM's engine core and its worker.
* **data**, **manager**: their runtime; the data role's reward workers.

Nothing here imports torch or vLLM: the model's size comes from its ``config.json`` and its
safetensors headers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..engines.checkpoint import read_header
from ..engines.kvcache import DTYPE_BYTES, format_bytes
from ..rl.config import CHUNKED_VOCAB
from .facts import MachineFacts
from .findings import Finding

GIB = 1 << 30
#: the runtime of a role's process (Python, its libraries) besides what it holds for the run;
#: a vLLM rollout's three processes (the role, vLLM's engine core, its worker) together
RUNTIME_BYTES = {
    "manager": 1 << 28,
    "data": 3 << 27,
    "relay": 1 << 28,
    "trainer": 3 << 28,
    "rollout": 9 << 28,
    "sim_rollout": 3 << 27,
    "sim_trainer": 3 << 27,
}
#: one reward worker process (a fresh interpreter and the reward's imports)
REWARD_WORKER_BYTES = 1 << 27
#: AdamW's two moments; plain SGD keeps none
OPTIMIZER_COPIES = {"adamw": 2, "sgd": 0}
#: bytes of activations one token keeps per decoder layer, in units of 4-byte floats: about ten
#: hidden-size vectors (norms, attention in and out, residuals) and four intermediate-size ones
#: (the MLP's gate, up, activation, product)
HIDDEN_FLOATS, INTERMEDIATE_FLOATS = 10, 4
#: chunked logprobs hold about this many float32 chunk tensors at once (laminar.rl.logprobs)
CHUNK_TENSORS, CHUNK_BYTES = 5, 4 << 24
#: a machine run above this share of its available memory is called tight (a warning)
TIGHT = 0.9


@dataclass(frozen=True)
class ModelSize:
    """A model's size as a run uses it (from config.json and the safetensors headers)."""

    params: int
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    tied: bool

    @property
    def head_params(self) -> int:
        return self.vocab * self.hidden


@dataclass(frozen=True)
class RoleMemory:
    """One role instance's predicted peak and what it is made of (part -> bytes)."""

    name: str
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def line(self) -> str:
        shown = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.parts.items() if v)
        return f"{self.name} {format_bytes(self.total)} ({shown})"


def model_size(model_dir: str | Path, config: dict[str, Any]) -> ModelSize | None:
    """The model's parameter count and shape; None where its files cannot tell."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    text = config.get("text_config")
    if isinstance(text, dict):
        config = {**config, **text}
    try:
        params = sum(_numel(shape) for f in files for shape in read_header(f).values())
        hidden = int(config["hidden_size"])
        return ModelSize(
            params=params,
            layers=int(config["num_hidden_layers"]),
            hidden=hidden,
            intermediate=int(config.get("intermediate_size") or 4 * hidden),
            vocab=int(config["vocab_size"]),
            tied=bool(config.get("tie_word_embeddings", False)),
        )
    except (KeyError, TypeError, ValueError, OSError):
        return None


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def publish_bytes(size: ModelSize, dtype: str) -> int:
    """One published version: the checkpoint's tensors in ``publish.dtype`` (auto: fp32)."""
    return size.params * DTYPE_BYTES.get(dtype, 4)


def trainer_memory(
    name: str, size: ModelSize, cfg: Any, tokens: int, version_bytes: int
) -> list[RoleMemory]:
    """The torch trainer's ranks on the machine (``cfg``: its ``TrainerConfig``); ``tokens``:
    the most tokens one sequence of the run can hold."""
    ranks = cfg.data_parallel if cfg.ranks == "spawn" else 1
    shards = ranks if cfg.sharding == "fsdp" and ranks > 1 else 1
    per_param = 4 + 4 + 4 * OPTIMIZER_COPIES.get(cfg.optim.name, 2)
    if cfg.loss.kl_coef > 0:
        per_param += 4
    micro = min(cfg.batch.micro_batch_rows, cfg.batch.rows) * tokens
    layer = micro * (HIDDEN_FLOATS * size.hidden + INTERMEDIATE_FLOATS * size.intermediate) * 4
    if cfg.activation_checkpointing:
        activations = micro * size.hidden * 4 * size.layers + layer
    else:
        activations = layer * size.layers
    weight_grads = 2 * size.head_params * 4  # the head's and the embedding's, made whole
    if _chunked(cfg, size):
        logits = CHUNK_TENSORS * CHUNK_BYTES + weight_grads
    else:
        logits = 4 * micro * size.vocab * 4 + weight_grads  # upcast, log-softmax, exp, gradient
    out = []
    for rank in range(ranks):
        parts = {
            "weights+grads+optimizer": size.params * per_param // shards,
            "activations": activations,
            "logprobs": logits,
            "runtime": RUNTIME_BYTES["trainer"],
        }
        if rank == 0:
            parts["staging"] = 2 * version_bytes
        out.append(RoleMemory(name if ranks == 1 else f"{name} rank {rank}", parts))
    return out


def _chunked(cfg: Any, size: ModelSize) -> bool:
    """Whether the trainer takes logprobs a chunk at a time (``trainer.logprobs``; ``auto`` on a
    CPU: for a large vocabulary, as :meth:`PolicyTrainer.logprobs_method` decides)."""
    if cfg.logprobs == "auto":
        return cfg.device == "cuda" or size.vocab >= CHUNKED_VOCAB
    return bool(cfg.logprobs != "full")


def rollout_memory(
    name: str, size: ModelSize | None, weights: int | None, kv: int | None
) -> RoleMemory:
    parts = {"weights": weights or 0, "kv cache": kv or 0, "runtime": RUNTIME_BYTES["rollout"]}
    if size is not None and size.tied and weights and size.params:
        parts["packed head"] = weights * size.head_params // size.params
    return RoleMemory(name, parts)


def check_role_memory(facts: MachineFacts, needs: Any) -> list[Finding]:
    """The run's predicted memory, role by role, against what the machine has available."""
    roles: tuple[RoleMemory, ...] = needs.memory
    if not roles:
        return []
    available = sum(n.available_bytes for n in facts.nodes)
    total = sum(r.total for r in roles)
    biggest = sorted(roles, key=lambda r: -r.total)
    detail = "; ".join(r.line() for r in biggest)
    what = (
        f"the run needs about {format_bytes(total)} of the {format_bytes(available)} available "
        f"(estimated: {detail})"
    )
    fix = (
        f"run fewer rollouts, publish and serve in bfloat16 (rollout.engine.dtype), set "
        f"trainer.activation_checkpointing, lower trainer.batch.micro_batch_rows or relay.keep, "
        f"or free memory; the largest is {biggest[0].name}"
    )
    if total > available:
        return [Finding("blocker", "role-memory", f"{what}: it does not fit", fix)]
    if total > TIGHT * available:
        return [Finding("warning", "role-memory", f"{what}: tight", fix)]
    return [Finding("ok", "role-memory", what)]
