"""``docs/admin-api.md``, rendered from the admin server's route table (:data:`openapi.ROUTES`).

Why generated: the endpoint table and the per-route examples come from the same ``ROUTES`` the
server registers its handlers from, so the page cannot list a route the server lacks or miss one
it serves. The prose around them (authentication, events, errors, the CLI) is written here, beside
the table, so one command regenerates the whole page:
``python -m laminar.roles.manager.openapi_doc > docs/admin-api.md`` (``--check FILE`` exits 1 when
the file is stale; the unit tests check it too).
"""

from __future__ import annotations

from typing import get_args

from laminar.config_reference import generator_main

from .events import EVENT_KINDS, EventKind
from .openapi import _ERROR_TEXT, ROUTES, Route

REGENERATE = "python -m laminar.roles.manager.openapi_doc > docs/admin-api.md"

# One example per route, keyed like the table ("METHOD path"). render() fails on a route without
# one, so a new route cannot land undocumented.
EXAMPLES: dict[str, str] = {
    "GET /v1/status": (
        'curl -s -H "$AUTH" $ADMIN/v1/status | jq ".rollouts[] | {id, state, version}"'
    ),
    "GET /v1/learning": (
        'curl -s -H "$AUTH" "$ADMIN/v1/learning?limit=20" | jq ".versions[] | {version, reward}"\n'
        'curl -s -H "$AUTH" "$ADMIN/v1/learning?since=120" | jq ".evals"   # what is new after 120'
    ),
    "GET /metrics": 'curl -s -H "$AUTH" $ADMIN/metrics | grep laminar_',
    "GET /v1/repack/plan": "curl -s -H \"$AUTH\" $ADMIN/v1/repack/plan | jq '.plan.moves'",
    "POST /v1/repack": 'curl -s -X POST -H "$AUTH" $ADMIN/v1/repack',
    "GET /v1/repack/policy": 'curl -s -H "$AUTH" $ADMIN/v1/repack/policy',
    "PUT /v1/repack/policy": (
        'curl -s -X PUT -H "$AUTH" -H "Content-Type: application/json" \\\n'
        '     -d \'{"period_s": 2, "c_max": 0.95}\' $ADMIN/v1/repack/policy'
    ),
    "POST /v1/rollouts/{id}/drain": (
        'curl -s -X POST -H "$AUTH" -H "Content-Type: application/json" \\\n'
        '     -d \'{"reason": "node maintenance"}\' $ADMIN/v1/rollouts/rollout-0/drain'
    ),
    "POST /v1/rollouts/{id}/resume": (
        'curl -s -X POST -H "$AUTH" $ADMIN/v1/rollouts/rollout-0/resume'
    ),
    "GET /v1/events": (
        'curl -sN -H "$AUTH" $ADMIN/v1/events                      # SSE, until ^C\n'
        'curl -sN -H "$AUTH" -H "Last-Event-ID: 120" $ADMIN/v1/events  # resume after event 120\n'
        'curl -s -H "$AUTH" "$ADMIN/v1/events?format=json&kind=repack,publish&limit=20"'
    ),
    "GET /v1/openapi.json": "curl -s $ADMIN/v1/openapi.json | jq '.paths | keys'",
    "GET /healthz": "curl -s $ADMIN/healthz",
    "GET /": 'xdg-open "$ADMIN/?token=$LAMINAR_TOKEN"   # the dashboard, in a browser',
}

PREAMBLE = """\
# Admin HTTP API

<!-- Generated from the admin server's route table by `{regen}`.
     Do not edit by hand: tests/unit/test_config_reference.py fails when this file is stale. -->

The manager serves a small HTTP API for operators, the dashboard and the CLI, at `manager.admin`
(default `127.0.0.1:7421`; port 0 picks a free port; `null` turns it off). Its member record
advertises the URL as `endpoints["admin"]`, which is how `laminar status` and `laminar repack`
find it. The machine-readable contract is the OpenAPI 3.1 document at `/v1/openapi.json`,
generated from the same route table as this page (`roles/manager/openapi.py`). How repack works,
and what the dashboard shows, is in [repack.md](repack.md).

The examples below assume:

```bash
export ADMIN=http://127.0.0.1:7421
export AUTH="Authorization: Bearer $LAMINAR_TOKEN"
```

## Authentication

The bearer token is the **cluster token** (the value of `$LAMINAR_TOKEN`, or whatever variable
`cluster.token_env` names); the server compares it in constant time and answers 401 with
`WWW-Authenticate: Bearer` when it is missing or wrong. Routes marked *open* below need no token:
they carry no cluster data (the dashboard page and its static files under `/dashboard/`, the
OpenAPI document, `/healthz`). A browser's `EventSource` cannot set headers, so `/v1/events`, and
only it, also accepts the token as `?token=`. The dashboard takes `?token=` once, keeps it in
`sessionStorage` and sends it as a bearer token from then on.

The server binds loopback by default. To reach it from elsewhere set `manager.admin` to
`0.0.0.0:7421` (Kubernetes: behind the Service in `examples/deploy/k8s/`) and keep the token
secret; the API has no TLS of its own, so put it behind a TLS-terminating proxy or an SSH tunnel
on untrusted networks.

## Endpoints
"""

