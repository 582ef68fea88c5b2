"""What a dev-mode run writes is readable by its user only.

The run directory holds the cluster token (in ``token`` and the children's environment), the
logs and the data role's SQLite store. Each test runs under umask 022, the usual default, which
made all of them world-readable: the directory must be 0700 and the files 0600 all the same,
including what the roles themselves create (a real child process making a SQLite file in WAL
mode, as the data role does: ``tests/integration/test_rundir_modes.py``).
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from laminar.devmode.rundir import prepare_run_dir
from laminar.devmode.supervisor import Supervisor
from laminar.runtime.config import load_config


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(autouse=True)
def lax_umask() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def test_run_directories_are_private_new_resumed_or_made_by_hand(tmp_path: Path) -> None:
    real, resumed = prepare_run_dir(tmp_path / "runs" / "latest", "demo")
    assert not resumed and mode(real) == 0o700
    real.chmod(0o755)  # as an older version made it
    again, resumed = prepare_run_dir(tmp_path / "runs" / "latest", "demo", resume=True)
    assert resumed and again == real and mode(real) == 0o700
    by_hand = tmp_path / "empty"
    by_hand.mkdir(mode=0o755)
    used, _ = prepare_run_dir(by_hand, "demo")
    assert used == by_hand.resolve() and mode(by_hand) == 0o700


def test_the_token_file_and_cluster_file_are_private_even_when_they_were_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LAMINAR_TOKEN", raising=False)
    config_file = tmp_path / "run.yaml"
    config_file.write_text(f"run:\n  run_dir: {tmp_path / 'run'}\n  cpus: 'off'\n")
    supervisor = Supervisor(load_config(config_file), [])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "token").write_text("an old token")  # a resumed run's, made 0644
    (run_dir / "token").chmod(0o644)
    supervisor.manager_address = "tcp://127.0.0.1:7420"
    supervisor._write_cluster_file()
    token = run_dir / "token"
    assert token.read_text() == supervisor.env["LAMINAR_TOKEN"]
    assert mode(token) == 0o600
    assert mode(run_dir / "cluster.json") == 0o600
    assert json.loads((run_dir / "cluster.json").read_text())["token_file"] == str(token)


def test_a_reader_polling_for_the_cluster_file_never_sees_it_half_written(tmp_path: Path) -> None:
    """``laminar admin`` and scripts poll for ``cluster.json`` and parse it the moment it exists.
    A reader thread reads it while it is rewritten: every read that finds the file parses, and
    no temporary file stays behind. (Written in place, the file was empty between its open and
    its write, and a fresh-clone CI run read exactly that.)"""
    import threading

    from laminar.devmode.supervisor import _write_private

    path = tmp_path / "cluster.json"
    done = threading.Event()
    seen: list[str] = []

    def reader() -> None:
        while not done.is_set():
            try:
                seen.append(path.read_text())
            except FileNotFoundError:
                pass

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for i in range(2000):
            _write_private(path, json.dumps({"manager": f"tcp://127.0.0.1:{i}", "pad": "x" * 4096}))
    finally:
        done.set()
        thread.join()
    assert seen, "the reader never saw the file"
    assert all(json.loads(text)["manager"].startswith("tcp://") for text in seen)
    assert mode(path) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cluster.json"]


def test_the_data_store_is_owner_only_whatever_the_umask(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`laminar serve --role data` has no supervisor to set a umask: the store sets its mode."""
    import os

    from laminar.roles.data.store import Store

    old = os.umask(0o022)
    try:
        store = Store(tmp_path / "d" / "data.sqlite")
        store.db.execute("CREATE TABLE IF NOT EXISTS t (x)")
        store.db.execute("INSERT INTO t VALUES (1)")
        files = [p for p in (tmp_path / "d").iterdir() if p.name.startswith("data.sqlite")]
        assert {p.name for p in files} >= {"data.sqlite", "data.sqlite-wal", "data.sqlite-shm"}
        assert all(p.stat().st_mode & 0o777 == 0o600 for p in files), {
            p.name: oct(p.stat().st_mode & 0o777) for p in files
        }
        store.close()
    finally:
        os.umask(old)
