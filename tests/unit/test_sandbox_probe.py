"""``check_sandbox`` answers with a reason, never an exception: ``laminar doctor`` and ``make run``
(which picks its example by ``python -m laminar.tools.sandbox``) ask it on machines where the
jail cannot even start."""

from __future__ import annotations

import pytest

from laminar.tools import sandbox


def test_a_jail_that_cannot_start_is_a_reason_and_exit_status_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def refused(python: str) -> object:
        raise PermissionError(13, "Permission denied", python)

    monkeypatch.setattr(sandbox.JailServer, "get", staticmethod(refused))
    problem = sandbox.check_sandbox()
    assert problem is not None and "did not start" in problem and "Permission denied" in problem
    assert sandbox.main() == 1
    assert "cannot be sandboxed here" in capsys.readouterr().out


def test_a_sandbox_that_runs_is_exit_status_0(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sandbox, "check_sandbox", lambda: None)
    assert sandbox.main() == 0
    assert "can be sandboxed here" in capsys.readouterr().out
