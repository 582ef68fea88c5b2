"""Configuration: validated pydantic models loaded from YAML, ``--set a.b=c`` overrides, secrets
from the environment.

One file describes a cluster. Top-level sections:

* ``cluster`` — what every process shares: heartbeat timing, timeouts, frame limits, logging, and
  *where the token comes from* (an environment variable; the token itself never sits in a file).
* ``run`` — what ``laminar run`` starts on the local machine and for how long.
* one section per role (``manager``, and in later stages ``data``, ``trainer``, ...): that role's
  own settings, validated by the role's ``config_model``.

Every model forbids unknown keys, so a typo is an error that names it rather than a silently
ignored setting. :func:`load_config` turns pydantic's errors into one message per problem, naming
the dotted key, the value found and what was expected.
"""

from __future__ import annotations

import itertools
import math
import os
import re
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
        "LAMINAR_TOKEN",
        description="Environment variable holding the cluster token: >= 16 random characters "
        "(a placeholder, a repeat or a run is refused; `secrets.token_hex(16)` makes a good one).",
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
    rpc_max_in_flight: Annotated[int, Field(gt=0)] = Field(
        64,
        description="Requests one connection may have running at once (an open stream counts). "
        "Beyond that a service reads as many again ahead, then stops reading that connection "
        "until one finishes, so TCP flow control slows the sender instead of memory growing.",
    )
    max_frame_mib: Annotated[int, Field(gt=0, le=16384)] = Field(
        2048,
        description="Largest message frame accepted (fields, token arrays and tensors together); "
        "a sender refuses to send a bigger one (MessageTooLarge), a receiver closes that "
        "connection. The trainer asks for a batch in pieces when it would not fit.",
    )
    max_payload_mib: Annotated[int, Field(gt=0, le=4095)] = Field(
        64,
        description="Largest msgpack part of a frame: the message fields a receiver decodes in "
        "one piece. Token ids, logprobs and tensors travel beside it as raw buffers and count "
        "only against max_frame_mib.",
    )
    peer_timeout_s: PositiveFloat | None = Field(
        None,
        description="A connection whose peer stays silent this long is closed and re-dialled: "
        "unanswered pings, unacknowledged data (TCP_USER_TIMEOUT), failed keepalive probes. "
        "Bounds how long a crashed host or a cut link goes unnoticed. null = 3 x "
        "heartbeat_timeout_s, at least 5 s.",
    )
    nice: Annotated[int, Field(ge=0, le=19)] = Field(
        0,
        description="Niceness `laminar serve` gives a role's own threads once it is ready (0: "
        "leave priorities alone), so they run in the gaps of the compute beside them on a host "
        "(vLLM's CPU engine polls busily between steps) instead of taking turns with it. Not for "
        "the trainer, nor a rollout still on its engine's cores (it feeds that engine), nor a "
        "rollout's engine processes (started before). For hosts that generate and do not train: "
        "beside a trainer the niced data role and relay slow it down (laminar.proc.placement).",
    )
    loop_stall_s: PositiveFloat | None = Field(
        2.0,
        description="`laminar serve` warns when a role's event loop has not turned for this "
        "long (code blocking it: a time.sleep or a CPU-bound loop in an environment or a reward "
        "hook), naming the code that holds it, and again with the stall's length once it "
        "turns (laminar.runtime.loopwatch); from the role's start to its stop. Below "
        "heartbeat_timeout_s, so the warning comes before the member is marked dead. null: no "
        "watch.",
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
        "tail_batching); every role reads it. See laminar/runtime/schedules.py and "
        "docs/schedules.md.",
    )

    @model_validator(mode="after")
    def _timeout_covers_heartbeats(self) -> ClusterConfig:
        if self.heartbeat_timeout_s < 2 * self.heartbeat_interval_s:
            raise ValueError(
                f"heartbeat_timeout_s ({self.heartbeat_timeout_s}) must be at least twice "
                f"heartbeat_interval_s ({self.heartbeat_interval_s})"
            )
        return self

    @model_validator(mode="after")
    def _payload_fits_frame(self) -> ClusterConfig:
        if self.max_payload_mib > self.max_frame_mib:
            raise ValueError(
                f"max_payload_mib ({self.max_payload_mib}) must not exceed max_frame_mib "
                f"({self.max_frame_mib}): the payload is part of a frame"
            )
        return self

    @property
    def peer_timeout(self) -> float:
        """``peer_timeout_s``, or its default from the heartbeat timeout."""
        if self.peer_timeout_s is not None:
            return self.peer_timeout_s
        # the floor: a test cluster's sub-second heartbeats must not make a busy small machine's
        # scheduling hiccups look like dead peers
        return max(3 * self.heartbeat_timeout_s, 5.0)

    def token(self) -> bytes:
        """The cluster token from the environment; a clear error if it is missing, short, a
        placeholder or guessable (:func:`token_problem`)."""
        value = os.environ.get(self.token_env)
        make = (
            f"`export {self.token_env}=$(python -c 'import secrets; print(secrets.token_hex(16))')`"
        )
        if not value:
            raise ConfigError(
                f"no cluster token: set the environment variable {self.token_env} (e.g. {make})"
            )
        problem = token_problem(value)
        if problem is not None:
            raise ConfigError(
                f"the cluster token in {self.token_env} {problem}; make a random one, e.g. {make}"
            )
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
    """What `laminar run` starts on the local machine."""

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
        "(laminar.proc.cpus); off: leave placement to the OS and the engines.",
    )
    plots: bool = Field(True, description="Draw <run_dir>/plots/*.png when the run ends.")


