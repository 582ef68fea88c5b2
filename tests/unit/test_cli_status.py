"""``laminar status`` and ``laminar repack`` where there is nothing to talk to: one clear line and
exit status 2, never a traceback (both were seen on 2026-11-29, after a run had ended)."""

from __future__ import annotations

import json
import secrets
import socket
from pathlib import Path

import pytest

from laminar.cli import main


def _ended_run(tmp_path: Path) -> Path:
    """A run directory whose manager is gone: its cluster.json names a port nobody listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "token").write_text(secrets.token_hex(16))
    info = {"manager": f"tcp://127.0.0.1:{port}", "token_file": str(tmp_path / "token")}
    (tmp_path / "cluster.json").write_text(json.dumps(info))
    return tmp_path


@pytest.mark.parametrize("command", [["status"], ["repack", "policy"]])
def test_a_run_that_ended_is_named_as_such(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], command
) -> None:
    run = _ended_run(tmp_path)
    monkeypatch.delenv("LAMINAR_TOKEN", raising=False)  # the run directory's token is used
    assert main([*command, "--run-dir", str(run), "--timeout", "2"]) == 2
    err = capsys.readouterr().err
    assert (
        f"no manager answers at {json.loads((run / 'cluster.json').read_text())['manager']}" in err
    )
    assert "that run has ended" in err and str(run / "cluster.json") in err


def test_a_token_no_cluster_could_have_is_refused_before_any_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The transport's handshake needs 16 bytes at least: a shorter token raised ValueError from
    deep inside the RPC client, with a traceback."""
    run = _ended_run(tmp_path)
    monkeypatch.setenv("LAMINAR_TOKEN", "short")
    assert main(["status", "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert "LAMINAR_TOKEN has 5 characters" in err and "at least 16" in err
    assert "Traceback" not in err
