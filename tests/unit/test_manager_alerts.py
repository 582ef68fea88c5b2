"""Counters that must stay at 0 in a healthy run (trajectories the trainer excluded, optimizer
steps it skipped) become "alert" events in the manager's log when a heartbeat shows them grow
(issue 15: silent corruption must be loud)."""

from __future__ import annotations

from laminar.runtime.membership import Heartbeat, JoinRequest, MembershipApi
from laminar.runtime.rpc.client import RpcClient, remote

from .test_chain_incarnation import OPTIONS, Manager, manager  # noqa: F401  (the fixture)


async def test_growing_trainer_counters_become_alert_events(manager: Manager):  # noqa: F811
    service = await manager.start()
    client = RpcClient(manager.address, OPTIONS, timeout=5.0)
    try:
        members = remote(MembershipApi, client)
        await members.join.call(
            JoinRequest(instance="trainer-0", role="trainer", address="tcp://127.0.0.1:1")
        )
        beats = [
            {"excluded_trajectories": 0.0, "skipped_steps": 0.0},
            {"excluded_trajectories": 0.0, "skipped_steps": 0.0},  # no growth: no event
            {"excluded_trajectories": 3.0, "skipped_steps": 0.0},
            {"excluded_trajectories": 3.0, "skipped_steps": 1.0},
            {"excluded_trajectories": 3.0, "skipped_steps": 1.0},
        ]
        for stats in beats:
            await members.heartbeat.call(Heartbeat(instance="trainer-0", stats=stats))
    finally:
        await client.close()
    alerts = [e.data for e in service.events.recent(kinds={"alert"})]
    assert [(a["what"], a["new"], a["total"]) for a in alerts] == [
        ("excluded_trajectories", 3.0, 3.0),
        ("skipped_steps", 1.0, 1.0),
    ]
    assert {a["member"] for a in alerts} == {"trainer-0"}
