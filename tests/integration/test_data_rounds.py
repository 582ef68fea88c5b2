"""Parked samples survive a data role's restart (a real data role: its reward workers are
processes). The round schedules and the store are ``tests/unit/test_data_rounds.py``."""

from __future__ import annotations

import asyncio

from laminar.roles.data.service import DataService
from laminar.roles.data.store import Store
from tests.integration.test_report_items import data_config
from tests.support.poll import until


async def test_a_restarted_data_role_requeues_what_an_earlier_run_parked(serve, tmp_path):
    config = data_config(tmp_path, 3)
    host, svc = await serve(DataService, config=config)
    host.stop()
    await until(lambda: asyncio.sleep(0, svc.store is None), 10)
    store = Store(config.store)
    store.refill(3, samples=1, seed=0, epochs=1)
    store.park(store.queued_groups()[:2])
    assert store.parked_count() == 2
    store.close()
    _, svc = await serve(DataService, config=config)
    assert svc.store is not None and svc.store.parked_count() == 0
    assert svc.store.queued_count() == 3
