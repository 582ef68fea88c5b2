"""The cluster token is refused when it is a placeholder or guessable, and never when random.

The Kubernetes example once shipped ``REPLACE-WITH-A-RANDOM-TOKEN-OF-32-HEX-CHARS``: 43 characters,
so the length check let it through, and `kubectl apply` installed it. Every role reads the token
through :meth:`ClusterConfig.token`; ``laminar run`` checks a token it is given before it starts
anything.
"""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from laminar.devmode.supervisor import Supervisor
from laminar.runtime.config import ClusterConfig, load_config, new_token, token_problem
from laminar.runtime.errors import ConfigError
from tests.support.procs import TOKEN

REFUSED = {
    "REPLACE-WITH-A-RANDOM-TOKEN-OF-32-HEX-CHARS": "placeholder",  # the old k8s example's
    "changeme-changeme-changeme": "placeholder",
    "Change_Me_Before_Production!": "placeholder",
    "<your-token-here>": "placeholder",
    "an-example-cluster-token": "placeholder",
    "token-xxxx-xxxx-xxxx": "placeholder",
    "XXXXXXXXXXXXXXXXXXXXXXXX": "placeholder",
    "a" * 32: "guess",  # a repeat
    "abababababababababab": "guess",  # two symbols
    "k3J9k3J9k3J9k3J9k3J9": "guess",  # a repeated unit
    "0123456789abcdef": "guess",  # a run
    "abcdefghijklmnopqrstuvwxyz": "guess",
    "1111222233334444": "guess",
    "short": ">= 16 characters",
}


@pytest.mark.parametrize(("token", "why"), REFUSED.items())
def test_placeholders_and_guessable_tokens_are_refused_with_how_to_make_one(
    token: str, why: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LAMINAR_TOKEN", token)
    with pytest.raises(ConfigError) as err:
        ClusterConfig().token()
    message = str(err.value)
    assert "LAMINAR_TOKEN" in message and "secrets.token_hex(16)" in message, message
    assert why in message, message


def test_a_random_token_a_ci_run_drew_is_accepted() -> None:
    # secrets.token_hex(8) once drew this (seven 7s): 29 estimated bits, refused under the old
    # bound of 30 (a fresh-clone CI run, 2026-11-24)
    assert token_problem("7707a7d77a77d702") is None


def test_random_tokens_of_every_usual_kind_are_accepted() -> None:
    makers = [
        lambda: secrets.token_hex(16),  # what the messages and docs recommend
        lambda: secrets.token_hex(8),  # 16 characters, the shortest allowed
        lambda: secrets.token_urlsafe(32),
        lambda: secrets.token_urlsafe(12),
        new_token,  # what `laminar run` makes
    ]
    for make in makers:
        for _ in range(2000):
            token = make()
            assert token_problem(token) is None, token


def test_the_test_suites_token_and_a_memorable_phrase_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for token in (TOKEN, "correct-horse-battery-staple"):
        monkeypatch.setenv("LAMINAR_TOKEN", token)
        assert ClusterConfig().token() == token.encode()


def test_laminar_run_refuses_a_weak_token_before_starting_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(f"run:\n  run_dir: {tmp_path / 'run'}\n  cpus: 'off'\n")
    monkeypatch.setenv("LAMINAR_TOKEN", "REPLACE-WITH-A-RANDOM-TOKEN-OF-32-HEX-CHARS")
    with pytest.raises(ConfigError, match="placeholder"):
        Supervisor(load_config(config), [])
    assert not (tmp_path / "run").exists()
    monkeypatch.delenv("LAMINAR_TOKEN")
    made = Supervisor(load_config(config), []).env["LAMINAR_TOKEN"]  # none given: one is made
    assert token_problem(made) is None
