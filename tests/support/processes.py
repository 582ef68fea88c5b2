"""Process lists shared by tests of the CPU plan and of ``laminar doctor``."""

from __future__ import annotations

#: ``(name, section)`` of every process ``examples/arith/config.yaml``'s ``run.roles`` starts,
#: in start order (what ``plan_cpus`` and ``RunNeeds.processes`` take)
ARITH_PROCESSES: tuple[tuple[str, str], ...] = (
    ("manager-0", "manager"),
    ("data-0", "data"),
    ("relay-0", "relay"),
    ("trainer-0", "trainer"),
    ("rollout-0", "rollout"),
    ("rollout-1", "rollout"),
)