# (section, dotted key) -> where its default comes from when the section leaves it unset: the data
# role checks prompt lengths at load against the rollouts' context length (one over-long prompt
# used to kill every rollout in turn); the trainer publishes in the dtype the rollouts' engines
# run (what they would cast every version to anyway).
DERIVED: dict[tuple[str, str], tuple[str, ...]] = {
    ("data", "max_model_len"): ("rollout", "engine", "max_model_len"),
    ("trainer", "publish.dtype"): ("rollout", "engine", "dtype"),
}


def _nested(key: str, value: Any) -> dict[str, Any]:
    """``a.b.c`` = value as nested mappings."""
    *parents, leaf = key.split(".")
    out: dict[str, Any] = {leaf: value}
    for part in reversed(parents):
        out = {part: out}
    return out


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
        """Validate section ``name`` (plus ``overrides``) against a role's config model.

        A key listed in :data:`DERIVED` that the section leaves unset takes its value from
        another section, so one fact (the rollouts' context length) is written once."""
        data = _deep_merge(self.section(name), overrides or {})
        for (section, key), path in DERIVED.items():
            *parents, leaf = key.split(".")
            place: Any = data
            for part in parents:
                place = place.get(part, {}) if isinstance(place, dict) else None
            if section != name or not isinstance(place, dict) or leaf in place:
                continue
            value: Any = self.section(path[0])
            for part in path[1:]:
                value = value.get(part) if isinstance(value, dict) else None
            if value is not None:
                data = _deep_merge(data, _nested(key, value))
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


# -- token quality ---------------------------------------------------------------------------------

#: Below this many estimated bits a token is refused. Far under what a random token scores and
#: far over what a pattern does ("0123456789abcdef": 5, "abcd" * 4: 8, "1111222233334444": 11).
#: Random tokens score low now and then: for ``secrets.token_hex(8)`` (16 characters) each bit
#: lower is about half as likely, so a bound near 30 refuses a random token once in a while,
#: and at 20 it almost never does (the estimate's distribution: docs/benchmarks.md, *Figures
#: behind code choices*).
MIN_TOKEN_BITS = 20.0

#: Words that mark a value as a placeholder someone forgot to replace (compared lower-cased,
#: separators removed). All have >= 7 letters, so a random token holds one by chance less than
#: once in 10^9 (a hex one never: none is spelt in 0-9a-f).
PLACEHOLDERS = (
    "changeme",
    "replace",
    "example",
    "placeholder",
    "password",
    "yourtoken",
    "tokenhere",
    "goeshere",
)

#: "xxxx" (or longer, or "XXXX") standing as a group of its own: "sk-xxxx", "token-XXXX-XXXX" (a
#: random url-safe token has one by chance about once in 4 million).
_XS = re.compile(r"(?:^|[^A-Za-z0-9])(?:x{4,}|X{4,})(?:[^A-Za-z0-9]|$)")


def _shannon_bits(items: list[int]) -> float:
    """Total Shannon information of ``items`` under their own frequencies (bits)."""
    n = len(items)
    counts: dict[int, int] = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return -sum(c * math.log2(c / n) for c in counts.values())


def token_bits(value: str) -> float:
    """A conservative estimate of a token's entropy in bits, made to catch what people type.

    Taken on the shortest unit the token repeats ("k3J9k3J9k3J9": "k3J9"), it is the smaller of
    the Shannon information of its characters and of the steps between neighbouring characters,
    so repeats ("aaaa"), few symbols ("abab") and runs ("0123456789", "abcdefgh") all score low.
    It cannot see dictionary words: that is what :data:`PLACEHOLDERS` and the length are for."""
    codes = [ord(c) for c in value]
    n = len(codes)
    unit = next((p for p in range(1, n) if n % p == 0 and codes == codes[:p] * (n // p)), n)
    codes = codes[:unit]
    steps = [b - a for a, b in itertools.pairwise(codes)]
    return min(_shannon_bits(codes), _shannon_bits(steps)) if steps else 0.0


def token_problem(value: str) -> str | None:
    """Why ``value`` is not fit to be the cluster token (ending a sentence "the token ..."), or
    None. Shared by every role (:meth:`ClusterConfig.token`), ``laminar run`` and the doctor."""
    if len(value) < 16:
        return f"must be >= 16 characters (it has {len(value)})"
    folded = "".join(c for c in value.lower() if c.isalnum())
    for word in PLACEHOLDERS:
        if word in folded:
            return f"is a placeholder (it contains {word!r}), not a secret"
    if _XS.search(value):
        return "is a placeholder (it contains 'xxxx'), not a secret"
    bits = token_bits(value)
    if bits < MIN_TOKEN_BITS:
        return (
            f"is too easy to guess (a repeat, a run or too few distinct characters: about "
            f"{bits:.0f} bits estimated, {MIN_TOKEN_BITS:.0f} needed)"
        )
    return None
