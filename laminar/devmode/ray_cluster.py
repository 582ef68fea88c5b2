"""The Ray cluster of one ``laminar run --launcher ray``: found or started, and left as found.

``RAY_ADDRESS`` set: the run joins that cluster (``ray start --head`` beforehand) and only
disconnects at its end. Unset: it starts a local one (``ray.init``: one CPU per core this process
may use, no dashboard, a small object store since only small messages travel through it) and
shuts it down at its end, so none of Ray's processes outlives the run (they also die with the
driver, and block SIGINT, so a terminal's Ctrl-C reaches only the driver). The placement groups
the run reserved are removed either way.

Ray is imported only here and in :mod:`laminar.devmode.ray_launch`, and only when that launcher
is used: ``laminar`` works without it.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from laminar.devmode.ray_place import Machine, MachinePlan
from laminar.proc.cpus import available_cores
from laminar.runtime.errors import ConfigError

#: A local cluster's object store (bytes): only the actors' small calls and replies use it, so it
#: never takes the machine's /dev/shm from the relays (Ray's default is 30% of memory).
OBJECT_STORE_BYTES = 96 << 20
#: Seconds to wait for the placement groups (Ray reserving every machine's bundles).
PLACEMENT_TIMEOUT_S = 60.0


def require_ray() -> Any:
    """The ``ray`` module, or an error saying how to get it."""
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "--launcher ray needs Ray, which is not installed here: pip install 'ray>=2.40' "
            "(it is in the dev extra)"
        ) from None
    return ray


async def result(ref: Any) -> Any:
    """Await a Ray object ref on this event loop (through its concurrent future)."""
    return await asyncio.wrap_future(ref.future())


class RayCluster:
    """The Ray cluster of one run: connected to, or started and later shut down."""

    def __init__(self, ray: Any) -> None:
        self.ray = ray
        self.started = False
        self.groups: list[Any] = []

    def connect(self) -> str:
        """Join ``RAY_ADDRESS``'s cluster, or start a local one; says which."""
        address = os.environ.get("RAY_ADDRESS")
        if address:
            self.ray.init(address=address, logging_level=logging.WARNING)
            return f"connected to the Ray cluster at {address}"
        cpus = len(available_cores())
        self.ray.init(
            num_cpus=cpus,
            include_dashboard=False,
            object_store_memory=OBJECT_STORE_BYTES,
            logging_level=logging.WARNING,
        )
        self.started = True
        return f"started a local Ray cluster ({cpus} CPUs; it stops with the run)"

    def machines(self) -> list[Machine]:
        return [
            Machine(
                n["NodeID"],
                n["NodeManagerAddress"],
                float(n["Resources"].get("CPU", 0)),
                float(n["Resources"].get("GPU", 0)),
            )
            for n in self.ray.nodes()
            if n.get("Alive")
        ]

    def home(self) -> str:
        return str(self.ray.get_runtime_context().get_node_id())

    async def reserve(self, plans: list[MachinePlan], name: str) -> list[Any]:
        """One ``STRICT_PACK`` placement group per machine plan, once Ray has reserved them."""
        from ray.util.placement_group import placement_group

        for i, plan in enumerate(plans):
            group = placement_group(plan.bundles(), strategy="STRICT_PACK", name=f"{name}-{i}")
            self.groups.append(group)
        for plan, group in zip(plans, self.groups, strict=True):
            try:
                async with asyncio.timeout(PLACEMENT_TIMEOUT_S):
                    await result(group.ready())
            except TimeoutError:
                raise ConfigError(
                    f"--launcher ray: Ray could not reserve {plan.bundles()} on {plan.machine.ip} "
                    f"within {PLACEMENT_TIMEOUT_S:g} s (is something else using it?)"
                ) from None
        return self.groups

    def close(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for group in self.groups:
            try:
                remove_placement_group(group)
            except Exception:  # the cluster may be gone already; shutting down still applies
                logging.getLogger(__name__).debug("remove_placement_group failed", exc_info=True)
        self.groups = []
        if self.ray.is_initialized():
            self.ray.shutdown()  # a local cluster stops; a remote one is only disconnected
