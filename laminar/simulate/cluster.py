"""``laminar simulate run``: a user's own cluster config, every role's real code, virtual time.

Why: the sweep (:mod:`.sweep`) answers the paper's question with closed-form models of each
system. A capacity planner's question is about *this* config: how many rollouts keep this trainer
busy, what staleness results, what repack does with these lengths. Nothing answers that better
than the code that will run: here the manager (membership, chain planning, repack with Algorithm
1), the data role (queue, leases, partial pool, buffer, SQLite store), the relays (the real chain
moving real bytes), the sim trainer (the torch trainer's loop with the GPU work replaced by its
cost model) and sim-engine rollouts run as they would under ``laminar run``, in one process on
the in-process cluster (:mod:`laminar.harness.inproc`): every role over ``inproc://``, on virtual
time, so a run of minutes of cluster time takes the wall time its Python needs.

What may be simulated: every ``run.roles`` entry is started, ``count`` times, with its
``config`` overrides (names ``<section>-<i>``, as ``laminar run`` names them). Rollouts must use
``engine.backend: sim`` (its step-time model and length distribution are the GPU here) and the
trainer must be the ``sim_trainer`` role; anything else is refused with the reason. The same
figures as ``benchmarks/schedules.py`` (:mod:`.measure`) come out, so the two can be compared
(the benchmark's ``--mode both`` does, and a test holds them within 15%).

The sim engine advances one decode step at a time (one event per step, not per token), so a
run's wall time grows with rollouts x steps: tens of rollouts for minutes of cluster time take
seconds to minutes of wall time; the 1024-GPU cells of the paper are the sweep's.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from laminar.harness.inproc import InprocCluster
from laminar.harness.inproc_loop import InprocLoop, run_inproc
from laminar.roles_registry import builtin_roles, load_role
from laminar.runtime.clock import get_clock
from laminar.runtime.config import LaminarConfig
from laminar.runtime.errors import ConfigError
from laminar.runtime.membership import MembershipApi
from laminar.runtime.rpc.client import RpcClient

from .measure import figures, sample_cluster, trainer_records

__all__ = [
    "check_simulatable",
    "describe_runs",
    "members",
    "plan",
    "run_config",
    "with_rollouts",
    "with_schedule",
]

SAMPLE_S = 0.5  # the benchmark's sampling period


def members(config: LaminarConfig) -> list[tuple[str, str, str, dict[str, Any]]]:
    """``(section, name, role, overrides)`` for every process ``run.roles`` starts, in order."""
    base = Path(config.source).parent if config.source else None
    out = []
    for spec in config.run.roles:
        builtin = spec.role in builtin_roles()  # named as its section: nothing to import
        section = spec.section or (spec.role if builtin else load_role(spec.role, base).role)
        for i in range(spec.count):
            out.append((section, f"{section}-{i}", spec.role, dict(spec.config)))
    return out


def check_simulatable(config: LaminarConfig) -> None:
    """Refuse, with the reason, a config whose roles have no cost model here."""
    problems = []
    started = members(config)
    sections = [m[0] for m in started]
    if sections.count("manager") != 1 or sections[0] != "manager":
        problems.append("run.roles must start exactly one manager, first")
    if "trainer" in sections or "trainer_rank" in sections:
        problems.append(
            "the torch trainer (role trainer) computes for real: simulate with role sim_trainer "
            "and its cost model (section sim_trainer: batch, cost, weight_bytes)"
        )
    if "rollout" not in sections:
        problems.append("run.roles starts no rollout")
    for section, name, _, overrides in started:
        if section == "rollout":
            engine = {**config.section("rollout").get("engine", {}), **overrides.get("engine", {})}
            if engine.get("backend") != "sim":
                problems.append(
                    f"{name}: engine.backend {engine.get('backend')!r} runs a model; the simulator "
                    "needs backend: sim (its cost and lengths stand for the GPU)"
                )
    if problems:
        raise ConfigError("cannot simulate this config:\n  " + "\n  ".join(problems))


def with_rollouts(config: LaminarConfig, count: int) -> LaminarConfig:
    """``config`` with ``count`` rollouts (the one ``run.roles`` entry of section rollout)."""
    specs = [s for s in config.run.roles if (s.section or s.role) == "rollout"]
    if len(specs) != 1:
        raise ConfigError("--rollouts needs exactly one run.roles entry for the rollout role")
    new = config.model_copy(deep=True)
    for spec in new.run.roles:
        if (spec.section or spec.role) == "rollout":
            spec.count = count
    return new


def with_schedule(config: LaminarConfig, kind: str) -> LaminarConfig:
    """``config`` under schedule ``kind`` (``cluster.schedule.kind``)."""
    schedule = config.cluster.schedule
    try:
        checked = type(schedule).model_validate({**schedule.model_dump(), "kind": kind})
    except ValidationError as exc:
        raise ConfigError(f"--schedules: {kind!r}: {exc.errors()[0]['msg']}") from None
    new = config.model_copy(deep=True)
    new.cluster.schedule = checked
    return new


def plan(
    config: LaminarConfig,
    *,
    rollouts: list[int] | None = None,
    schedules: list[str] | None = None,
    duration_s: float,
    warmup_s: float,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """One simulated run per (schedule, rollout count): the capacity planner's table. ``None``
    keeps what the config says."""
    rows = []
    for kind in schedules or [config.cluster.schedule.kind]:
        counts: list[int | None] = [*rollouts] if rollouts else [None]
        for count in counts:
            c = with_schedule(config, kind)
            if count is not None:
                c = with_rollouts(c, count)
            started = time.perf_counter()
            out = run_config(c, duration_s=duration_s, warmup_s=warmup_s, seed=seed)
            n = sum(1 for m in members(c) if m[0] == "rollout")
            rows.append(
                {"schedule": kind, "rollouts": n, **out, "wall_s": time.perf_counter() - started}
            )
    return rows


def describe_runs(rows: list[dict[str, Any]]) -> list[str]:
    """The table :func:`plan`'s rows print as."""
    head = (
        f"{'schedule':<14}{'rollouts':>9}{'trained tok/s':>15}{'trainer busy':>14}"
        f"{'rollout util':>14}{'KV use':>8}{'staleness':>11}{'max':>5}{'versions':>10}"
        f"{'wall s':>8}"
    )
    lines = [head]
    for r in rows:
        f = _formatter(r)
        lines.append(
            f"{r['schedule']:<14}{r['rollouts']:>9}{f('trained_tokens_per_s', '.0f'):>15}"
            f"{f('trainer_busy', '.0%'):>14}{f('rollout_utilisation', '.0%'):>14}"
            f"{f('kv_util', '.0%'):>8}{f('staleness_mean', '.2f'):>11}"
            f"{f('staleness_max', 'd'):>5}{r['versions']:>10}{r['wall_s']:>8.1f}"
        )
    return lines


