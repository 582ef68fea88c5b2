"""Resolve a plug-in named ``module:attr`` or ``path/to/file.py:attr`` to the object it names.

Roles, reward functions and buffer policies are all named this way in configs. A ``file.py`` path
is resolved against ``base_dir`` when one is given (the config file's directory, so an example can
ship code beside its ``config.yaml``), else against the working directory. A file is imported once
per process under a name derived from its absolute path.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from .runtime.errors import ConfigError


def load_object(spec: str, base_dir: str | Path | None = None, *, what: str = "plug-in") -> Any:
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise ConfigError(f"{what} {spec!r}: expected 'module:name' or 'path/to/file.py:name'")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_absolute() and base_dir is not None:
            path = Path(base_dir) / path
        path = path.resolve()
        if not path.is_file():
            raise ConfigError(f"{what} {spec!r}: file {path} does not exist")
        digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
        name = f"laminar_plugin_{path.stem}_{digest}"
        module = sys.modules.get(name)
        if module is None:
            file_spec = importlib.util.spec_from_file_location(name, path)
            assert file_spec is not None and file_spec.loader is not None
            module = importlib.util.module_from_spec(file_spec)
            sys.modules[name] = module
            try:
                file_spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]
                raise
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise ConfigError(f"{what} {spec!r}: cannot import {target}: {exc}") from exc
    obj = getattr(module, attr, None)
    if obj is None:
        raise ConfigError(f"{what} {spec!r}: {target} has no attribute {attr!r}")
    return obj
