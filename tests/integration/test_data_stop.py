"""A data role that is stopping answers with a clear error, never SQLite's own.

A request that took the store before ``on_stop`` closed it, and queued its next store call after
the close (an ``env_step`` waiting on its tool meanwhile), got "ProgrammingError: Cannot operate
on a closed database"; seen at the end of tool-calling runs when the data role stopped beside its
rollouts."""

from __future__ import annotations

import pytest

from laminar.roles.data.service import STORE_CLOSED, DataService
from tests.integration.test_report_items import data_config


async def test_a_store_call_queued_after_the_close_gets_the_stopping_error(serve, tmp_path):
    _, svc = await serve(DataService, config=data_config(tmp_path, 3))
    store = svc.store  # as a request holds it across an await
    assert store is not None
    await svc._db(store.holder, "p0/0")  # open: it answers
    await svc.on_stop()
    with pytest.raises(RuntimeError, match="starting or stopping") as err:
        await svc._db(store.holder, "p0/0")
    assert str(err.value) == STORE_CLOSED
    with pytest.raises(RuntimeError, match="starting or stopping"):
        svc._need_store()  # a request that comes later
