"""One poison request fails alone, with a real data role (its reward workers are processes): every
rollout survives a poison prompt, and a lease that keeps killing its rollouts is quarantined. The
sim engine's refusal, the store's quarantine and the buffers' and rounds' parts are
``tests/unit/test_poison.py``."""

from __future__ import annotations

import json

from laminar.engines import SimEngineConfig
from laminar.roles.data.api import DataApi, SampleRequest, TakeRequest
from laminar.roles.data.service import DataConfig, DataService
from laminar.roles.manager import ManagerConfig, ManagerService
from laminar.roles.rollout import RolloutConfig, RolloutService
from laminar.runtime.membership import JoinRequest, MembershipApi
from laminar.runtime.rpc.client import RpcClient, remote
from tests.support.poll import until
from tests.support.task import write_prompts, write_tokenizer
from tests.unit.test_poison import FAST


async def manager_and_data(serve, tmp_path, prompts, **data):  # type: ignore[no-untyped-def]
    """A manager and a data role ``data-0`` joined to it: (manager address, data host)."""
    mgr_host, _ = await serve(
        ManagerService,
        config=ManagerConfig(bind="tcp://127.0.0.1:0", metrics=None, admin=None),
    )
    manager = mgr_host.ctx.address
    data_host, _ = await serve(
        DataService,
        instance="data-0",
        manager=manager,
        config=DataConfig(
            metrics=None,
            prompts=str(prompts),
            tokenizer=str(write_tokenizer(tmp_path / "tok")),
            reward="tests.support.task:reward_len",
            store=str(tmp_path / "data.sqlite"),
            **data,
        ),
    )
    return manager, data_host


async def test_a_poison_prompt_fails_alone_and_every_rollout_survives(serve, tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 8)
    with prompts.open("a") as f:  # far longer than the rollouts' context (their KV cache)
        f.write(json.dumps({"id": "poison", "prompt": "1" * 5000, "answer": 0}) + "\n")
    manager, data_host = await manager_and_data(serve, tmp_path, prompts, samples_per_prompt=2)
    engine = SimEngineConfig(
        kv_capacity_tokens=4096, cost=FAST, lengths={"kind": "fixed", "value": 6}
    )
    rollouts = [
        await serve(
            RolloutService,
            instance=f"rollout-{i}",
            manager=manager,
            config=RolloutConfig(
                metrics=None, engine=engine, concurrency=4, flush_interval_s=0.05, take_wait_s=0.5
            ),
        )
        for i in range(2)
    ]
    data = data_host.ctx.connect(DataApi, data_host.ctx.address)

    async def finished():
        status = await data.status.call()
        return status if status.finished else None

    status = await until(finished, timeout=30)
    assert (status.trajectories, status.failed, status.quarantined) == (16, 2, 0)
    assert sum(svc.failures for _, svc in rollouts) == 2
    for host, svc in rollouts:  # both still serving: nothing crashed
        assert (await host.ctx.connect(DataApi, data_host.ctx.address).status.call()).finished
        assert not svc.failed and not svc.flights
    store = data_host.service.store  # type: ignore[attr-defined]
    failures = store.failures()
    assert sorted(tid for tid, _, _ in failures) == ["poison/0", "poison/1"]
    assert all(kind == "refused" and "max_model_len 4096" in why for _, kind, why in failures)
    batch = await data.sample.call(SampleRequest(n=16, whole_groups=True))
    assert len(batch.items) == 16 and not any(t.prompt_id == "poison" for t in batch.items)


async def test_a_lease_that_kills_its_rollouts_is_quarantined(serve, tmp_path, options):
    """The engine did not catch it: each holder dies (a closed connection, no leave)."""
    prompts = write_prompts(tmp_path / "prompts.jsonl", 4)
    manager, data_host = await manager_and_data(
        serve, tmp_path, prompts, samples_per_prompt=1, quarantine_after=2
    )
    data = data_host.ctx.connect(DataApi, data_host.ctx.address)

    async def hold_and_die(name: str) -> list[str]:
        client = RpcClient(manager, options, timeout=5.0)
        try:
            await remote(MembershipApi, client).join.call(
                JoinRequest(instance=name, role="rollout", address="tcp://127.0.0.1:9")
            )
            took = await data.take.call(TakeRequest(rollout=name, max_count=1, version=0))
        finally:
            await client.close()  # its connection to the manager closes without a leave: dead

        async def released():
            return name not in (await data.status.call()).leases

        await until(released, timeout=10)
        return [a.trajectory_id for a in took.items]

    first = await hold_and_die("doomed-1")
    assert (await data.status.call()).failed == 0  # one death proves nothing yet
    assert await hold_and_die("doomed-2") == first  # the suspect is first in the queue
    status = await data.status.call()
    assert (status.failed, status.quarantined) == (1, 1)
    rest = await data.take.call(TakeRequest(rollout="healthy", max_count=10, version=0))
    assert sorted(a.trajectory_id for a in rest.items) == sorted(
        f"p{i}/0" for i in range(4) if f"p{i}/0" != first[0]
    )
