"""The admin HTTP API's contract: its response models, its routes, and the OpenAPI 3.1 document.

Every route the admin server serves is one :class:`Route` in :data:`ROUTES`; the server registers
its handlers from this table and ``/v1/openapi.json`` is generated from it (schemas from the
pydantic models' ``model_json_schema``), so the document cannot drift from what is served.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model
from pydantic.fields import FieldInfo
from pydantic.json_schema import models_json_schema

from laminar.repack import RepackPlan, RepackPolicy, RolloutLoad
from laminar.roles.data.api import DataStatus
from laminar.roles.rollout.api import RolloutState
from laminar.roles.trainer.api import LEARNING_MAX_POINTS, EvalPoint, VersionPoint

from .events import ClusterEvent
from .repack import RepackOutcome

API_VERSION = "v1"

RolloutStateName = Literal["running", "draining", "switching", "dead", "left", "unknown"]


class ErrorBody(BaseModel):
    """Every error answer: a short message, and what exactly was wrong where it helps."""

    error: str = Field(description="What went wrong, in a few words.")
    detail: Any = Field(None, description="Specifics: pydantic errors for a 422, a cause.")


class RolloutView(BaseModel):
    id: str
    host: str
    address: str
    member_state: str = Field(description="alive, dead or left (membership).")
    state: RolloutStateName = Field(
        description="running: taking prompts; draining: an operator drain; switching: loading "
        "a newer version or migrating; dead/left: not a live member."
    )
    version: int | None = None
    kv_cache_usage: float | None = Field(None, description="Fraction of the KV cache in use.")
    running: int | None = None
    waiting: int | None = None
    in_flight: int | None = None
    generated_tokens: int | None = None
    completed: int | None = None
    last_seen_s: float = Field(description="Seconds since its last heartbeat.")
    incarnation: int = 1


class RelayView(BaseModel):
    id: str
    address: str
    host: str
    member_state: str
    position: int | None = Field(None, description="Place in the chain (0: the master).")
    versions: list[int] | None = Field(None, description="Verified versions it holds.")
    newest: int | None = None


class ChainSummary(BaseModel):
    epoch: int
    order: list[str] = Field(description="Relay instances, master first.")
    reason: str
    changed_at: float


class TrainerView(BaseModel):
    id: str
    version: int
    published: int
    max_staleness: int = Field(description="The largest staleness trained on so far.")
    training: bool


class StalenessSummary(BaseModel):
    trainer_version: int | None = None
    max_trained: int | None = Field(None, description="Largest staleness trained on (trainer).")
    rollout_versions: list[int] = Field(
        default_factory=list, description="Distinct weight versions live rollouts generate with."
    )
    max_lag: int | None = Field(
        None, description="Trainer version minus the oldest live rollout version."
    )


class AdminStatus(BaseModel):
    cluster: str
    manager: str
    now: float = Field(description="The manager's wall clock.")
    rollouts: list[RolloutView]
    relays: list[RelayView]
    chain: ChainSummary
    trainer: TrainerView | None = None
    data: DataStatus | None = None
    staleness: StalenessSummary
    repack_policy: RepackPolicy
    members: dict[str, dict[str, int]] = Field(description="role -> state -> count.")
    last_event: int = Field(description="Sequence number of the newest event.")
    errors: dict[str, str] = Field(
        default_factory=dict, description="Roles that did not answer in time, and why."
    )


class LearningView(BaseModel):
    """The trainer's learning curves: reward, trained tokens/s and staleness per version, and
    held-out accuracy per evaluation."""

    trainer: str | None = Field(None, description="The trainer asked; null: none is alive.")
    version: int | None = Field(None, description="The trainer's newest version.")
    versions: list[VersionPoint] = Field(default_factory=list)
    evals: list[EvalPoint] = Field(default_factory=list)
    errors: dict[str, str] = Field(
        default_factory=dict, description="The trainer, if it did not answer in time, and why."
    )


class PlanView(BaseModel):
    plan: RepackPlan
    loads: list[RolloutLoad] = Field(description="The loads the plan was computed from.")
    policy: RepackPolicy


def _absent_is_unchanged(schema: dict[str, Any]) -> None:
    schema.pop("default", None)  # the None below only marks "not given"; it is no valid value


def _patch_field(field: FieldInfo) -> tuple[Any, FieldInfo]:
    kind: Any = (
        Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
    )
    patched = FieldInfo.from_field(
        None, description=field.description, json_schema_extra=_absent_is_unchanged
    )
    return kind, patched


# A partial policy: every field of RepackPolicy with its type and bounds, none required (built
# from it, so it cannot drift). A field may be left out but not given as null: a document that
# allows null where the server refuses it (422) is what a schema-driven fuzzer finds, and a bound
# the document omits is refused the same way. The handler validates the body against this
# model, so what it refuses and what the document says are one thing.
PolicyPatch: type[BaseModel] = create_model(
    "PolicyPatch",
    __config__=ConfigDict(extra="forbid"),
    __doc__="A partial policy: the given fields are merged onto the current policy (a field left "
    "out keeps its value; null is no value).",
    # ignored below: create_model's overloads take no field dict spread as keywords
    **{name: _patch_field(field) for name, field in RepackPolicy.model_fields.items()},  # type: ignore[call-overload]
)


class DrainBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: str = ""


class RolloutActionResult(BaseModel):
    rollout: str
    action: Literal["drain", "resume"]
    state: RolloutState
    event: int = Field(description="Sequence number of the drain/resume event published.")


class Health(BaseModel):
    ok: bool


# -- routes ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Param:
    name: str
    where: Literal["path", "query", "header"]
    description: str
    schema: dict[str, Any] = field(default_factory=lambda: {"type": "string"})
    required: bool = False


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # aiohttp syntax: /v1/rollouts/{id}/drain
    handler: str  # AdminServer method name
    summary: str
    response: type[BaseModel] | list[type[BaseModel]] | str | None  # str: a media type
    request: type[BaseModel] | None = None
    request_required: bool = False
    errors: tuple[int, ...] = ()
    params: tuple[Param, ...] = ()
    auth: bool = True
    description: str = ""


_ID = Param("id", "path", "A rollout's instance id.", required=True)
_SINCE = Param(
    "since", "query", "Only events after this sequence number.", {"type": "integer", "minimum": 0}
)

ROUTES: tuple[Route, ...] = (
    Route(
        "GET", "/v1/status", "_status", "The whole cluster at a glance", AdminStatus,
        description="Rollouts, relays and the chain, the trainer, the data role's buffer, "
        "staleness and the repack policy. Roles that do not answer within a short timeout "
        "are null (and named in `errors`); this never fails because a role is down.",
    ),
    Route(
        "GET", "/v1/learning", "_learning", "Whether the run learns: its learning curves",
        LearningView, errors=(400,),
        params=(
            Param("since", "query", "Only versions after this one (and evaluations of it and "
                  "later ones); 0, the default: from the oldest the trainer kept.",
                  {"type": "integer", "minimum": 0}),
            Param("limit", "query", f"At most this many versions and evaluations, the newest "
                  f"(default 500, at most {LEARNING_MAX_POINTS}).",
                  {"type": "integer", "minimum": 1, "maximum": LEARNING_MAX_POINTS}),
        ),
        description="Per trained version: the policy's mean reward, tokens trained per second "
        "and the staleness trained on; per held-out evaluation (`trainer.eval`): accuracy. "
        "Asked of the live trainer (the torch one or the emulated one), which keeps what this "
        "process trained; poll with `since` set to the newest version seen for what is new. "
        "No live trainer is an empty answer (`trainer` null), and so is one that does not "
        "answer in time (named in `errors`): never a failure.",
    ),
    Route(
        "GET", "/metrics", "_metrics", "Prometheus metrics of the manager",
        "text/plain; version=0.0.4",
        description="The manager's registry, plus gauges computed at scrape time (rollouts by "
        "state and version, KV-cache use).",
    ),
    Route(
        "GET", "/v1/repack/plan", "_plan", "What a repack would do now (dry run)", PlanView
    ),
    Route(
        "POST", "/v1/repack", "_repack", "Repack now", RepackOutcome,
        description="Plans from the current loads and carries the plan out; returns when every "
        "move is done.",
    ),
    Route("GET", "/v1/repack/policy", "_get_policy", "The repack policy", RepackPolicy),
    Route(
        "PUT", "/v1/repack/policy", "_put_policy", "Change the repack policy (live)",
        RepackPolicy, request=PolicyPatch, request_required=True, errors=(400, 422),
        description="Full or partial: the given fields are merged onto the current policy and "
        "the result is validated as a RepackPolicy (a field may be left out, not given as "
        "null). Applies at once; publishes a `policy` event.",
    ),
    Route(
        "POST", "/v1/rollouts/{id}/drain", "_drain", "Drain a rollout", RolloutActionResult,
        request=DrainBody, errors=(400, 404, 409, 422, 502, 504), params=(_ID,),
        description="The rollout takes no new prompts, finishes what it has and stays idle "
        "until resumed. Publishes a `drain` event. 409 if the rollout is dead or gone.",
    ),
    Route(
        "POST", "/v1/rollouts/{id}/resume", "_resume", "Resume a drained rollout",
        RolloutActionResult, errors=(404, 409, 502, 504), params=(_ID,),
        description="Publishes a `resume` event. 409 if the rollout is dead or gone.",
    ),
    Route(
        "GET", "/v1/events", "_events", "The event log: a Server-Sent Events stream, or JSON",
        "text/event-stream", errors=(400,),
        params=(
            _SINCE,
            Param(
                "format", "query", "`json`: the recent events as a JSON list, then close.",
                {"type": "string", "enum": ["sse", "json"]},
            ),
            Param("limit", "query", "With format=json: at most this many (the newest).",
                  {"type": "integer", "minimum": 1}),
            Param("kind", "query", "With format=json: only these kinds (comma separated)."),
            Param("Last-Event-ID", "header", "SSE resumption: events after this sequence.",
                  {"type": "integer", "minimum": 0}),
            Param("token", "query", "The cluster token, for EventSource (it cannot set headers); "
                  "accepted on this route only."),
        ),
        description="SSE: one message per event, `id:` its sequence number, `event:` its kind, "
        "`data:` the event as JSON; a comment line every ~15 s keeps the connection open. "
        "Reconnecting with `Last-Event-ID` (or `?since=`) resumes after that event while it is "
        "still in the manager's window (a gap in the ids tells a reader it fell behind).",
    ),
    Route(
        "GET", "/v1/openapi.json", "_openapi", "This document", "application/json", auth=False
    ),
    Route("GET", "/healthz", "_healthz", "Liveness of the admin server", Health, auth=False),
    Route("GET", "/", "_index", "The dashboard (HTML)", "text/html", auth=False),
)  # fmt: skip

#: schemas referenced outside the routes' own models
_EXTRA: list[type[BaseModel]] = [ErrorBody, ClusterEvent]

_ERROR_TEXT = {
    400: "Malformed JSON body",
    401: "Missing or wrong bearer token",
    404: "Unknown route or rollout",
    405: "Method not allowed",
    409: "The rollout is dead or gone",
    422: "Validation failed (pydantic errors in `detail`)",
    502: "The role answered with an error or is unreachable",
    504: "The role did not answer in time",
}


def _schema_ref(model: type[BaseModel]) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def openapi_document(server_url: str | None = None) -> dict[str, Any]:
    models: list[type[BaseModel]] = list(_EXTRA)
    for route in ROUTES:
        for m in (route.request, route.response):
            if isinstance(m, type) and issubclass(m, BaseModel) and m not in models:
                models.append(m)
    _, top = models_json_schema(
        [(m, "serialization") for m in models], ref_template="#/components/schemas/{model}"
    )
    schemas = top.get("$defs", {})
    paths: dict[str, dict[str, Any]] = {}
    for route in ROUTES:
        op: dict[str, Any] = {
            "operationId": route.handler.strip("_") or "index",
            "summary": route.summary,
            "responses": {},
        }
        if route.description:
            op["description"] = route.description
        if route.params:
            op["parameters"] = [
                {
                    "name": p.name,
                    "in": p.where,
                    "description": p.description,
                    "required": p.required or p.where == "path",
                    "schema": p.schema,
                }
                for p in route.params
            ]
        if route.request is not None:
            op["requestBody"] = {
                "required": route.request_required,
                "content": {"application/json": {"schema": _schema_ref(route.request)}},
            }
        if isinstance(route.response, type):
            content = {"application/json": {"schema": _schema_ref(route.response)}}
        elif route.response == "text/event-stream":
            content = {
                "text/event-stream": {"schema": {"type": "string"}},
                "application/json": {
                    "schema": {"type": "array", "items": _schema_ref(ClusterEvent)}
                },
            }
        elif route.response == "application/json":  # a JSON document of no fixed model
            content = {"application/json": {"schema": {"type": "object"}}}
        else:
            content = {str(route.response): {"schema": {"type": "string"}}}
        op["responses"]["200"] = {"description": "OK", "content": content}
        codes = set(route.errors) | {405}
        if route.auth:
            codes.add(401)
            op["security"] = [{"bearer": []}]
        else:
            op["security"] = []
        for code in sorted(codes):
            op["responses"][str(code)] = {
                "description": _ERROR_TEXT[code],
                "content": {"application/json": {"schema": _schema_ref(ErrorBody)}},
            }
        path = paths.setdefault(route.path, {})
        path[route.method.lower()] = op
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "Laminar manager admin API",
            "version": API_VERSION,
            "description": "Operate a Laminar cluster: status, repack, rollout drain/resume, the "
            "event stream and metrics. Authenticate with the cluster token as a bearer token "
            "(`Authorization: Bearer <token>`). The dashboard page (`/`, `/dashboard/*`), this "
            "document and `/healthz` need no token; `/v1/events` also accepts `?token=` "
            "because a browser's EventSource cannot set headers.",
        },
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }
    if server_url:
        doc["servers"] = [{"url": server_url}]
    return doc