EVENTS = """\
## Events and resumption

`GET /v1/events` streams the manager's event log as Server-Sent Events: one message per event,
`id:` its sequence number, `event:` its kind, `data:` the event as JSON
(`{{"seq", "at", "kind", "data"}}`; `at` is the manager's wall clock). A comment line every ~15 s
keeps idle connections open through proxies.

| kind | when |
|---|---|
{kinds}

**Resumption.** Sequence numbers increase by one per event. A client that reconnects with
`Last-Event-ID: N` (browsers send it automatically) or `?since=N` gets every event after `N` that
is still in the manager's window (the newest 2000), then new ones as they happen. A reader that
fell behind the window sees a gap in the ids: that is how it knows it missed events, and it should
re-read `/v1/status`. A slow reader never slows the manager.

`?format=json` returns the recent events as one JSON list and closes (`limit=` the newest N,
`kind=` a comma-separated filter), for scripts that poll instead of streaming.

## Errors

Every error is JSON, `{{"error": "...", "detail": ...}}`: `error` says what went wrong in a few
words, `detail` carries specifics where they help (pydantic's errors for a 422, the cause of a
502). A wrong method gets 405 on every route, a missing token 401 on every authenticated route.

```json
{{
  "error": "invalid policy",
  "detail": [
    {{"field": "c_max", "message": "Input should be less than or equal to 1",
     "type": "less_than_equal", "input": 1.5}}
  ]
}}
```

| status | meaning |
|---|---|
{errors}

## CLI equivalents

The CLI talks to the same API. It finds the manager with `--join tcp://HOST:7420` (or the
`runs/latest/cluster.json` that `laminar run` writes), reads the admin URL from the manager's
member record (`--admin URL` overrides it) and the token from `$LAMINAR_TOKEN`.

| command | route |
|---|---|
| `laminar status` | `GET /v1/status` (plus the membership table over RPC) |
| `laminar status --admin $ADMIN --json` | `GET /v1/status`, raw |
| `laminar repack --dry-run` | `GET /v1/repack/plan` |
| `laminar repack` | `POST /v1/repack` |
| `laminar repack policy` | `GET /v1/repack/policy` |
| `laminar repack policy --period 2 --c-max 0.95 --batch-limit 48` | `PUT /v1/repack/policy` |
| `laminar repack policy --disable` / `--enable` | `PUT /v1/repack/policy` (`enabled`) |

Every command takes `--json` for machine-readable output and `--timeout S`.
"""


def _key(route: Route) -> str:
    return f"{route.method} {route.path}"


def endpoint_rows() -> list[tuple[str, str, str, str]]:
    """(method and path, auth, summary, error statuses) per route, in the server's order."""
    rows = []
    for r in ROUTES:
        codes = sorted(set(r.errors) | {405} | ({401} if r.auth else set()))
        rows.append(
            (f"`{_key(r)}`", "token" if r.auth else "open", r.summary, ", ".join(map(str, codes)))
        )
    return rows


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render() -> str:
    missing = [_key(r) for r in ROUTES if _key(r) not in EXAMPLES]
    if missing:
        raise ValueError(f"routes without an example in openapi_doc.EXAMPLES: {missing}")
    out = [PREAMBLE.format(regen=REGENERATE)]
    table = ["| route | auth | what | error statuses |", "|---|---|---|---|"]
    table += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in endpoint_rows()]
    out.append("\n".join(table) + "\n")
    for r in ROUTES:
        out.append(f"### `{_key(r)}`\n")
        out.append(f"{r.summary}." + (f" {r.description}" if r.description else "") + "\n")
        if r.params:
            out.append(
                "\n".join(f"* `{p.name}` ({p.where}): {p.description}" for p in r.params) + "\n"
            )
        if r.request is not None:
            body = "required" if r.request_required else "optional"
            out.append(f"Request body ({body}): `{r.request.__name__}`.\n")
        resp = r.response
        if isinstance(resp, type):
            out.append(f"Response: `{resp.__name__}` (JSON).\n")
        elif isinstance(resp, str):
            out.append(f"Response: `{resp}`.\n")
        out.append(f"```bash\n{EXAMPLES[_key(r)]}\n```\n")
    undocumented = [k for k in get_args(EventKind) if k not in EVENT_KINDS]
    if undocumented:
        raise ValueError(f"event kinds without a line in events.EVENT_KINDS: {undocumented}")
    kinds = "\n".join(f"| `{k}` | {EVENT_KINDS[k]} |" for k in get_args(EventKind))
    errors = "\n".join(f"| {code} | {text} |" for code, text in sorted(_ERROR_TEXT.items()))
    out.append(EVENTS.format(kinds=kinds, errors=errors))
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    return generator_main(__doc__, render, REGENERATE, argv)


if __name__ == "__main__":
    raise SystemExit(main())
