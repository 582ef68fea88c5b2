"""Where ``laminar run --launcher ray`` puts each role instance: one placement group per machine.

Pure planning (no Ray here), so the rules are unit-tested on made-up clusters:

* Each instance asks for Ray resources: a trainer or a rollout :data:`HEAVY_CPUS` (a core to
  drive its engine or its ranks) and its GPUs; every other role :data:`LIGHT_CPUS` (the manager,
  the data role, relays and user roles idle most of the time; Ray's CPUs are only counted, never
  enforced, and a bundle cannot be empty).
* GPUs come from the role's own config (:func:`gpus_wanted`): a vLLM rollout takes its
  tensor-parallel size, a ``sim`` rollout none; a trainer takes ``data_parallel`` GPUs when its
  ``device`` is ``cuda`` (or ``auto`` on a cluster with GPUs); nothing on a cluster without GPUs.
* The trainer is placed first, then the rollouts, most GPUs first, each on the first machine
  with room (first-fit decreasing: rollouts are packed onto as few machines as their GPUs allow).
  Machines are tried in a fixed order: the driver's own first, then the others by address.
* Every machine that got a rollout gets one relay (the config's relay count is replaced: a
  rollout pulls weights from the relay on its own host, through shared memory), named
  ``relay-0``, ``relay-1``, ... in machine order; room for it is kept when the first rollout
  lands on a machine. With relays but no rollouts, the config's count runs as light roles.
* Light roles go to the driver's machine if they fit, else the first with room.

Each machine's instances become one placement group of ``STRICT_PACK`` bundles, one bundle per
instance, each also asking for a sliver of the machine's own ``node:IP`` resource, so the group
lands on the machine planned (:meth:`MachinePlan.bundles`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from laminar.proc.gpus import gpus_wanted
from laminar.runtime.errors import ConfigError

__all__ = ["Demand", "Machine", "MachinePlan", "cpus_wanted", "gpus_wanted", "plan_placement"]

#: Ray CPUs asked for by a role that computes (rollout, trainer) and by one that mostly waits.
HEAVY_CPUS = 1.0
LIGHT_CPUS = 0.1
#: The share of a machine's ``node:IP`` resource each bundle takes: pins it there, limits nothing.
NODE_SHARE = 0.001


@dataclass(frozen=True)
class Machine:
    """One alive node of the Ray cluster, with what Ray says it has."""

    node_id: str
    ip: str
    cpus: float
    gpus: float


@dataclass(frozen=True)
class Demand:
    """What one role instance asks for."""

    name: str  # instance: rollout-0
    role: str  # manager, data, relay, trainer, rollout, or a user role
    cpus: float
    gpus: float = 0.0


@dataclass
class MachinePlan:
    machine: Machine
    demands: list[Demand] = field(default_factory=list)

    def bundles(self) -> list[dict[str, float]]:
        """The placement group's bundles, in the order of :attr:`demands`."""
        out = []
        for d in self.demands:
            bundle = {"CPU": d.cpus, f"node:{self.machine.ip}": NODE_SHARE}
            if d.gpus:
                bundle["GPU"] = d.gpus
            out.append(bundle)
        return out


def cpus_wanted(role: str) -> float:
    return HEAVY_CPUS if role in ("rollout", "trainer") else LIGHT_CPUS


def plan_placement(
    machines: list[Machine], demands: list[Demand], relays: list[Demand], home: str
) -> list[MachinePlan]:
    """Place ``demands`` (every instance but the relays) and the config's ``relays`` on
    ``machines``; ``home`` is the driver's node id. Only machines that got something are
    returned, in machine order. A demand that fits nowhere is a :class:`ConfigError` saying what
    is free where."""
    relay = relays[0] if relays else None
    order = sorted(machines, key=lambda m: (m.node_id != home, m.ip, m.node_id))
    plans = {m.node_id: MachinePlan(m) for m in order}
    free = {m.node_id: [m.cpus, m.gpus] for m in order}
    relayed: set[str] = set()

    def take(d: Demand, need_relay: bool = False) -> str:
        extra = relay.cpus if need_relay and relay is not None else 0.0
        for m in order:
            cpus, gpus = free[m.node_id]
            if need_relay and m.node_id not in relayed:
                cpus -= extra
            if cpus + 1e-9 >= d.cpus and gpus + 1e-9 >= d.gpus:
                free[m.node_id][0] -= d.cpus
                free[m.node_id][1] -= d.gpus
                plans[m.node_id].demands.append(d)
                return m.node_id
        have = ", ".join(f"{m.ip} {free[m.node_id][0]:g} CPU {free[m.node_id][1]:g} GPU"
                         for m in order)  # fmt: skip
        raise ConfigError(
            f"--launcher ray: {d.name} needs {d.cpus:g} CPU and {d.gpus:g} GPU on one machine"
            f"{' beside a relay' if extra and relay else ''}; free in the Ray cluster: {have}"
        )

    heavy = sorted(
        (d for d in demands if d.role in ("trainer", "rollout")),
        key=lambda d: (d.role != "trainer", -d.gpus),
    )
    for d in heavy:
        where = take(d, need_relay=d.role == "rollout")
        if d.role == "rollout":
            relayed.add(where)
    if relay is not None:
        base = relay.name.rsplit("-", 1)[0]
        hosts = [m.node_id for m in order if m.node_id in relayed]
        if hosts:
            for k, node_id in enumerate(hosts):
                d = Demand(f"{base}-{k}", relay.role, relay.cpus, relay.gpus)
                free[node_id][0] -= d.cpus
                plans[node_id].demands.append(d)
        else:
            for d in relays:
                take(d)
    for d in demands:
        if d.role not in ("trainer", "rollout"):
            take(d)
    return [plans[m.node_id] for m in order if plans[m.node_id].demands]
