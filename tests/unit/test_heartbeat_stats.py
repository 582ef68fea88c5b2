"""Heartbeat stats are read through typed models (``laminar.runtime.stats``), never by string key.

On the wire they stay ``dict[str, float]``; a reader that spelled a key wrong used to get 0 and
carry on. Parsed once into the role's model, a wrong name is an ``AttributeError`` (and a type
checker's error), a count that is not a whole number is refused naming the key, and a key no
model knows is kept.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from laminar.roles.manager.api import parse_stats
from laminar.roles.relay.api import RelayStats
from laminar.roles.rollout.api import RolloutPhase, RolloutStats
from laminar.roles.trainer.api import TrainerStats
from laminar.runtime.membership import Heartbeat, JoinRequest, Member, MembershipApi
from laminar.runtime.rpc.client import RpcClient, remote
from laminar.runtime.stats import HeartbeatStats, VersionedStats

from .test_chain_incarnation import OPTIONS, Manager, manager  # noqa: F401  (the fixture)

# What ``RolloutService.stats`` sends: every number a float.
ROLLOUT = {
    "kv_cache_usage": 0.42,
    "running": 3.0,
    "waiting": 1.0,
    "in_flight": 4.0,
    "version": 7.0,
    "generated_tokens": 900.0,
    "completed": 12.0,
    "failed": 0.0,
    "paused_for_weights": 0.0,
    "operator_drain": 1.0,
    "migrating": 0.0,
    "starved": 0.0,
    "phase": 1.0,  # its code: draining
}


def test_a_misspelled_read_is_an_error_not_a_silent_zero() -> None:
    assert ROLLOUT.get("kv_cache_usag", 0.0) == 0.0  # how a typo used to read
    stats = RolloutStats.parse(ROLLOUT)
    assert stats is not None
    with pytest.raises(AttributeError, match="kv_cache_usag"):
        stats.kv_cache_usag  # type: ignore[attr-defined]  # noqa: B018
    assert (stats.kv_cache_usage, stats.version, stats.in_flight) == (0.42, 7, 4)
    assert type(stats.version) is int and stats.operator_drain is True
    assert stats.phase == "draining"


def test_unknown_keys_are_kept_and_no_heartbeat_yet_is_none() -> None:
    stats = parse_stats("spawner", {"child_pid": 4242.0})  # a role with no model of its own
    assert type(stats) is HeartbeatStats and stats.model_extra == {"child_pid": 4242.0}
    rollout = RolloutStats.parse({**ROLLOUT, "new_metric": 1.5})
    assert rollout is not None and rollout.model_extra == {"new_metric": 1.5}
    assert parse_stats("rollout", {}) is None  # not "every number is 0"
    assert RelayStats.parse({"chain_epoch": 2.0}) == RelayStats(chain_epoch=2, version=-1)


def test_each_role_parses_to_its_model() -> None:
    assert type(parse_stats("rollout", ROLLOUT)) is RolloutStats
    for role in ("trainer", "sim_trainer"):
        stats = parse_stats(role, {"version": 3.0, "skipped_steps": 1.0})
        assert isinstance(stats, TrainerStats) and stats.alert_counters() == {
            "excluded_trajectories": 0,
            "skipped_steps": 1,
        }
    relay = parse_stats("relay", {"version": 5.0, "chain_epoch": 1.0, "chain_position": 0.0})
    assert isinstance(relay, VersionedStats) and relay.version == 5


@pytest.mark.parametrize(
    ("key", "value"), [("version", 2.5), ("in_flight", float("nan")), ("migrating", 0.5)]
)
def test_a_value_that_is_not_what_the_key_means_is_refused_naming_the_key(
    key: str, value: float
) -> None:
    with pytest.raises(ValidationError, match=key):
        RolloutStats.parse({**ROLLOUT, key: value})


@pytest.mark.parametrize("phase", list(RolloutPhase))
def test_the_phase_travels_as_its_code_and_reads_back_as_the_same_value(phase: RolloutPhase):
    sent = RolloutStats(phase=phase).wire()
    assert sent["phase"] == float(phase.code)
    got = RolloutStats.parse(sent)
    assert got is not None and got.phase is phase and got.phase == phase.value


@pytest.mark.parametrize("code", [-1.0, 0.5, float(len(RolloutPhase))])
def test_a_phase_code_no_phase_has_is_refused(code: float) -> None:
    with pytest.raises(ValidationError, match="phase"):
        RolloutStats.parse({**ROLLOUT, "phase": code})


def test_member_reads_its_stats_typed_and_the_wire_format_is_unchanged() -> None:
    member = Member(instance="rollout-0", role="rollout", address="tcp://x", stats=ROLLOUT)
    assert (
        member.stats_as(RolloutStats)
        == parse_stats(member.role, member.stats)
        == RolloutStats.model_validate(ROLLOUT)
    )
    assert member.model_dump()["stats"] == ROLLOUT  # the dict as sent, nothing added
    assert Member(instance="r", role="rollout", address="tcp://x").stats_as(RolloutStats) is None


async def test_the_manager_refuses_stats_that_do_not_parse_and_keeps_the_last_good(
    manager: Manager,  # noqa: F811
) -> None:
    """A producer's bug (a fractional version) must not reach the repack planner or the admin
    API, and must not cost the member its liveness: the beat counts, its numbers do not."""
    service = await manager.start()
    client = RpcClient(manager.address, OPTIONS, timeout=5.0)
    try:
        members = remote(MembershipApi, client)
        await members.join.call(
            JoinRequest(instance="rollout-0", role="rollout", address="tcp://127.0.0.1:1")
        )
        await members.heartbeat.call(Heartbeat(instance="rollout-0", stats=ROLLOUT))
        seen = service.members["rollout-0"].last_seen
        bad = {**ROLLOUT, "version": 8.5, "in_flight": 9.0}
        ack = await members.heartbeat.call(Heartbeat(instance="rollout-0", stats=bad))
    finally:
        await client.close()
    member = service.members["rollout-0"]
    assert not ack.rejoin and member.state == "alive" and member.last_seen >= seen
    assert member.stats == ROLLOUT
    assert [(load.version, load.n_reqs) for load in service.repack.loads()] == [(7, 4)]


def test_a_model_on_the_wire_parses_back_to_itself_with_every_key() -> None:
    """What a producer publishes with ``wire()`` is exactly what the readers parse."""
    sent = RolloutStats(version=3, running=2, kv_cache_usage=0.25, paused_for_weights=True)
    wire = sent.wire()
    assert set(wire) == set(RolloutStats.model_fields) and all(
        isinstance(v, float) for v in wire.values()
    )
    assert RolloutStats.parse(wire) == sent
