"""The admin API against its own OpenAPI document: schema-driven fuzzing of a live manager.

Schemathesis generates requests from ``/v1/openapi.json`` (valid ones and, for the operations
that take input, invalid ones) and checks every answer: no 5xx, a documented status code,
content type and headers, a body that matches the documented schema, valid input accepted and
invalid input refused. It found the ``PUT /v1/repack/policy`` of issue 15: the document allowed
``null`` for every field and the server refused it with 422.

The cluster is real (manager, data, 3 sim rollouts as processes): ``test_admin_api.py``'s,
which collects this test so one cluster serves both. Two
changes to the document steer the fuzzer without weakening what it checks: the rollout ``id``
is drawn from the live rollouts (plus one unknown id), so drain and resume act on real rollouts
rather than 404 on random strings; and ``/v1/events`` is asked for its JSON form, because its SSE
form is a stream that never ends (``test_admin_api.py`` reads it).
"""

from __future__ import annotations

import copy
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import requests
from hypothesis import HealthCheck, given, settings

from .test_admin_api import AUTH, ROLLOUTS, Live

schemathesis = pytest.importorskip("schemathesis")

EXAMPLES = 8  # per operation and generation mode: reaches every status, keeps the run short
UNKNOWN = "nobody"


def steered(doc: dict[str, Any]) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    for path, ops in doc["paths"].items():
        for op in ops.values():
            for param in op.get("parameters", []):
                if path.startswith("/v1/rollouts/") and param["name"] == "id":
                    param["schema"] = {"type": "string", "enum": [*ROLLOUTS, UNKNOWN]}
                if path == "/v1/events" and param["name"] == "format":
                    param["schema"] = {"type": "string", "enum": ["json"]}
                    param["required"] = True
    return doc


def test_admin_api_conforms_to_its_openapi_document(live: Live, tmp_path: Path) -> None:
    from schemathesis import GenerationMode

    doc = requests.get(f"{live.url}/v1/openapi.json", timeout=30).json()
    schema = schemathesis.openapi.from_dict(steered(doc))
    session = requests.Session()
    seen: Counter[tuple[str, str, int]] = Counter()
    before = requests.get(f"{live.url}/v1/repack/policy", headers=AUTH, timeout=30).json()
    try:
        for result in schema.get_all_operations():
            operation = result.ok()
            modes = [GenerationMode.POSITIVE]
            if operation.body or operation.query or operation.path_parameters:
                modes.append(GenerationMode.NEGATIVE)
            for mode in modes:

                @given(case=operation.as_strategy(generation_mode=mode))
                @settings(
                    max_examples=EXAMPLES,
                    deadline=None,
                    database=None,
                    derandomize=True,
                    suppress_health_check=list(HealthCheck),
                )
                def fuzz(case: Any) -> None:
                    if case.path == "/v1/events" and "format" not in (case.query or {}):
                        # a negative case that left out the `format` the steering requires: the
                        # API takes none (an SSE stream), so the server is right to accept it
                        return
                    response = case.call_and_validate(
                        base_url=live.url, session=session, headers=dict(AUTH), timeout=30
                    )
                    seen[(case.method, case.formatted_path, response.status_code)] += 1

                fuzz()
    finally:
        for rid in ROLLOUTS:  # whatever the fuzzer drained takes prompts again
            session.post(f"{live.url}/v1/rollouts/{rid}/resume", headers=AUTH, timeout=30)
        session.put(f"{live.url}/v1/repack/policy", headers=AUTH, json=before, timeout=30)
        session.close()
    # The fuzzer reached the real work: drains and resumes of live rollouts, an unknown one,
    # accepted and refused policy changes.
    for action in ("drain", "resume"):
        done = {p for (m, p, s) in seen if s == 200 and p.endswith(f"/{action}")}
        assert done & {f"/v1/rollouts/{rid}/{action}" for rid in ROLLOUTS}, seen
        assert (("POST", f"/v1/rollouts/{UNKNOWN}/{action}", 404)) in seen, seen
    policy = {s for (m, p, s) in seen if (m, p) == ("PUT", "/v1/repack/policy")}
    assert {200, 422} <= policy, policy
