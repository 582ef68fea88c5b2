"""A built-in role's config is validated from a light module, and that module is the role's own.

Why: ``laminar run`` and ``laminar doctor`` validate every role's section before anything starts.
Loading the service classes for that imported torch and transformers through the trainer (11 s
to reject a typo in a config, measured); ``BUILTIN_CONFIGS`` names each role's config model in a
module that imports neither. These tests keep that table equal to the classes it stands for;
``tests/integration/test_roles_registry.py`` proves the supervisor's whole set-up imports no torch.
"""

from __future__ import annotations

import pytest

from laminar.roles_registry import BUILTIN, BUILTIN_CONFIGS, load_role, load_role_config
from laminar.runtime.errors import ConfigError


def test_every_builtin_role_has_a_light_config_that_is_its_services() -> None:
    assert set(BUILTIN_CONFIGS) == set(BUILTIN)
    for name in BUILTIN:
        cls = load_role(name)
        assert load_role_config(name) == (cls.role, cls.config_model), name


def test_a_role_of_ones_own_is_read_from_its_class() -> None:
    role, model = load_role_config("tests.support.roles:Calculator")
    cls = load_role("tests.support.roles:Calculator")
    assert (role, model) == (cls.role, cls.config_model)
    with pytest.raises(ConfigError, match="unknown role"):
        load_role_config("no_such_role")
