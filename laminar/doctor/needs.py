"""What a config asks of a machine, derived once into :class:`RunNeeds` so every check is a pure
function of it.

Roles and sections are resolved and validated the way the supervisor resolves ``run.roles``
(``load_role_config`` + ``role_config``), so doctor judges the run that would start, not a
reading of the YAML; KV-cache sizes come from :mod:`laminar.engines.kvcache`, the engine's own
arithmetic."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from laminar.runtime.config import LaminarConfig, RoleSpec
from laminar.runtime.errors import ConfigError

from ..engines.kvcache import (
    DTYPE_BYTES,
    head_dim,
    kv_bytes_per_token,
    model_config,
    rollout_kv_bytes,
)
from .findings import Mode
from .memory import (
    REWARD_WORKER_BYTES,
    RUNTIME_BYTES,
    ModelSize,
    RoleMemory,
    model_size,
    publish_bytes,
    rollout_memory,
    trainer_memory,
)

#: optimizer state kept per parameter in a trainer checkpoint, in fp32 copies of the weights
OPTIMIZER_COPIES = {"adamw": 2, "sgd": 0}
#: where disk is checked when the config names no path: the working directory
DISK_CWD = ((".", 0, "the working directory"),)


@dataclass(frozen=True)
class ModelDir:
    """What is in a directory a config names as an HF model (or a tokenizer)."""

    path: str
    keys: tuple[str, ...]  # the config keys naming it
    needs_weights: bool  # False: only a tokenizer is read from it
    exists: bool
    has_config: bool
    has_tokenizer: bool
    safetensors_bytes: int
    stored_dtype_bytes: int  # of the weights on disk (config.json's torch_dtype); 4 if unknown

    def missing(self) -> list[str]:
        if not self.exists:
            return ["the directory"]
        if Path(self.path).suffix == ".json" and not self.needs_weights:
            return []  # data.tokenizer may name tokenizer.json itself
        out = []
        if self.needs_weights and not self.has_config:
            out.append("config.json")
        if self.needs_weights and not self.safetensors_bytes:
            out.append("*.safetensors")
        if self.needs_tokenizer and not self.has_tokenizer:
            out.append("tokenizer.json")
        return out

    @property
    def needs_tokenizer(self) -> bool:
        """Only the data role tokenizes (rollouts take token ids, `skip_tokenizer_init`)."""
        return any(key.endswith(".tokenizer") for key in self.keys)

    def bytes_as(self, dtype_bytes: int) -> int:
        """Size of the weights once loaded in a dtype of ``dtype_bytes`` per element."""
        return self.safetensors_bytes * dtype_bytes // self.stored_dtype_bytes


def inspect_model_dir(path: str, keys: Sequence[str], needs_weights: bool) -> ModelDir:
    p = Path(path)
    if p.is_file():  # a tokenizer.json given directly
        return ModelDir(path, tuple(keys), needs_weights, True, False, True, 0, 4)
    if not p.is_dir():
        return ModelDir(path, tuple(keys), needs_weights, False, False, False, 0, 4)
    stored = 4
    has_config = (p / "config.json").is_file()
    if has_config:
        try:
            cfg = model_config(p)
            dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
            stored = DTYPE_BYTES.get(dtype, 4)
        except ConfigError:
            has_config = False
    weights = sum(f.stat().st_size for f in p.glob("*.safetensors"))
    return ModelDir(
        path, tuple(keys), needs_weights, True, has_config, (p / "tokenizer.json").is_file(),
        weights, stored,
    )  # fmt: skip


@dataclass(frozen=True)
class RolloutNeed:
    """One rollout process and what its engine asks for (sizes None: not known, model missing)."""

    name: str
    section: str
    backend: str
    model: str | None = None
    kv_bytes: int | None = None
    kv_key: str = ""  # where kv_bytes comes from (a config key, or "derived")
    kv_per_token: int | None = None
    max_model_len: int = 0
    max_num_seqs: int = 0
    weights_bytes: int | None = None  # in the engine's dtype
    head_dim: int | None = None  # the attention's head size (None: not known)


@dataclass(frozen=True)
class RunNeeds:
    """Everything the checks need to know about the config, and nothing about the machine."""

    mode: Mode
    token_env: str
    processes: tuple[tuple[str, str], ...] = ()  # (name, section) in start order
    cpus: Literal["auto", "off"] = "auto"
    rollouts: tuple[RolloutNeed, ...] = ()
    relays: int = 0
    relay_keep: int = 0
    relay_ucx_required: bool = False  # a relay's weights_bind is ucx:// explicitly
    version_bytes: int | None = None  # one published version (None: unknown)
    models: tuple[ModelDir, ...] = ()
    data_files: tuple[tuple[str, str], ...] = ()  # (config key, path)
    disk: tuple[tuple[str, int, str], ...] = ()  # (path, bytes needed there, for what)
    environment: str | None = None  # data.env.spec: multi-turn episodes whose tools may be jailed
    memory: tuple[RoleMemory, ...] = ()  # each process's predicted peak (:mod:`.memory`)

    @property
    def disk_or_cwd(self) -> tuple[tuple[str, int, str], ...]:
        return self.disk or DISK_CWD

    @property
    def vllm_rollouts(self) -> list[RolloutNeed]:
        return [r for r in self.rollouts if r.backend == "vllm"]


def needs_from_config(
    config: LaminarConfig, mode: Mode = "run", serve_roles: Sequence[str] = ()
) -> RunNeeds:
    """What running ``config`` here asks for: all of ``run.roles`` (mode ``run``), or the roles
    ``laminar serve --role R`` would start (mode ``serve``). An invalid config raises
    ConfigError, as the supervisor would."""
    from ..engines.configs import VllmEngineConfig
    from ..roles_registry import load_role_config

    base = Path(config.source).parent if config.source else None
    specs = [RoleSpec(role=r) for r in serve_roles] if mode == "serve" else config.run.roles
    processes: list[tuple[str, str]] = []
    rollouts: list[RolloutNeed] = []
    relays = keep = 0
    ucx_required = False
    version_bytes: int | None = None
    model_refs: dict[str, tuple[list[str], bool]] = {}
    data_files: list[tuple[str, str]] = []
    disk: list[tuple[str, int, str]] = []
    checkpoint: tuple[str, str, int, int] | None = None  # model, dir, keep, optimizer copies
    environment: str | None = None
    trainers: list[tuple[str, Any]] = []  # (instance, TrainerConfig) of torch trainers
    relay_names: list[str] = []
    small: list[tuple[str, int]] = []  # (instance, bytes) of the roles that hold no model
    tokens: list[int] = []  # the longest sequence a data role can send (prompt + response)

    def model_ref(path: str, key: str, weights: bool) -> None:
        keys, had = model_refs.setdefault(path, ([], False))
        keys.append(key)
        model_refs[path] = (keys, had or weights)

    for spec in specs:
        role, config_model = load_role_config(spec.role, base)
        section = spec.section or role
        cfg = config.role_config(section, config_model, spec.config)
        names = [f"{section}-{i}" for i in range(spec.count)]
        processes += [(name, section) for name in names]
        if role in ("manager", "sim_trainer"):
            small += [(name, RUNTIME_BYTES[role]) for name in names]
        if role == "rollout":
            engine = cfg.engine
            if isinstance(engine, VllmEngineConfig):
                model_ref(engine.model, f"{section}.engine.model", True)
                need = _vllm_need(engine, section)
                rollouts += [RolloutNeed(name=n, **need) for n in names]
            else:
                rollouts += [RolloutNeed(n, section, engine.backend) for n in names]
        elif role == "relay":
            relay_names += names
            relays += spec.count
            keep = max(keep, cfg.keep)
            ucx_required |= cfg.weights_bind.startswith("ucx://")
        elif role == "trainer" and hasattr(cfg, "model"):
            trainers += [(name, cfg) for name in names]
            model_ref(cfg.model, f"{section}.model", True)
            checkpoint = (cfg.model, cfg.checkpoint.dir, cfg.checkpoint.keep,
                          OPTIMIZER_COPIES.get(cfg.optim.name, 2))  # fmt: skip
        elif hasattr(cfg, "weight_bytes"):  # the emulated trainer publishes this many bytes
            version_bytes = int(cfg.weight_bytes)
        elif role == "data":
            workers = cfg.reward_workers * REWARD_WORKER_BYTES
            small += [(name, RUNTIME_BYTES["data"] + workers) for name in names]
            longest = (cfg.max_prompt_tokens or cfg.max_model_len or 0) + cfg.sampling.max_tokens
            tokens.append(min(longest, cfg.max_model_len or longest))
            data_files.append((f"{section}.prompts", cfg.prompts))
            model_ref(cfg.tokenizer, f"{section}.tokenizer", False)
            if getattr(cfg, "env", None) is not None:
                environment = cfg.env.spec
    models = tuple(
        inspect_model_dir(path, keys, weights) for path, (keys, weights) in model_refs.items()
    )
    if checkpoint is not None:
        model_path, ckpt_dir, ckpt_keep, copies = checkpoint
        trainer_model = next(m for m in models if m.path == model_path)
        fp32 = trainer_model.bytes_as(4) if trainer_model.safetensors_bytes else None
        version_bytes = fp32 if version_bytes is None else version_bytes
        # keep + 1: a new checkpoint is complete before the oldest is pruned
        each = (fp32 or 0) * (1 + copies)
        disk.append((ckpt_dir, (ckpt_keep + 1) * each, f"{ckpt_keep}+1 checkpoints"))
    memory = _memory(models, trainers, rollouts, relay_names, keep, small, tokens, version_bytes)
    if trainers:
        version_bytes = _published(models, trainers[0][1]) or version_bytes
    if mode == "run":
        disk.append((config.run.run_dir, 0, "logs, data store"))
    return RunNeeds(
        mode=mode,
        token_env=config.cluster.token_env,
        processes=tuple(processes),
        cpus=config.run.cpus,
        rollouts=tuple(rollouts),
        relays=relays,
        relay_keep=keep,
        relay_ucx_required=ucx_required,
        version_bytes=version_bytes,
        models=models,
        data_files=tuple(data_files),
        disk=tuple(disk),
        environment=environment,
        memory=tuple(memory),
    )


def _size(models: tuple[ModelDir, ...], path: str) -> ModelSize | None:
    model = next((m for m in models if m.path == path), None)
    if model is None or not model.has_config:
        return None
    try:
        return model_size(path, model_config(path))
    except ConfigError:
        return None


def _published(models: tuple[ModelDir, ...], trainer: Any) -> int | None:
    size = _size(models, trainer.model)
    return publish_bytes(size, trainer.publish.dtype) if size is not None else None


def _memory(
    models: tuple[ModelDir, ...],
    trainers: list[tuple[str, Any]],
    rollouts: list[RolloutNeed],
    relays: list[str],
    keep: int,
    small: list[tuple[str, int]],
    tokens: list[int],
    version_bytes: int | None,
) -> list[RoleMemory]:
    """Each process's predicted peak (:mod:`.memory`); the roles whose model is missing are
    left out (the models check says so)."""
    out: list[RoleMemory] = []
    longest = max(tokens, default=0) or max((r.max_model_len for r in rollouts), default=1024)
    for name, cfg in trainers:
        size = _size(models, cfg.model)
        if size is not None:
            published = publish_bytes(size, cfg.publish.dtype)
            out += trainer_memory(name, size, cfg, longest, published)
            version_bytes = published
    for name in relays:
        held = max(keep, 2) * (version_bytes or 0)
        out.append(RoleMemory(name, {"versions": held, "runtime": RUNTIME_BYTES["relay"]}))
    for r in rollouts:
        if r.backend == "vllm":
            size = _size(models, r.model) if r.model else None
            out.append(rollout_memory(r.name, size, r.weights_bytes, r.kv_bytes))
        else:
            out.append(RoleMemory(r.name, {"runtime": RUNTIME_BYTES["sim_rollout"]}))
    out += [RoleMemory(name, {"runtime": n}) for name, n in small]
    return out


def _vllm_need(engine: Any, section: str) -> dict[str, Any]:
    """KV-cache and weight sizes of a vLLM engine config (None where the model is missing)."""
    out: dict[str, Any] = {
        "section": section,
        "backend": "vllm",
        "model": engine.model,
        "max_model_len": engine.max_model_len,
        "max_num_seqs": engine.max_num_seqs,
    }
    explicit = engine.extra.get("kv_cache_memory_bytes")  # an explicit vLLM argument wins
    if explicit is not None:
        out.update(kv_bytes=int(explicit), kv_key=f"{section}.engine.extra.kv_cache_memory_bytes")
    elif engine.kv_cache_bytes is not None:
        out.update(kv_bytes=int(engine.kv_cache_bytes), kv_key=f"{section}.engine.kv_cache_bytes")
    try:
        hf = model_config(engine.model)
        per_token = kv_bytes_per_token(hf, engine.dtype)
    except ConfigError:
        return out
    out["head_dim"] = head_dim(hf)
    out["kv_per_token"] = per_token
    if "kv_bytes" not in out:
        out.update(kv_bytes=rollout_kv_bytes(engine), kv_key="derived")
    model = inspect_model_dir(engine.model, (), True)
    if model.safetensors_bytes:
        dtype = model.stored_dtype_bytes if engine.dtype == "auto" else DTYPE_BYTES[engine.dtype]
        out["weights_bytes"] = model.bytes_as(dtype)
    return out
