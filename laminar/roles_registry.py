"""Resolve a role name to its service class: a built-in name, ``module:Class`` or ``file.py:Class``.

``file.py:Class`` paths are resolved against the directory of the config file, so an example can
ship its own roles beside its ``config.yaml``.
"""

from __future__ import annotations

from pathlib import Path

from .plugins import load_object
from .runtime.config import ServiceConfig
from .runtime.errors import ConfigError
from .runtime.service import Service

# Role names -> ``module:Class``: the runtime starts a role by name without importing every role
# (and its heavy dependencies) up front. Strings, not imports: the runtime never imports roles/.
BUILTIN: dict[str, str] = {
    "manager": "laminar.roles.manager.service:ManagerService",
    "data": "laminar.roles.data.service:DataService",
    "relay": "laminar.roles.relay:RelayService",
    "rollout": "laminar.roles.rollout.service:RolloutService",
    "trainer": "laminar.roles.trainer.service:TrainerService",
    "trainer_rank": "laminar.roles.trainer.rank:TrainerRankService",  # trainer.ranks: serve
    "sim_trainer": "laminar.roles.trainer.sim:SimTrainerService",  # emulated (sleeps)
}


# Role names -> (the role, ``module:ConfigModel``): what checking a config needs, from modules that
# import neither torch nor vLLM, so ``laminar run`` and ``laminar doctor`` validate every role
# before anything starts without the trainer's imports (which would cost seconds before a typo
# is rejected). A test keeps each equal to its service class's ``role`` and ``config_model``.
BUILTIN_CONFIGS: dict[str, tuple[str, str]] = {
    "manager": ("manager", "laminar.roles.manager.service:ManagerConfig"),
    "data": ("data", "laminar.roles.data.config:DataConfig"),
    "relay": ("relay", "laminar.roles.relay:RelayConfig"),
    "rollout": ("rollout", "laminar.roles.rollout.service:RolloutConfig"),
    "trainer": ("trainer", "laminar.roles.trainer.config:TrainerConfig"),
    "trainer_rank": ("trainer_rank", "laminar.roles.trainer.config:TrainerRankConfig"),
    "sim_trainer": ("sim_trainer", "laminar.roles.trainer.config:SimTrainerConfig"),
}


def builtin_roles() -> dict[str, str]:
    return dict(BUILTIN)


def load_role(spec: str, base_dir: str | Path | None = None) -> type[Service]:
    target = builtin_roles().get(spec, spec)
    if ":" not in target:
        known = ", ".join(sorted(builtin_roles()))
        raise ConfigError(
            f"unknown role {spec!r}: use one of {known}, or module:Class, or path/to/file.py:Class"
        )
    cls = load_object(target, base_dir, what="role")
    if not (isinstance(cls, type) and issubclass(cls, Service)):
        raise ConfigError(
            f"role {spec!r}: {cls!r} is not a laminar.runtime.service.Service subclass"
        )
    return cls


def load_role_config(
    spec: str, base_dir: str | Path | None = None
) -> tuple[str, type[ServiceConfig]]:
    """A role's name and config model: a built-in role's from its light module (its service is not
    imported), any other role's from its class (``module:Class``, ``file.py:Class``)."""
    if spec in BUILTIN_CONFIGS:
        role, where = BUILTIN_CONFIGS[spec]
        model = load_object(where, what="config model")
        assert isinstance(model, type) and issubclass(model, ServiceConfig), where
        return role, model
    cls = load_role(spec, base_dir)
    return cls.role, cls.config_model
