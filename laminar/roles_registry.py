"""Resolve a role name to its service class: a built-in name, ``module:Class`` or ``file.py:Class``.

``file.py:Class`` paths are resolved against the directory of the config file, so an example can
ship its own roles beside its ``config.yaml``.
"""

from __future__ import annotations

from pathlib import Path

from .errors import ConfigError
from .plugins import load_object
from .service import Service

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
        raise ConfigError(f"role {spec!r}: {cls!r} is not a laminar.service.Service subclass")
    return cls
