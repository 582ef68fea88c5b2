"""What importing the light modules loads, asked of a fresh interpreter: the runtime, the CLI, the
role contracts and the control plane import no torch or vLLM (the checkers and lists are
``tests/unit/test_layering.py``'s; these start a process, so they are integration tests)."""

from __future__ import annotations

import pytest

from tests.unit.test_layering import (
    TORCH_FREE_ROLES,
    TORCH_FREE_RUNTIME,
    _torch_report,
    heavy_imports,
)


def test_torch_probe_blames_the_module_that_loads_torch() -> None:
    pytest.importorskip("torch")
    found = heavy_imports(["laminar.weights.shared", "laminar.weights.tensors", "no.such.module"])
    assert found["laminar.weights.shared"] == []
    assert found["laminar.weights.tensors"] == ["torch"]
    assert "ModuleNotFoundError" in found["no.such.module"]


# -- the real tree -------------------------------------------------------------------------------


def test_runtime_and_cli_import_no_torch() -> None:
    found = heavy_imports(TORCH_FREE_RUNTIME)
    assert not _torch_report(found), _torch_report(found)


def test_role_contracts_and_control_plane_import_no_torch() -> None:
    found = heavy_imports(TORCH_FREE_ROLES)
    assert not _torch_report(found), _torch_report(found)
