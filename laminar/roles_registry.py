"""Resolve a role name to its service class: a built-in name, ``module:Class`` or ``file.py:Class``.

``file.py:Class`` paths are resolved against the directory of the config file, so an example can
ship its own roles beside its ``config.yaml``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

from .errors import ConfigError
from .service import Service


def builtin_roles() -> dict[str, str]:
    from laminar.roles import BUILTIN  # a table of strings: importing it loads no role

    return dict(BUILTIN)


def load_role(spec: str, base_dir: str | Path | None = None) -> type[Service]:
    target = builtin_roles().get(spec, spec)
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        known = ", ".join(sorted(builtin_roles()))
        raise ConfigError(
            f"unknown role {spec!r}: use one of {known}, or module:Class, or path/to/file.py:Class"
        )
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_absolute() and base_dir is not None:
            path = Path(base_dir) / path
        if not path.is_file():
            raise ConfigError(f"role {spec!r}: file {path} does not exist")
        name = f"laminar_user_role_{path.stem}"
        module = sys.modules.get(name)
        if module is None:
            file_spec = importlib.util.spec_from_file_location(name, path)
            assert file_spec is not None and file_spec.loader is not None
            module = importlib.util.module_from_spec(file_spec)
            sys.modules[name] = module
            file_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ConfigError(f"role {spec!r}: cannot import {module_name}: {exc}") from exc
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Service)):
        raise ConfigError(f"role {spec!r}: {attr} is not a laminar.service.Service subclass")
    return cls
