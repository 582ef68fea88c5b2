from __future__ import annotations

import pytest

from laminar.runtime.config import ServiceConfig, apply_override, load_config
from laminar.runtime.errors import ConfigError


def write(tmp_path, text: str):  # type: ignore[no-untyped-def]
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_defaults_and_overrides(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = write(tmp_path, "cluster:\n  name: demo\nmanager:\n  bind: tcp://127.0.0.1:9\n")
    cfg = load_config(
        path,
        [
            "cluster.heartbeat_timeout_s=7",
            "manager.metrics=null",
            "run.roles=[{role: manager}, {role: x.py:Y, count: 3}]",
        ],
    )
    assert cfg.cluster.name == "demo" and cfg.cluster.heartbeat_timeout_s == 7.0
    assert cfg.section("manager") == {"bind": "tcp://127.0.0.1:9", "metrics": None}
    assert [r.count for r in cfg.run.roles] == [1, 3]
    svc = cfg.role_config("manager", ServiceConfig, {"instance": "m0"})
    assert (svc.bind, svc.metrics, svc.instance) == ("tcp://127.0.0.1:9", None, "m0")


def test_errors_name_key_value_and_expectation(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = write(tmp_path, "cluster:\n  heartbeat_interval_s: -1\n  tokn_env: X\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    text = str(info.value)
    assert str(path) in text
    assert "cluster.heartbeat_interval_s = -1: Input should be greater than 0" in text
    assert "cluster.tokn_env: unknown key" in text


def test_cross_field_rule(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match="at least twice"):
        load_config(
            write(tmp_path, "cluster:\n  heartbeat_interval_s: 2\n  heartbeat_timeout_s: 3\n")
        )


def test_role_section_errors_are_prefixed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = load_config(write(tmp_path, "manager:\n  bnd: tcp://x:1\n"))
    with pytest.raises(ConfigError, match=r"manager\.bnd: unknown key"):
        cfg.role_config("manager", ServiceConfig)


@pytest.mark.parametrize("bad", ["novalue", "=3", "run.roles.9.count=1"])
def test_bad_overrides(bad) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError):
        apply_override({"run": {"roles": []}}, bad)


def test_missing_file_and_bad_yaml(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "a: [1, 2\n"))


def test_token_from_environment(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    cfg = load_config(None)
    monkeypatch.delenv("LAMINAR_TOKEN", raising=False)
    with pytest.raises(ConfigError, match="LAMINAR_TOKEN"):
        cfg.cluster.token()
    monkeypatch.setenv("LAMINAR_TOKEN", "short")
    with pytest.raises(ConfigError, match=">= 16"):
        cfg.cluster.token()
    monkeypatch.setenv("LAMINAR_TOKEN", "9c4f1e7a2b8d3f6051e2")
    assert cfg.cluster.token() == b"9c4f1e7a2b8d3f6051e2"


def test_data_takes_the_rollouts_context_length_unless_set(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from laminar.roles.data.service import DataConfig

    body = "data:\n  prompts: p.jsonl\n  tokenizer: tok\n  reward: r:f\n{extra}rollout:\n  engine:\n    backend: sim\n    max_model_len: 300\n"
    derived = load_config(write(tmp_path, body.format(extra=""))).role_config("data", DataConfig)
    assert derived.max_model_len == 300
    own = load_config(write(tmp_path, body.format(extra="  max_model_len: 200\n")))
    assert own.role_config("data", DataConfig).max_model_len == 200
    alone = load_config(
        write(tmp_path, "data:\n  prompts: p.jsonl\n  tokenizer: tok\n  reward: r:f\n")
    )
    assert alone.role_config("data", DataConfig).max_model_len is None
