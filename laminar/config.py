"""Configuration: validated pydantic models loaded from YAML, ``--set a.b=c`` overrides, secrets
from the environment.

One file describes a cluster. Top-level sections:

* ``cluster`` — what every process shares: heartbeat timing, timeouts, frame limits, logging, and
  *where the token comes from* (an environment variable; the token itself never sits in a file).
* ``run`` — what ``laminar run`` starts on this machine and for how long.
* one section per role (``manager``, and in later stages ``data``, ``trainer``, ...): that role's
  own settings, validated by the role's ``config_model``.

Every model forbids unknown keys, so a typo is an error that names it rather than a silently
ignored setting. :func:`load_config` turns pydantic's errors into one message per problem, naming
the dotted key, the value found and what was expected.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import ConfigError
from .schedules import ScheduleConfig

PositiveFloat = Annotated[float, Field(gt=0)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ClusterConfig(Strict):
    name: str = Field(
        "laminar", description="Cluster name, shown by `laminar status` and the admin API."
    )
    manager: str | None = Field(
        None, description="Address of the manager to join (tcp://host:port); set by `--join`."
    )
    token_env: str = Field(
        "LAMINAR_TOKEN", description="Environment variable holding the cluster token (>= 16 chars)."
    )
    heartbeat_interval_s: PositiveFloat = Field(
        0.5, description="How often each member heartbeats to the manager."
    )
    heartbeat_timeout_s: PositiveFloat = Field(
        3.0, description="A member silent this long is marked dead."
    )
    rpc_timeout_s: PositiveFloat = Field(
        30.0, description="Default timeout of a remote call (calls may set their own)."
    )
    handshake_timeout_s: PositiveFloat = Field(
        5.0, description="A new connection must finish the token handshake within this."
    )
    max_frame_mib: Annotated[int, Field(gt=0, le=16384)] = Field(
        2048, description="Largest message frame accepted; a bigger one closes that connection."
    )
    log_format: Literal["console", "json"] = Field(
        "console", description="console: readable (dev); json: one object per line (production)."
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Minimum level logged."
    )
    schedule: ScheduleConfig = Field(
        default_factory=ScheduleConfig,
        description="How generation and training interleave (laminar, sync, one_step, "
        "tail_batching); every role reads it. See laminar/schedules.py and docs/schedules.md.",
    )

    @model_validator(mode="after")
    def _timeout_covers_heartbeats(self) -> ClusterConfig:
        if self.heartbeat_timeout_s < 2 * self.heartbeat_interval_s:
            raise ValueError(
                f"heartbeat_timeout_s ({self.heartbeat_timeout_s}) must be at least twice "
                f"heartbeat_interval_s ({self.heartbeat_interval_s})"
            )
        return self

    def token(self) -> bytes:
        """The cluster token from the environment; a clear error if it is missing or short."""
        value = os.environ.get(self.token_env)
        if not value:
            raise ConfigError(
                f"no cluster token: set the environment variable {self.token_env} "
                f"(e.g. `export {self.token_env}=$(python -c 'import secrets; "
                f"print(secrets.token_hex(16))')`)"
            )
        if len(value) < 16:
            raise ConfigError(f"the cluster token in {self.token_env} must be >= 16 characters")
        return value.encode()


class ServiceConfig(Strict):
    """Settings every role has: where it listens for RPC and for Prometheus scrapes."""

    bind: str = Field("tcp://127.0.0.1:0", description="RPC listen address (port 0 = any).")
    metrics: str | None = Field(
        "127.0.0.1:0", description="host:port for the Prometheus /metrics endpoint; null = off."
    )
    instance: str | None = Field(None, description="Instance id; default: assigned at join.")


class RoleSpec(Strict):
    """One line of ``run.roles``: which role, how many processes, and what to do when one dies."""

    role: str = Field(description="A built-in role name or `module:Class` / `path.py:Class`.")
    count: Annotated[int, Field(ge=1, le=256)] = Field(1, description="Processes of this role.")
    restart: Literal["never", "on-failure", "always"] = Field(
        "on-failure", description="When `laminar run` restarts a process that exited."
    )
    max_restarts: Annotated[int, Field(ge=0)] = Field(
        3, description="Restarts per process before `laminar run` gives up on it."
    )
    config: dict[str, Any] = Field(default_factory=dict, description="Overrides of the section.")
    section: str | None = Field(None, description="Config section (default: the role's name).")


class RunConfig(Strict):
    """What `laminar run` starts on this machine."""

    roles: list[RoleSpec] = Field(
        default_factory=lambda: [RoleSpec(role="manager")],
        description="The processes to start, in order (the manager first).",
    )
    duration_s: PositiveFloat | None = Field(
        None, description="Stop everything after this long (the run's budget); null = until ^C."
    )
    run_dir: str = Field(
        "runs/latest", description="Where the run writes cluster.json, the token file and logs."
    )
    shutdown_grace_s: PositiveFloat = Field(
        10.0,
        description="Seconds between SIGTERM and SIGKILL for a child's processes: at shutdown, "
        "and for what a child that exited left behind (e.g. a killed rollout's vLLM engine).",
    )
    view_interval_s: PositiveFloat = Field(
        1.0, description="Seconds between refreshes of the live progress display."
    )
    progress_interval_s: PositiveFloat = Field(
        10.0, description="Seconds between progress lines when the output is not a terminal."
    )
    display: Literal["auto", "live", "lines", "logs"] = Field(
        "auto",
        description="live: a panel redrawn in place (auto on a terminal); lines: a progress line "
        "every progress_interval_s (auto otherwise); logs: also every child's output. Children's "
        "output always goes to <run_dir>/logs/.",
    )
    cpus: Literal["auto", "off"] = Field(
        "auto",
        description="auto: divide this machine's cores between rollouts and the trainer "
        "(laminar.cpus); off: leave placement to the OS and the engines.",
    )
    plots: bool = Field(True, description="Draw <run_dir>/plots/*.png when the run ends.")


class LaminarConfig(BaseModel):
    """A whole cluster's configuration. Role sections are kept raw and validated per role."""

    model_config = ConfigDict(extra="allow")

    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    source: str | None = Field(None, exclude=True)

    def section(self, name: str) -> dict[str, Any]:
        extra = self.model_extra or {}
        value = extra.get(name, {})
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ConfigError(
                f"{self._where()}: section {name!r} must be a mapping, got {type(value).__name__}"
            )
        return value

    def role_config(
        self, name: str, model: type[Strict], overrides: dict[str, Any] | None = None
    ) -> Any:
        """Validate section ``name`` (plus ``overrides``) against a role's config model."""
        data = _deep_merge(self.section(name), overrides or {})
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(_describe(exc, self._where(), prefix=name)) from None

    def _where(self) -> str:
        return self.source or "<config>"


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Apply ``a.b.c=value`` to nested ``data`` in place; the value is parsed as YAML."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set expects key=value, got {assignment!r}")
    path = key.strip().split(".")
    value = yaml.safe_load(raw) if raw.strip() else None
    node: Any = data
    for i, part in enumerate(path[:-1]):
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"--set {key}: {'.'.join(path[:i])} has no item {part}")
            node = node[int(part)]
            continue
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
        if not isinstance(nxt, (dict, list)):
            raise ConfigError(f"--set {key}: {'.'.join(path[: i + 1])} is a value, not a section")
        node = nxt
    last = path[-1]
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise ConfigError(f"--set {key}: no item {last}")
        node[int(last)] = value
    else:
        node[last] = value


def _describe(exc: ValidationError, where: str, prefix: str = "") -> str:
    lines = [f"invalid configuration in {where}:"]
    for err in exc.errors():
        key = ".".join(str(p) for p in (prefix, *err["loc"]) if p != "")
        if err["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key (value {err['input']!r})")
        elif err["type"] == "missing":
            lines.append(f"  {key}: required, but missing")
        else:
            found = err.get("input")
            shown = repr(found) if not isinstance(found, dict) else "a mapping"
            lines.append(f"  {key or '(top level)'} = {shown}: {err['msg']}")
    return "\n".join(lines)


def load_config(
    path: str | os.PathLike[str] | None, overrides: list[str] | None = None
) -> LaminarConfig:
    """Read a YAML file (defaults if ``path`` is None) and apply ``--set`` overrides."""
    where = str(path) if path is not None else "<defaults>"
    data: Any = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {where} does not exist")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{where} is not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: the top level must be a mapping of sections")
    for assignment in overrides or []:
        apply_override(data, assignment)
    try:
        config = LaminarConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, where)) from None
    config.source = str(Path(path).resolve()) if path is not None else None
    return config


def new_token() -> str:
    return secrets.token_hex(16)
