"""Chaos benchmark: kill any role, cut a link; how long until the cluster is whole again, and was
anything lost? (The paper's fault-recovery experiment, Fig. 15, on this machine.)

The emulated cluster (sim engines, the sim trainer; real processes, real RPC, real relays moving
real bytes) runs over emulated hosts (:mod:`chaos_cluster`): the control plane on host 0, a relay
and rollouts on each of the next hosts, one rollout alone on the last. Response lengths are
lognormal by default (``--lengths paper`` for the paper's bimodal ones): with the paper's long
tail every rollout drains for each new version at the same moment, and the cluster's generation
rate swings by +-25% with the period of the longest trajectory even without a fault, too much for
a 10% recovery band; the lognormal keeps the windows' spread near 4% (measured, no faults).
After ``--warmup`` seconds, one fault every ``--settle`` seconds, in turn:

``rollout`` / ``relay`` (a relay in the chain that is not the master) / ``master_relay`` /
``trainer`` / ``data`` / ``manager``: ``kill -9`` of that role's process; the orchestrator brings it
back with the same command as soon as it sees it gone (what Kubernetes or systemd would do).
``partition``: the lone rollout's link is pulled at the switch for ``--cut-s`` seconds (longer
than the heartbeat timeout), then put back; nothing is killed.

Per fault (:mod:`chaos_measure` defines the windows): ``gen_recovery_s`` and ``train_recovery_s``
(back within 10% of the pre-fault level, for good), the depth of the dip, ``back_s`` (the killed
process ready again), ``detected_s`` (the manager marked it dead), ``members_s`` (every role a live
member of the manager again), ``weights_s`` (every rollout loaded a version published after the
fault) and, for relays, ``relay_repair_s`` (the manager's chain without the dead relay, by the
manager's own clock, minus the kill), and what it cost: samples the data role recorded as
``failed`` and trajectories ``trained_again`` (by a trainer restarted after it). Over the run:
``lost`` and ``duplicated`` (from the data role's SQLite store and the trainer's per-version
records; :func:`chaos_measure.account` says what counts), ``stuck`` (roles not running, not a
live member, or not making progress over the last ``--stuck-window`` seconds) and ``crashes``
(exits nobody asked for). Goals (issue 15): lost = duplicated = stuck = 0, relay repair < 1 s,
every other recovery < 30 s.

``--soak SECONDS``: one fault every ``--soak-interval`` seconds for that long; every role's
memory (its whole session, from /proc) is sampled and each role's growth reported: resident
anonymous memory, where a leak shows (goal < 10% over the hour), and resident memory as a whole.

Each run leaves its directory (``--workdir``, default ``runs/chaos/<time>``): the config, every
role's log, the data role's store, the trainer's records, ``raw.json`` (every sample; ``--analyse
DIR`` computes the figures again from it) and ``chaos.png`` (throughput with the faults marked).

    python benchmarks/chaos.py --json OUT.json [--warmup 60 --settle 50] [--soak 3600]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from chaos_cluster import (  # noqa: E402
    TOKEN,
    Orchestrator,
    Topology,
    enter_host,
    open_lab,
    plan,
    write_config,
)
from chaos_measure import Clients, Sampler  # noqa: E402
from chaos_report import analyse, plot, print_table  # noqa: E402

from laminar.runtime.config import ClusterConfig  # noqa: E402
from laminar.runtime.context import transport_options  # noqa: E402

FAULTS = ("rollout", "relay", "master_relay", "trainer", "data", "manager", "partition")
KILLS = {"trainer": "trainer", "data": "data", "manager": "manager"}


class Chaos:
    """Runs the schedule of faults against a started cluster, sampling all along."""

    def __init__(self, args: argparse.Namespace, topo: Topology, orch: Orchestrator) -> None:
        self.args, self.topo, self.orch = args, topo, orch
        self.clients = Clients(transport_options(ClusterConfig(), TOKEN.encode()))
        self.sampler = Sampler(self.clients, self.address)
        self.rollouts = [s.name for s in topo.specs if s.role == "rollout"]
        self.relays = [s.name for s in topo.specs if s.role == "relay"]
        self._next_rollout = 0

    def address(self, name: str) -> str | None:
        info = self.orch.cluster.info.get(name)
        return info["address"] if info else None

    def schedule(self) -> list[tuple[float, str]]:
        """(seconds from the start, fault kind)."""
        a = self.args
        kinds = [k for k in a.faults.split(",") if k]
        if self.topo.lab is None:
            kinds = [k for k in kinds if k != "partition"]
        if a.soak:
            n = max(1, int((a.soak - a.warmup) // a.soak_interval))
            return [(a.warmup + i * a.soak_interval, kinds[i % len(kinds)]) for i in range(n)]
        return [(a.warmup + i * a.settle, k) for i, k in enumerate(kinds)]

    def end_offset(self, schedule: list[tuple[float, str]]) -> float:
        a = self.args
        if a.soak:
            return float(a.soak)
        return (schedule[-1][0] if schedule else a.warmup) + a.settle

    async def run(self) -> dict[str, Any]:
        stop = asyncio.Event()
        sampling = asyncio.create_task(self.sampler.run(0.5, stop))
        memory = asyncio.create_task(self._rss(stop))
        schedule = self.schedule()
        t0 = time.time()
        faults: list[dict[str, Any]] = []
        try:
            for offset, kind in schedule:
                await _sleep_until(t0 + offset)
                record = await self.inject(kind)
                print(f"  t={record['at'] - t0:6.1f} s  {kind:<12} {record.get('target')}",
                      flush=True)  # fmt: skip
                faults.append(record)
            end = t0 + self.end_offset(schedule)
            await _sleep_until(end)
            loads = {n: await self.sampler.weight_loads(n) for n in self.rollouts}
            relay_seen = {n: await self.sampler.relay_versions(n) for n in self.relays}
        finally:
            stop.set()
            await asyncio.gather(sampling, memory, return_exceptions=True)
            await self.clients.close()
        return {
            "t0": t0,
            "end": end,
            "faults": faults,
            "loads": loads,
            "relay_received": relay_seen,
            "samples": self.sampler.samples,
        }

    async def inject(self, kind: str) -> dict[str, Any]:
        record: dict[str, Any] = {"fault": kind}
        if kind == "partition":
            return await self._partition(record)
        if kind == "rollout":
            candidates = [r for r in self.rollouts if r != self.topo.cut_rollout]
            target = candidates[self._next_rollout % len(candidates)]
            self._next_rollout += 1
        elif kind in ("relay", "master_relay"):
            chain = self.sampler.samples.chain[-1][2] if self.sampler.samples.chain else []
            if len(chain) < 2:
                record.update(target=None, at=time.time(), skipped=f"chain is {chain}")
                return record
            # a relay with an upstream and (with 3 or more) a downstream: the route-around case
            target = chain[0] if kind == "master_relay" else chain[1]
            record["chain_before"] = chain
        elif kind in KILLS:
            target = KILLS[kind]
        else:
            raise ValueError(f"unknown fault {kind!r}; known: {', '.join(FAULTS)}")
        record["target"] = target
        record["pid"] = self.orch.pid(target)
        record["at"] = self.orch.kill9(target)
        if kind in ("relay", "master_relay"):
            record.update(await self.sampler.relay_repair(target, record["at"]))
        return record

    async def _partition(self, record: dict[str, Any]) -> dict[str, Any]:
        name = self.topo.cut_rollout
        assert name is not None
        host = self.orch.specs[name].host
        record.update(target=name, pid=self.orch.pid(name), at=time.time())
        self.topo.link(host, up=False)
        try:
            await asyncio.sleep(self.args.cut_s)
        finally:
            self.topo.link(host, up=True)
        record["restored_at"] = time.time()
        return record

    async def _rss(self, stop: asyncio.Event) -> None:
        interval = 10.0 if self.args.soak else 5.0
        while not stop.is_set():
            rss = await asyncio.to_thread(self.orch.memory_mib)
            self.sampler.samples.rss.append((time.time(), rss))
            try:
                await asyncio.wait_for(stop.wait(), interval)
            except TimeoutError:
                pass


async def _sleep_until(t: float) -> None:
    delay = t - time.time()
    if delay > 0:
        await asyncio.sleep(delay)


def stop_order(topo: Topology) -> list[list[str]]:
    """Members that report before those they report to; the manager last."""
    by_role: dict[str, list[str]] = {}
    for s in topo.specs:
        by_role.setdefault(s.role, []).append(s.name)
    return [by_role.get(r, []) for r in ("rollout", "sim_trainer", "relay", "data", "manager")]


def sweep_shm(pids: set[int]) -> list[str]:
    """Shared-memory segments of our (dead) roles: relays killed with -9 leave theirs."""
    removed = []
    for name in os.listdir("/dev/shm"):
        parts = name.split("-")
        if len(parts) != 3 or parts[0] != "laminar":
            continue
        try:
            pid = int(parts[1], 16)
        except ValueError:
            continue
        if pid in pids and not Path(f"/proc/{pid}").exists():
            Path("/dev/shm", name).unlink(missing_ok=True)
            removed.append(name)
    return removed


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", type=Path, help="write the figures here")
    p.add_argument("--workdir", type=Path, help="config, store, logs, plot (default runs/chaos/..)")
    p.add_argument("--analyse", type=Path, metavar="WORKDIR", help="only analyse a finished run")
    p.add_argument("--faults", default=",".join(FAULTS), help="which, in this order")
    p.add_argument("--rollouts", type=int, default=8)
    p.add_argument("--relays", type=int, default=3)
    p.add_argument("--warmup", type=float, default=60.0, help="seconds before the first fault")
    p.add_argument("--settle", type=float, default=50.0, help="seconds between faults")
    p.add_argument("--cut-s", type=float, default=10.0, help="link cut (> heartbeat timeout)")
    p.add_argument("--heartbeat-timeout", type=float, default=5.0)
    p.add_argument("--window-s", type=float, default=20.0, help="throughput window")
    p.add_argument("--pre-s", type=float, default=30.0, help="pre-fault level window")
    p.add_argument("--stuck-window", type=float, default=15.0)
    p.add_argument("--soak", type=float, default=0.0, help="soak mode: run this long (seconds)")
    p.add_argument("--soak-interval", type=float, default=180.0, help="soak: seconds per fault")
    p.add_argument("--loopback", action="store_true", help="no namespaces (no link cut)")
    p.add_argument("--no-repack", action="store_true")
    p.add_argument("--concurrency", type=int, default=16, help="trajectories per rollout")
    p.add_argument("--samples", type=int, default=4, help="samples per prompt")
    p.add_argument("--batch-prompts", type=int, default=16, help="prompt groups per batch")
    p.add_argument("--lengths", choices=("paper", "lognormal"), default="lognormal")
    p.add_argument("--length-scale", type=float, default=64.0)
    p.add_argument("--step-scale", type=float, default=8.0)
    p.add_argument("--train-base-s", type=float, default=1.0, help="sim trainer s per update")
    p.add_argument("--weight-mib", type=float, default=8.0, help="bytes published per version")
    args = p.parse_args()
    unknown = set(args.faults.split(",")) - set(FAULTS) - {""}
    if unknown:
        p.error(f"unknown faults {sorted(unknown)}; known: {', '.join(FAULTS)}")
    if args.cut_s <= args.heartbeat_timeout:
        p.error("--cut-s must exceed --heartbeat-timeout (the cut must outlast detection)")
    return args


def run_cluster(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Start the cluster, run the faults, stop it all; what :func:`analyse` needs (raw.json)."""
    # SIGTERM ends the run like Ctrl-C: every finally below runs, everything started is stopped
    signal.signal(signal.SIGTERM, _interrupt)
    lab, why = (None, "--loopback") if args.loopback else open_lab(args.relays + 2)
    if lab is None:
        print(f"no network namespaces ({why}): loopback, no link cut", flush=True)
    orch: Orchestrator | None = None
    raw: dict[str, Any] = {}
    leave = None
    try:
        if lab is not None:
            leave = enter_host(lab, 0)
        topo = plan(lab, args.rollouts, args.relays)
        orch = Orchestrator(topo, write_config(workdir, args), workdir / "logs")
        started = time.time()
        print(f"starting {len(topo.specs)} roles (logs in {workdir / 'logs'})", flush=True)
        try:
            orch.start_all()
            print(f"  all ready in {time.time() - started:.0f} s; faults:", flush=True)
            raw = asyncio.run(Chaos(args, topo, orch).run())
            raw["startup_s"] = raw["t0"] - started
            raw["restarting_at_end"] = sorted(orch.restarting)
        finally:
            raw["codes"] = orch.stop(stop_order(topo))
    finally:
        if leave is not None:
            leave()  # out of host 0 first: closing the lab kills what is inside it
        if lab is not None:
            lab.close()
        if orch is not None:
            pids = {inc.pid for incs in orch.history.values() for inc in incs}
            swept = sweep_shm(pids)
            if swept:
                print(f"removed {len(swept)} shared-memory segments of killed relays")
    samples = raw.pop("samples")
    raw["samples"] = {
        "members": samples.members,
        "chain": samples.chain,
        "data": samples.data,
        "rss": samples.rss,
        "errors": samples.errors,
    }
    raw["history"] = {n: [dataclasses.asdict(i) for i in incs] for n, incs in orch.history.items()}
    raw["roles"] = {s.name: s.role for s in topo.specs}
    raw["hosts"] = {s.name: s.host for s in topo.specs}
    raw["network"] = "namespaces" if topo.lab is not None else "loopback"
    raw["failures"] = orch.failures
    return raw


def main() -> None:
    args = parse()
    if args.analyse:  # figures again from a finished run's directory
        workdir = args.analyse
        raw = json.loads((workdir / "raw.json").read_text())
    else:
        workdir = args.workdir or ROOT / "runs" / "chaos" / time.strftime("%Y%m%d-%H%M%S")
        workdir = workdir.resolve()  # the roles run in the repository root, not in our cwd
        workdir.mkdir(parents=True, exist_ok=True)
        try:
            raw = run_cluster(args, workdir)
        except KeyboardInterrupt:
            print("interrupted: every process and namespace of the run is gone", flush=True)
            sys.exit(130)
        (workdir / "raw.json").write_text(json.dumps(raw))
    report = analyse(args, raw, workdir)
    report["workdir"] = str(workdir)
    print_table(report)
    png = plot(report, workdir / "chaos.png")
    if png:
        print(f"plot: {png}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