def _formatter(row: dict[str, Any]) -> Any:
    def f(key: str, fmt: str) -> str:
        value = row.get(key)
        return "-" if value is None else format(value, fmt)

    return f


def run_config(
    config: LaminarConfig,
    *,
    duration_s: float,
    warmup_s: float,
    seed: int = 0,
) -> dict[str, Any]:
    """Run ``config``'s cluster for ``warmup_s + duration_s`` virtual seconds; its figures."""
    check_simulatable(config)
    with tempfile.TemporaryDirectory(prefix="laminar-simulate-") as tmp:
        config = _seeded(config, seed, Path(tmp))
        return run_inproc(lambda: _run(config, duration_s, warmup_s), seed=seed)


def _seeded(config: LaminarConfig, seed: int, tmp: Path) -> LaminarConfig:
    """The config with ``seed`` for the data role and the engines, and the data store in ``tmp``;
    the trainer keeps its records in memory (no metrics file, state file or tracking), so a
    simulation never writes into a real run's files."""
    new = config.model_copy(deep=True)
    extra = new.model_extra
    assert extra is not None
    extra["data"] = {**new.section("data"), "seed": seed, "store": str(tmp / "data.sqlite")}
    rollout = new.section("rollout")
    if isinstance(rollout.get("engine"), dict):
        extra["rollout"] = {**rollout, "engine": {**rollout["engine"], "seed": seed}}
    trainer = new.section("sim_trainer")
    dropped = ("metrics_file", "state_file", "tracking")
    extra["sim_trainer"] = {k: v for k, v in trainer.items() if k not in dropped}
    return new


async def _run(config: LaminarConfig, duration_s: float, warmup_s: float) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    assert isinstance(loop, InprocLoop)
    cluster = InprocCluster(config, loop)
    clock = get_clock()
    samples: list[dict[str, Any]] = []
    with cluster.fence.installed():
        try:
            trainer_name = None
            for section, name, role, overrides in members(config):
                await cluster.start(section, name, overrides, role)
                if section == "sim_trainer":
                    trainer_name = name
            manager = cluster.proxy(MembershipApi, "manager-0")
            start = clock.wall()
            while clock.wall() - start < warmup_s + duration_s:
                samples.append(await sample_cluster(manager, clock.wall()))
                await clock.sleep(SAMPLE_S)
            records = []
            if trainer_name is not None:
                client = RpcClient(cluster.address(trainer_name), cluster.options, timeout=30.0)
                try:
                    records = await trainer_records(client)
                finally:
                    await client.close()
        finally:
            await cluster.close()
    out = figures(samples, records, start + warmup_s)
    out["virtual_s"] = warmup_s + duration_s
    return out
