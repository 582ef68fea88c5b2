"""The dashboard in headless Chromium (Debian's /usr/bin/chromium, driven by playwright) against
a live cluster: manager, data and 3 sim rollouts, ``test_admin_api.py``'s, which collects these
tests so one cluster serves both."""

from __future__ import annotations

import shutil
from pathlib import Path

import aiohttp
import pytest

from ..support.procs import TOKEN
from .test_admin_api import AUTH, ROLLOUTS, Live

CHROMIUM = next(
    (p for p in ("/usr/bin/chromium", shutil.which("chromium") or "") if p and Path(p).exists()),
    None,
)

needs_chromium = pytest.mark.skipif(
    CHROMIUM is None,
    reason="no Chromium: `make setup` installs Debian's (apt-get install chromium)",
)


@needs_chromium
async def test_dashboard_renders_the_live_cluster(live: Live):
    pytest.importorskip("playwright", reason="playwright is in the dev extra")
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        browser = await pw.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            page = await browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            await page.goto(f"{live.url}/?token={TOKEN}")
            # the token left the address bar, and lives in sessionStorage
            assert "token=" not in page.url
            stored = await page.evaluate("sessionStorage.getItem('laminar-token')")
            assert stored == TOKEN

            # rollouts table: every live rollout, its version and a KV value
            for rid in ROLLOUTS:
                row = page.locator(f'#rollouts tr[data-rollout="{rid}"]')
                await row.wait_for(timeout=30_000)
                assert (await row.locator('[data-field="version"]').inner_text()) == "0"
                kv = await row.locator('[data-field="kv"]').get_attribute("data-value")
                assert kv is not None and 0 <= float(kv) <= 1
                assert "%" in await row.locator('[data-field="kv"]').inner_text()
                assert await row.get_attribute("data-state") in ("running", "switching")

            # throughput from generated_tokens deltas: positive once two polls are in
            await page.wait_for_function(
                "Number(document.querySelector('#throughput').dataset.value) > 0",
                timeout=30_000,
            )
            # the version timeline draws a line per rollout
            await page.wait_for_function(
                f"document.querySelectorAll('#timeline polyline[data-rollout]').length"
                f" === {len(ROLLOUTS)}",
                timeout=30_000,
            )
            # live events: the SSE stream is open and a policy change shows up
            await page.wait_for_function(
                "document.querySelector('#sse-state').dataset.state === 'open'", timeout=30_000
            )
            before = await page.locator('#events li[data-kind="policy"]').count()
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{live.url}/v1/repack/policy", headers=AUTH) as resp:
                    policy = await resp.json()
                try:
                    async with http.put(
                        f"{live.url}/v1/repack/policy", headers=AUTH, json={"period_s": 4.25}
                    ) as resp:
                        assert resp.status == 200
                    await page.wait_for_function(
                        f"document.querySelectorAll('#events li[data-kind=\"policy\"]').length"
                        f" > {before}",
                        timeout=30_000,
                    )
                    newest = page.locator('#events li[data-kind="policy"]').first
                    assert "4.25" in await newest.inner_text()
                    # and the policy panel follows it on the next poll
                    await page.wait_for_function(
                        "document.querySelector('#policy').dataset.periodS === '4.25'",
                        timeout=30_000,
                    )
                finally:
                    async with http.put(
                        f"{live.url}/v1/repack/policy", headers=AUTH, json=policy
                    ) as resp:
                        assert resp.status == 200
            assert not errors, errors
        finally:
            await browser.close()


@needs_chromium
async def test_dashboard_asks_for_a_token(live: Live):
    pytest.importorskip("playwright", reason="playwright is in the dev extra")
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = await browser.new_page()
            await page.goto(f"{live.url}/")
            await page.locator("#token-form").wait_for(state="visible", timeout=10_000)
            await page.fill("#token-input", "wrong")
            await page.click("#token-form button")
            await page.wait_for_function(
                "document.querySelector('#token-error').textContent.includes('refused')",
                timeout=15_000,
            )
            await page.fill("#token-input", TOKEN)
            await page.click("#token-form button")
            await page.locator(f'#rollouts tr[data-rollout="{ROLLOUTS[0]}"]').wait_for(
                timeout=30_000
            )
        finally:
            await browser.close()
