"""The learning curves, from the trainer's records to the dashboard: ``GET /v1/learning`` against
a live cluster of processes (manager, data, relay, 2 sim rollouts and an emulated trainer that
evaluates), and the dashboard drawing the reward and held-out accuracy curves in headless
Chromium (Debian's /usr/bin/chromium, driven by playwright as ``dashboard.py`` does).

The emulated trainer's weights are zeros, so it has nothing to evaluate: :class:`EvaluatingSimTrainer`
reports a stand-in accuracy on the real loop's schedule (``eval_every_s``), which takes each
evaluation through the same records, endpoint and admin route as the torch trainer's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from laminar.devmode.status import admin_url, fetch_status
from laminar.roles.trainer.loop import LoopSettings
from laminar.roles.trainer.sim import SimTrainerService
from laminar.roles.trainer.sim_compute import SimCompute
from laminar.runtime.config import ClusterConfig
from laminar.tracking.progress import policy_reward

from ..conftest import session_segments
from ..support.clients import ClusterClients
from ..support.poll import until
from ..support.procs import TOKEN
from ..support.scenario import process_cluster, write_config
from ..support.task import write_prompts, write_tokenizer

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(180),
    pytest.mark.xdist_group("dashboard_learning"),  # one cluster for the module's tests
]

ROLLOUTS = ("rollout-0", "rollout-1")
AUTH = {"Authorization": f"Bearer {TOKEN}"}
EVAL_EVERY_S = 0.5
VERSIONS, EVALS = 6, 3  # what the tests wait for before they look

CHROMIUM = next(
    (p for p in ("/usr/bin/chromium", shutil.which("chromium") or "") if p and Path(p).exists()),
    None,
)


class StandInEval(SimCompute):
    async def evaluate(self, version: int) -> dict[str, Any] | None:
        accuracy = round(min(1.0, 0.3 + 0.02 * version), 3)
        return {"accuracy": accuracy, "n": 50, "eval_s": 0.0, "buckets": {
            "1-2": {"n": 25, "accuracy": min(1.0, accuracy + 0.2)},
            "3-4": {"n": 25, "accuracy": max(0.0, accuracy - 0.2)},
        }}  # fmt: skip


class EvaluatingSimTrainer(SimTrainerService):
    """The sim trainer, evaluating every ``EVAL_EVERY_S`` (and at its start) with
    :class:`StandInEval`."""

    compute_cls = StandInEval

    def settings(self) -> LoopSettings:
        return dataclasses.replace(
            super().settings(), eval_every_s=EVAL_EVERY_S, eval_at_start=True
        )


def cluster_config(tmp: Path) -> Path:
    return write_config(
        tmp,
        {
            "cluster": {
                "heartbeat_interval_s": 0.25,
                "heartbeat_timeout_s": 2.0,
                "rpc_timeout_s": 10.0,
                "log_level": "warning",
            },
            "data": {
                "prompts": str(write_prompts(tmp / "prompts.jsonl", 64)),
                "tokenizer": str(write_tokenizer(tmp / "tok")),
                "reward": "tests.support.task:reward_len",
                "samples_per_prompt": 2,
                "epochs": None,
                "store": str(tmp / "data.sqlite"),
                "sampling": {"max_tokens": 120},
                "metrics": None,
                "queue_ahead": 8,
            },
            "relay": {"weights_bind": "tcp://127.0.0.1:0", "metrics": None},
            "rollout": {
                "metrics": None,
                "concurrency": 4,
                "flush_interval_s": 0.1,
                "take_wait_s": 0.3,
                "engine": {
                    "backend": "sim",
                    "vocab_size": 64,
                    "seed": 5,
                    "lengths": {"kind": "lognormal", "median": 12, "max_length": 120},
                    "cost": {"batch_points": [[1, 0.01], [64, 0.012]], "prefill_s_per_token": 0},
                    "load_time_s": 0.05,
                },
            },
            "sim_trainer": {
                "metrics": None,
                "batch": {"prompts": 2, "samples": 2},
                "cost": {"gpus": 1, "base_s": 0.3, "time_scale": 1.0},
                "weight_bytes": 1 << 20,
                "sample_wait_s": 1.0,
            },
        },
    )


class Live:
    def __init__(self, cluster: Any, url: str) -> None:
        self.cluster, self.url = cluster, url


@pytest.fixture(autouse=True)
def _no_leaked_shm() -> Iterator[None]:
    """Overrides the per-test check of tests/conftest.py: the cluster outlives single tests, so
    the check is around the whole cluster (``live``)."""
    yield


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    tmp = tmp_path_factory.mktemp("learning")
    shm_before = session_segments()
    with process_cluster(tmp, cluster_config(tmp)) as cluster:
        cluster.serve("manager", "manager")
        cluster.serve("data", "data")
        cluster.serve("relay", "relay")
        for name in ROLLOUTS:
            cluster.serve("rollout", name)
        cluster.serve(f"{__name__}:EvaluatingSimTrainer", "trainer")

        async def find() -> str:
            async def probe() -> str | None:
                status = await fetch_status(cluster.manager, TOKEN.encode(), ClusterConfig())
                return admin_url(status)

            return await until(probe, 60, interval=0.2)

        yield Live(cluster, asyncio.run(find()))
    leaked = session_segments() - shm_before
    assert not leaked, f"shared-memory segments leaked by the cluster: {sorted(leaked)}"


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


async def learning(http: aiohttp.ClientSession, live: Live, query: str = "") -> dict[str, Any]:
    async with http.get(f"{live.url}/v1/learning{query}", headers=AUTH) as resp:
        assert resp.status == 200, await resp.text()
        body: dict[str, Any] = await resp.json()
        return body


async def grown(http: aiohttp.ClientSession, live: Live) -> dict[str, Any]:
    """The curves once the trainer has VERSIONS versions and EVALS evaluations."""

    async def probe() -> dict[str, Any] | None:
        body = await learning(http, live)
        enough = len(body["versions"]) >= VERSIONS and len(body["evals"]) >= EVALS
        return body if enough else None

    return await until(probe, 90, interval=0.3)


async def test_learning_serves_the_trainers_records(live: Live, http: aiohttp.ClientSession):
    body = await grown(http, live)
    assert body["trainer"] == "trainer" and body["errors"] == {}
    versions, evals = body["versions"], body["evals"]
    numbers = [v["version"] for v in versions]
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)
    assert body["version"] >= numbers[-1]

    # each point is its version's record, as the trainer keeps it
    clients = ClusterClients(live.cluster)
    try:
        status = await clients.proxy(SimTrainerService, "trainer").status.call()
    finally:
        await clients.close()
    records = {r["version"]: r for r in status.records}
    for point in versions:
        record = records[point["version"]]
        assert point["reward"] == pytest.approx(policy_reward(record))
        assert point["tokens"] == record["tokens"] > 0
        assert point["staleness_mean"] == record["staleness_mean"]
        assert point["staleness_max"] == record["staleness_max"]
        assert point["time"] >= record["train_end"]
    # tokens/s from the interval since the previous version, for all but the first ever kept
    for before, point in itertools.pairwise(versions):
        expected = point["tokens"] / (point["time"] - before["time"])
        assert point["tokens_per_s"] == pytest.approx(expected)
    assert [e["accuracy"] for e in evals] == sorted(e["accuracy"] for e in evals)
    assert evals[0]["version"] == 0  # the evaluation at the start
    assert all(set(e["buckets"]) == {"1-2", "3-4"} and e["n"] == 50 for e in evals)

    # incremental: only what came after `since`, evaluations of `since` itself included
    since = numbers[-2]
    newer = await learning(http, live, f"?since={since}")
    assert newer["versions"] and all(v["version"] > since for v in newer["versions"])
    assert newer["versions"][0]["version"] == since + 1
    assert all(e["version"] >= since for e in newer["evals"])
    # bounded: the newest `limit`
    one = await learning(http, live, "?limit=1")
    assert len(one["versions"]) == 1 and len(one["evals"]) == 1
    assert one["versions"][0]["version"] >= numbers[-1]

    for bad in ("?limit=0", "?limit=2001", "?since=-1", "?since=x", "?limit=1.5"):
        async with http.get(f"{live.url}/v1/learning{bad}", headers=AUTH) as resp:
            assert resp.status == 400, bad
            assert (await resp.json())["error"], bad
    async with http.get(f"{live.url}/v1/learning") as resp:
        assert resp.status == 401


@pytest.mark.skipif(
    CHROMIUM is None,
    reason="no Chromium: `make setup` installs Debian's (apt-get install chromium)",
)
async def test_dashboard_draws_reward_and_accuracy(live: Live, http: aiohttp.ClientSession):
    pytest.importorskip("playwright", reason="playwright is in the dev extra")
    from playwright.async_api import async_playwright

    body = await grown(http, live)
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            # narrower than the rollouts table: its buttons must stay in view
            page = await browser.new_page(viewport={"width": 720, "height": 1100})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            await page.goto(f"{live.url}/?token={TOKEN}")

            # reward: a line through at least as many versions as the API had a moment ago
            await page.wait_for_function(
                "Number(document.querySelector('#reward-chart').dataset.points)"
                f" >= {len(body['versions'])}",
                timeout=30_000,
            )
            reward = page.locator('#reward-chart polyline[data-series="reward-mean"]')
            assert len((await reward.get_attribute("points") or "").split()) >= VERSIONS
            # accuracy: one dot per evaluation, at the API's values
            await page.wait_for_function(
                "document.querySelectorAll('#accuracy-chart circle[data-series=\"accuracy\"]')"
                f".length >= {len(body['evals'])}",
                timeout=30_000,
            )
            dots = page.locator('#accuracy-chart circle[data-series="accuracy"]')
            drawn = [float(y) for y in await dots.evaluate_all("ds => ds.map(d => d.dataset.y)")]
            assert {e["accuracy"] for e in body["evals"]} <= set(drawn)
            assert await page.locator('#accuracy-chart polyline[data-series="accuracy"]').count()
            # the header's numbers, and the other two curves
            assert float(await page.locator("#reward-now").inner_text()) >= 0
            assert "pts" in await page.locator("#accuracy-now").inner_text()
            for chart in ("trained-chart", "staleness-chart"):
                assert await page.locator(f"#{chart} polyline").count() >= 1, chart
            # by minutes instead of versions: the same points
            await page.click('.axis-switch button[data-x="time"]')
            await page.wait_for_function(
                "document.querySelectorAll('#accuracy-chart circle[data-series=\"accuracy\"]')"
                f".length >= {len(body['evals'])}",
                timeout=10_000,
            )

            # the version timeline: a lane per rollout
            await page.wait_for_function(
                f"document.querySelectorAll('#timeline polyline[data-rollout]').length"
                f" === {len(ROLLOUTS)}",
                timeout=30_000,
            )
            # drain and resume in view, inside the panel
            panel = await page.locator("#rollouts-panel").bounding_box()
            for rid in ROLLOUTS:
                row = page.locator(f'#rollouts tr[data-rollout="{rid}"]')
                await row.wait_for(timeout=30_000)
                for action in ("drain", "resume"):
                    box = await row.locator(f'button[data-action="{action}"]').bounding_box()
                    assert panel is not None and box is not None
                    assert panel["x"] <= box["x"] and box["x"] + box["width"] <= (
                        panel["x"] + panel["width"]
                    ), (rid, action, box, panel)
                    assert box["x"] + box["width"] <= 720

            # repacks that moved nothing get no row: they are counted above the table, and share
            # one line of the event list. One that moved something, then three that did not (fed
            # to the page's handler, numbered after every real event, so none interleaves)
            at = body["versions"][-1]["time"]
            move = {"source": "rollout-0", "destination": "rollout-1", "version": 0}
            events = [
                {"seq": 10**9 + i, "at": at + i, "kind": "repack",
                 "data": {"id": 900 + i, "reason": "period", "moves": [move],
                          "moved": 2 if i == 0 else 0}}
                for i in range(4)
            ]  # fmt: skip
            rows = page.locator("#repacks tbody tr")
            summary = page.locator("#repack-summary")
            before = await rows.count()
            empty = int(await summary.get_attribute("data-empty") or 0)
            await page.evaluate("events => events.forEach(onEvent)", events)
            assert await rows.count() == min(50, before + 1)  # only the one that moved
            assert await rows.first.get_attribute("data-repack") == "900"
            assert await summary.get_attribute("data-empty") == str(empty + 3)
            assert "moved nothing" in await summary.inner_text()
            assert "#903" in await summary.inner_text()
            listed = page.locator("#events li").first
            assert await listed.get_attribute("data-run") == "routine"
            assert await listed.get_attribute("data-empty-repacks") == "3"
            assert "3 repacks moved nothing" in await listed.inner_text()
            assert not errors, errors
        finally:
            await browser.close()
