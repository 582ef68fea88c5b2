"""The manager's admin HTTP API against a live cluster of processes: manager, data, 3 sim rollouts.

One cluster serves the whole module (starting it is the slow part); tests that change shared state
(the policy, a drain) put it back. The schema fuzzer (``admin_fuzz.py``) and the dashboard tests
(``dashboard.py``) are collected here, at the end, so they use the same cluster.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from laminar.devmode.status import admin_url, fetch_status
from laminar.repack import RepackPolicy
from laminar.roles.rollout.api import RolloutStats
from laminar.runtime.config import ClusterConfig

from ..conftest import session_segments
from ..support.poll import until
from ..support.procs import TOKEN, env, run_cli
from ..support.scenario import process_cluster, write_config
from ..support.task import write_prompts, write_tokenizer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

ROLLOUTS = ("rollout-0", "rollout-1", "rollout-2")
AUTH = {"Authorization": f"Bearer {TOKEN}"}

SIM = {
    "backend": "sim",
    "vocab_size": 64,
    # long enough that every rollout always has trajectories in flight
    "lengths": {"kind": "lognormal", "median": 120, "sigma": 0.5, "max_length": 400},
    # Steps of 16-32 ms: the tests need tokens flowing, not many of them. Measured alone
    # (2026-11-29), the three rollouts and the data role took 8.7 CPU-s of the module's run
    # against 12.7 with steps of 4-8 ms; more in the suite, where the module lasts longer.
    "cost": {"batch_points": [[1, 0.016], [256, 0.032]], "prefill_s_per_token": 0},
}


def cluster_config(tmp: Path) -> Path:
    return write_config(
        tmp,
        {
            "data": {
                "prompts": str(write_prompts(tmp / "prompts.jsonl", 64)),
                "tokenizer": str(write_tokenizer(tmp / "tok")),
                "reward": "tests.support.task:reward_len",
                "samples_per_prompt": 2,
                "epochs": None,
                "store": str(tmp / "data.sqlite"),
                "metrics": None,
            },
            "rollout": {
                "metrics": None,
                "concurrency": 6,
                "flush_interval_s": 0.1,
                "take_wait_s": 0.5,
                "engine": SIM,
            },
        },
    )


class Live:
    def __init__(self, cluster: Any, url: str, tmp: Path) -> None:
        self.cluster, self.url, self.tmp = cluster, url, tmp

    @property
    def manager(self) -> str:
        return self.cluster.manager


def start_live(tmp: Path) -> Iterator[Live]:
    """Start the cluster, wait until every rollout heartbeats with generated tokens.

    The cluster outlives single tests, and its processes may hold shared-memory segments (a
    migration's transfer) while a test ends, so the leak check is around the whole cluster.
    """
    shm_before = session_segments()
    config = cluster_config(tmp)
    with process_cluster(tmp, config) as cluster:
        cluster.serve("manager", "manager")
        cluster.serve("data", "data-0")
        for name in ROLLOUTS:
            cluster.serve("rollout", name)

        async def find() -> str:
            async def probe() -> str | None:
                status = await fetch_status(cluster.manager, TOKEN.encode(), ClusterConfig())
                rollouts = [m for m in status.members if m.role == "rollout"]
                busy = [
                    m
                    for m in rollouts
                    if (s := m.stats_as(RolloutStats)) and s.generated_tokens > 0
                ]
                return admin_url(status) if len(busy) == len(ROLLOUTS) else None

            return await until(probe, 60, interval=0.2)

        url = asyncio.run(find())
        yield Live(cluster, url, tmp)
    leaked = session_segments() - shm_before
    assert not leaked, f"shared-memory segments leaked by the cluster: {sorted(leaked)}"


@pytest.fixture(autouse=True)
def _no_leaked_shm() -> Iterator[None]:
    """Overrides the per-test check of tests/conftest.py: see start_live."""
    yield


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    yield from start_live(tmp_path_factory.mktemp("admin"))


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


async def get(http: aiohttp.ClientSession, url: str, **kw: Any) -> tuple[int, Any]:
    async with http.get(url, headers=kw.pop("headers", AUTH), **kw) as resp:
        return resp.status, await resp.json()


async def status_of(http: aiohttp.ClientSession, live: Live) -> dict[str, Any]:
    code, body = await get(http, f"{live.url}/v1/status")
    assert code == 200, body
    return body


# -- auth and errors ---------------------------------------------------------------------------


async def test_auth_required_and_errors_are_json(live: Live, http: aiohttp.ClientSession):
    for path in ("/v1/status", "/metrics", "/v1/repack/policy", "/v1/events?format=json"):
        async with http.get(live.url + path) as resp:
            assert resp.status == 401, path
            assert resp.headers["WWW-Authenticate"].startswith("Bearer")
            assert (await resp.json())["error"] == "missing bearer token"
        async with http.get(live.url + path, headers={"Authorization": "Bearer nope"}) as resp:
            assert resp.status == 401, path
            assert (await resp.json())["error"] == "wrong token"
    # ?token= is accepted on the event stream only
    async with http.get(f"{live.url}/v1/status?token={TOKEN}") as resp:
        assert resp.status == 401
    code, _ = await get(http, f"{live.url}/v1/events?format=json&token={TOKEN}", headers={})
    assert code == 200
    # the page, its assets, the document and the health check are public
    for path in ("/", "/dashboard/app.js", "/dashboard/style.css", "/v1/openapi.json", "/healthz"):
        async with http.get(live.url + path) as resp:
            assert resp.status == 200, path

    code, body = await get(http, f"{live.url}/v1/nothing-here")
    assert code == 404 and body["error"] == "not found"
    code, body = await get(http, f"{live.url}/v1/events?format=json&since=abc")
    assert code == 400 and "since" in body["error"]
    async with http.delete(f"{live.url}/v1/repack/policy", headers=AUTH) as resp:
        assert resp.status == 405
        assert "PUT" in resp.headers["Allow"]
        assert (await resp.json())["error"] == "method not allowed"
    async with http.post(f"{live.url}/v1/rollouts/nobody/drain", headers=AUTH) as resp:
        assert resp.status == 404
        assert (await resp.json())["detail"] == {"rollout": "nobody"}
    async with http.post(f"{live.url}/v1/rollouts/data-0/resume", headers=AUTH) as resp:
        assert resp.status == 404  # a member, but not a rollout


async def test_openapi_documents_every_route(live: Live, http: aiohttp.ClientSession):
    from laminar.roles.manager.openapi import ROUTES

    code, doc = await get(http, f"{live.url}/v1/openapi.json", headers={})
    assert code == 200
    assert doc["openapi"].startswith("3.1")
    expected = {(r.path, r.method.lower()) for r in ROUTES}
    documented = {(p, m) for p, ops in doc["paths"].items() for m in ops}
    assert expected == documented
    for must in (
        ("/v1/status", "get"),
        ("/metrics", "get"),
        ("/v1/repack/plan", "get"),
        ("/v1/repack", "post"),
        ("/v1/repack/policy", "get"),
        ("/v1/repack/policy", "put"),
        ("/v1/rollouts/{id}/drain", "post"),
        ("/v1/rollouts/{id}/resume", "post"),
        ("/v1/events", "get"),
    ):
        assert must in documented, must
    schemas = doc["components"]["schemas"]
    for name in ("AdminStatus", "RepackPolicy", "RepackOutcome", "PlanView", "ErrorBody"):
        assert name in schemas, name
    put = doc["paths"]["/v1/repack/policy"]["put"]
    assert put["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "PolicyPatch"
    )
    assert {"200", "400", "401", "422"} <= set(put["responses"])
    drain = doc["paths"]["/v1/rollouts/{id}/drain"]["post"]
    assert {"404", "409"} <= set(drain["responses"])
    # every $ref resolves
    text = json.dumps(doc)
    for ref in {p.split('"')[0] for p in text.split('"$ref": "#/components/schemas/')[1:]}:
        assert ref in schemas, ref


# -- status and metrics ------------------------------------------------------------------------


async def test_status_shows_rollouts_data_and_policy(live: Live, http: aiohttp.ClientSession):
    s = await status_of(http, live)
    assert s["manager"] == "manager"
    ids = {r["id"] for r in s["rollouts"]}
    assert ids == set(ROLLOUTS)
    for r in s["rollouts"]:
        assert r["member_state"] == "alive"
        assert r["version"] == 0
        assert 0 <= r["kv_cache_usage"] <= 1
        assert r["generated_tokens"] > 0
        assert r["state"] in ("running", "switching", "draining")
    assert s["data"] is not None and s["data"]["leased"] >= 0
    assert s["trainer"] is None  # no trainer in this cluster: null, not an error
    assert s["relays"] == [] and s["chain"]["order"] == []
    assert s["staleness"]["rollout_versions"] == [0]
    assert set(s["repack_policy"]) == set(RepackPolicy.model_fields)
    assert s["members"]["rollout"] == {"alive": 3}


async def test_metrics_parse(live: Live, http: aiohttp.ClientSession):
    async with http.get(f"{live.url}/metrics", headers=AUTH) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert "laminar_rpc_calls" in families  # the manager's own registry
    by_version = families["laminar_admin_rollouts_by_version"]
    assert {s.labels["version"]: s.value for s in by_version.samples} == {"0": 3.0}
    kv = families["laminar_admin_rollout_kv_cache_usage"]
    assert {s.labels["rollout"] for s in kv.samples} == set(ROLLOUTS)
    assert "laminar_admin_kv_cache_usage_mean" in families


# -- repack --------------------------------------------------------------------------------------


async def test_repack_plan_and_run(live: Live, http: aiohttp.ClientSession):
    code, view = await get(http, f"{live.url}/v1/repack/plan")
    assert code == 200
    assert {load["rollout"] for load in view["loads"]} == set(ROLLOUTS)
    assert "moves" in view["plan"] and "candidates" in view["plan"]
    async with http.post(f"{live.url}/v1/repack", headers=AUTH) as resp:
        assert resp.status == 200
        outcome = await resp.json()
    assert outcome["reason"] == "operator"
    assert outcome["id"] >= 1
    assert outcome["moved"] == sum(len(r["moved"]) for r in outcome["reports"])


async def test_policy_put_is_live_and_validated(live: Live, http: aiohttp.ClientSession):
    code, before = await get(http, f"{live.url}/v1/repack/policy")
    assert code == 200
    _, events = await get(http, f"{live.url}/v1/events?format=json")
    last = max((e["seq"] for e in events), default=0)
    try:
        async with http.put(
            f"{live.url}/v1/repack/policy", headers=AUTH, json={"period_s": 7.5, "c_max": 0.9}
        ) as resp:
            assert resp.status == 200, await resp.text()
            assert (await resp.json())["period_s"] == 7.5
        code, now = await get(http, f"{live.url}/v1/repack/policy")
        assert now == {**before, "period_s": 7.5, "c_max": 0.9}
        assert (await status_of(http, live))["repack_policy"]["period_s"] == 7.5
        code, events = await get(http, f"{live.url}/v1/events?format=json&since={last}&kind=policy")
        assert code == 200
        assert events and events[-1]["kind"] == "policy"
        assert events[-1]["data"]["changed"] == {"period_s": 7.5, "c_max": 0.9}

        bad = [
            ({"period_s": -1}, "period_s"),
            ({"c_max": 2}, "c_max"),
            ({"batch_limit": "many"}, "batch_limit"),
            ({"surprise": 1}, "surprise"),
        ]
        for body, field in bad:
            async with http.put(f"{live.url}/v1/repack/policy", headers=AUTH, json=body) as resp:
                assert resp.status == 422, body
                err = await resp.json()
                assert err["error"] == "invalid policy"
                assert [d["field"] for d in err["detail"]] == [field]
        async with http.put(
            f"{live.url}/v1/repack/policy", headers=AUTH, data=b"{not json"
        ) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"] == "malformed JSON"
        async with http.put(f"{live.url}/v1/repack/policy", headers=AUTH, json=[1]) as resp:
            assert resp.status == 422
        code, still = await get(http, f"{live.url}/v1/repack/policy")
        assert still["period_s"] == 7.5  # refused updates changed nothing
    finally:
        async with http.put(f"{live.url}/v1/repack/policy", headers=AUTH, json=before) as resp:
            assert resp.status == 200


# -- drain / resume ------------------------------------------------------------------------------


async def test_drain_and_resume(live: Live, http: aiohttp.ClientSession):
    target, others = ROLLOUTS[0], ROLLOUTS[1:]
    before = {r["id"]: r for r in (await status_of(http, live))["rollouts"]}
    async with http.post(
        f"{live.url}/v1/rollouts/{target}/drain", headers=AUTH, json={"reason": "test"}
    ) as resp:
        body = await resp.json()
        assert resp.status == 200, body
    try:
        assert body["rollout"] == target and body["action"] == "drain"
        assert body["state"]["operator_drain"] is True

        async def drained() -> dict[str, Any] | None:
            s = await status_of(http, live)
            r = {x["id"]: x for x in s["rollouts"]}
            ok = r[target]["state"] == "draining" and r[target]["in_flight"] == 0
            return r if ok else None

        after = await until(drained, 60, interval=0.25)
        # the others keep generating
        for rid in others:
            assert after[rid]["state"] != "draining"

        async def others_progress() -> bool:
            r = {x["id"]: x for x in (await status_of(http, live))["rollouts"]}
            return all(
                r[rid]["generated_tokens"] > after[rid]["generated_tokens"] for rid in others
            )

        await until(others_progress, 30, interval=0.25)
        assert before[target]["state"] != "draining"
        _, events = await get(http, f"{live.url}/v1/events?format=json&kind=drain")
        assert any(e["data"]["rollout"] == target for e in events)
    finally:
        async with http.post(f"{live.url}/v1/rollouts/{target}/resume", headers=AUTH) as resp:
            body = await resp.json()
            assert resp.status == 200, body
    assert body["state"]["operator_drain"] is False

    async def running_again() -> bool:
        r = {x["id"]: x for x in (await status_of(http, live))["rollouts"]}
        return r[target]["state"] == "running" and r[target]["in_flight"] > 0

    await until(running_again, 60, interval=0.25)
    _, events = await get(http, f"{live.url}/v1/events?format=json&kind=resume")
    assert any(e["data"]["rollout"] == target for e in events)


# -- events ------------------------------------------------------------------------------------


async def read_sse(resp: aiohttp.ClientResponse, want: int) -> list[dict[str, Any]]:
    """The next ``want`` messages (comments skipped) as {id, event, data}."""
    out: list[dict[str, Any]] = []
    msg: dict[str, Any] = {}
    while len(out) < want:
        line = (await resp.content.readline()).decode()
        if not line:
            raise EOFError("stream closed")
        line = line.rstrip("\n")
        if not line:
            if "data" in msg:
                out.append(msg)
            msg = {}
        elif line.startswith(":") or line.startswith("retry:"):
            continue
        else:
            key, _, value = line.partition(":")
            msg[key] = value.removeprefix(" ")
    return out


async def test_sse_stream_and_resumption(live: Live, http: aiohttp.ClientSession):
    _, events = await get(http, f"{live.url}/v1/events?format=json")
    last = max((e["seq"] for e in events), default=0)
    async with http.get(f"{live.url}/v1/events?since={last}", headers=AUTH) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        for period in (6.0, 5.0):  # two policy events, live
            async with http.put(
                f"{live.url}/v1/repack/policy", headers=AUTH, json={"period_s": period}
            ) as put:
                assert put.status == 200
        got: list[dict[str, Any]] = []
        async with asyncio.timeout(30):
            while len([m for m in got if m["event"] == "policy"]) < 2:
                got += await read_sse(resp, 1)
    policy = [m for m in got if m["event"] == "policy"]
    ids = [int(m["id"]) for m in got]
    assert ids == sorted(ids) and ids[0] > last
    first = json.loads(policy[0]["data"])
    assert first["kind"] == "policy" and first["seq"] == int(policy[0]["id"])
    assert first["data"]["period_s"] == 6.0
    # resume after the first policy event: the second one comes first (or whatever came between)
    resume_from = int(policy[0]["id"])
    for headers, url in (
        ({**AUTH, "Last-Event-ID": str(resume_from)}, f"{live.url}/v1/events"),
        ({}, f"{live.url}/v1/events?since={resume_from}&token={TOKEN}"),
    ):
        async with http.get(url, headers=headers) as resp:
            assert resp.status == 200
            async with asyncio.timeout(30):
                again = await read_sse(resp, 1)
        assert int(again[0]["id"]) == resume_from + 1


# -- the CLI -------------------------------------------------------------------------------------


async def test_cli_against_the_live_cluster(live: Live, http: aiohttp.ClientSession):
    common = ("--join", live.manager, "--run-dir", str(live.tmp / "no-run-dir"))

    def cli(*args: str, environ: dict[str, str] | None = None) -> Any:
        return asyncio.to_thread(run_cli, *args, environ=environ)

    out = await cli("status", *common)
    assert out.returncode == 0, out.stderr
    for rid in ROLLOUTS:
        assert rid in out.stdout
    assert "KV" in out.stdout and "version" in out.stdout
    assert "repack policy:" in out.stdout

    out = await cli("repack", "--dry-run", *common)
    assert out.returncode == 0, out.stderr
    assert "repack plan (dry run)" in out.stdout and ROLLOUTS[0] in out.stdout

    out = await cli("repack", "--json", *common)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["reason"] == "operator"

    out = await cli("repack", "policy", *common)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("repack policy:")

    _, before = await get(http, f"{live.url}/v1/repack/policy")
    try:
        out = await cli(
            "repack", "policy", "--period", "9", "--batch-limit", "32", "--disable", "--json",
            *common,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == {
            **before, "period_s": 9.0, "batch_limit": 32, "enabled": False
        }  # fmt: skip
        _, now = await get(http, f"{live.url}/v1/repack/policy")
        assert now["period_s"] == 9.0 and now["enabled"] is False

        out = await cli("repack", "policy", "--c-max", "3", *common)
        assert out.returncode == 2
        assert "HTTP 422" in out.stderr and "c_max" in out.stderr
    finally:
        await http.put(f"{live.url}/v1/repack/policy", headers=AUTH, json=before)

    # --admin with a wrong token: a clear 401
    out = await cli(
        "repack", "policy", "--admin", live.url, "--run-dir", str(live.tmp / "none"),
        environ=env(LAMINAR_TOKEN="wrong-token"),
    )  # fmt: skip
    assert out.returncode == 2
    assert "HTTP 401" in out.stderr and "token" in out.stderr


# Last, on the same cluster (see the module docstring); pytest collects imported tests.
from .admin_fuzz import test_admin_api_conforms_to_its_openapi_document  # noqa: E402, F401
from .dashboard import (  # noqa: E402, F401
    test_dashboard_asks_for_a_token,
    test_dashboard_renders_the_live_cluster,
)
