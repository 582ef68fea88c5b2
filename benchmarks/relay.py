"""Relay benchmark: how fast a weight version reaches every relay, and what it costs the trainer.

Two settings, both with real relay processes and Laminar's transfer protocol:

1. **loopback** — every relay on this machine's 127.0.0.1, so all share its cores: raw speed, not
   scaling. ``loopback_p2p_gbps`` (trainer -> one relay) against ``memcpy_gbps`` (the machine's
   limit), per transport (tcp, and ucx where ucxx is installed).
2. **netns** — one network namespace per node, veth links shaped to ``--rate-mbit`` with tc
   (``laminar.harness.netns``), so links, not cores, are the bottleneck as on a cluster (default 500
   Mbit/s: at 1 Gbit/s a chain of 8 relays pushes 16 Gbit/s through veths and the bridge, and
   this machine's 2 cores, not the links, become the limit):
   ``p2p_s`` (one transfer between two hosts, the ideal), ``chain_s`` for 1, 2, 4 and 8 relays
   (trainer -> master -> ... chunked and pipelined), ``star_s`` for 8 (the sender sends to each
   in turn), ``chain8_over_p2p`` (goal <= 1.3) and ``star8_over_chain8``; ``trainer_stall_s`` with
   1 and 8 relays (the publish stall, measured while the previous version is still broadcasting)
   and ``stall8_over_stall1`` (goal <= 1.1).

Where namespaces are not permitted the script says why and reports setting 1 alone.

    python benchmarks/relay.py --json OUT.json [--mib 256] [--rate-mbit 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from laminar import transport  # noqa: E402
from laminar.harness.launch import ProcessCluster  # noqa: E402
from laminar.harness.netns import NetLab, probe  # noqa: E402
from laminar.roles.relay.api import RelayApi  # noqa: E402
from laminar.roles.trainer.publisher import WeightPublisher  # noqa: E402
from laminar.runtime.config import ClusterConfig  # noqa: E402
from laminar.runtime.context import transport_options  # noqa: E402
from laminar.runtime.rpc.client import RpcClient, remote  # noqa: E402
from laminar.weights.config import PublishConfig  # noqa: E402
from laminar.weights.manifest import chain_time, optimal_chunks  # noqa: E402
from laminar.weights.transfer import VersionStore, push_version, receive_versions  # noqa: E402

TOKEN = "relay-benchmark-token-0123456789"
MIB = 1 << 20


def weights(mib: int, seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    n = 32
    return [(f"w{i}", torch.randn(mib * MIB // 4 // n, generator=g)) for i in range(n)]


def memcpy_gbps(mib: int) -> float:
    src = np.random.default_rng(0).integers(0, 255, mib * MIB, dtype=np.uint8)
    dst = np.empty_like(src)
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(3))
    return mib * MIB * 8 / best / 1e9


def _timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def write_config(directory: Path, manager_bind: str, weights_bind: str) -> Path:
    config = {
        "cluster": {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 5.0},
        "manager": {"bind": manager_bind, "metrics": None, "admin": "127.0.0.1:0"},
        "relay": {"weights_bind": weights_bind, "metrics": None, "keep": 2},
    }
    path = directory / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


class Bench:
    """A manager, relays (optionally each in its own namespace), and the trainer's publisher."""

    def __init__(self, cluster: ProcessCluster, publish: PublishConfig) -> None:
        self.cluster = cluster
        self.options = transport_options(ClusterConfig(), TOKEN.encode())
        self.clients: dict[str, RpcClient] = {}
        self.relays: list[str] = []
        assert cluster.manager is not None
        self.publisher = WeightPublisher(
            publish, self.options, manager=self._client(cluster.manager)
        )
        self.version = 0

    def _client(self, address: str) -> RpcClient:
        if address not in self.clients:
            self.clients[address] = RpcClient(address, self.options, timeout=30.0)
        return self.clients[address]

    def relay(self, name: str) -> RelayApi:
        return remote(RelayApi, self._client(self.cluster.info[name]["address"]))

    async def wait_chain(self, n: int) -> None:
        async with asyncio.timeout(30):
            while len(self.publisher.view.relays) != n:  # noqa: ASYNC110 - no event to await here
                await asyncio.sleep(0.05)

    async def publish(self, tensors: list[tuple[str, torch.Tensor]]) -> tuple[float, float]:
        """Stage + hand off the next version; returns (hand-off time, stall)."""
        self.version += 1
        vb = await asyncio.to_thread(self.publisher.stage, self.version, tensors)
        await self.publisher.hand_off(vb)
        return time.time(), self.publisher.stalls[-1]

    async def everywhere(self, version: int, timeout: float = 300) -> float:
        """Wall time at which the last relay verified ``version``."""
        async with asyncio.timeout(timeout):
            while True:
                states = [await self.relay(n).status.call() for n in self.relays]
                if all(version in s.received_at for s in states):
                    return max(s.received_at[version] for s in states)
                # relays timestamp verification themselves: polling slowly costs no accuracy,
                # and fast polling would steal the CPU the relays are measured on
                await asyncio.sleep(0.25)

    async def close(self) -> None:
        for client in self.clients.values():
            await client.close()


async def chain_runs(
    bench: Bench, sizes: list[int], mib: int, start_relay: Any, reps: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """For each chain length: stall of a publish during a broadcast, then clean broadcast times."""
    tensors = weights(mib, 0)
    chain: dict[str, list[float]] = {}
    stall: dict[str, list[float]] = {}
    start_relay(0)
    bench.relays and await bench.wait_chain(1)
    for _ in range(3):  # warm up: the publisher's staging buffers are allocated (page faults) once
        await bench.publish(tensors)
    await bench.everywhere(bench.version)
    for n in sizes:
        while len(bench.relays) < n:
            start_relay(len(bench.relays))
        await bench.wait_chain(n)
        chain[str(n)], stall[str(n)] = [], []
        for _ in range(reps):
            _, _ = await bench.publish(tensors)  # a broadcast in flight ...
            busy = bench.version
            _, s = await bench.publish(tensors)  # ... while the trainer stages the next one
            stall[str(n)].append(s)
            await bench.everywhere(bench.version)
            await bench.everywhere(busy)
            t0, _ = await bench.publish(tensors)  # a clean broadcast: nothing else in flight
            chain[str(n)].append(await bench.everywhere(bench.version) - t0)
        print(
            f"  chain of {n}: {min(chain[str(n)]):.3f} s, stall {min(stall[str(n)]):.4f} s",
            flush=True,
        )
    return chain, stall


# -- a bare receiver for p2p / star: the transfer protocol without the relay role ---------------


async def receiver(bind: str) -> None:
    store = VersionStore(1, shared=False)
    options = transport_options(ClusterConfig(), TOKEN.encode()).with_allocator(store.allocator)

    async def serve(conn: transport.Connection) -> None:
        with contextlib.suppress(transport.ConnectionClosed):  # the sender is done with us
            await receive_versions(conn, store)

    listener = await transport.listen(bind, options, serve)
    print(json.dumps({"address": listener.address}), flush=True)
    await asyncio.Event().wait()


async def push_to(addresses: list[str], mib: int, chunks: int, version: int) -> list[float]:
    """Send one (new) version to each address in turn (the star); seconds per transfer."""
    options = transport_options(ClusterConfig(), TOKEN.encode())
    publisher = WeightPublisher(PublishConfig(chunks=chunks, master="unused"), options)
    vb = publisher.stage(version, weights(mib, 1))
    await publisher.hand_off(vb)  # checksums; nothing pushes it to "unused": we send it below
    times = []
    for address in addresses:
        conn = await transport.connect(address, options)
        t = time.perf_counter()
        await push_version(conn, vb, timeout=600)
        times.append(time.perf_counter() - t)
        conn.close()
    return times


def start_receiver(cmd_prefix: list[str], bind: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [*cmd_prefix, sys.executable, __file__, "--receiver", bind],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "LAMINAR_TOKEN": TOKEN},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    return proc, json.loads(line)["address"]


# -- setting 1: loopback -------------------------------------------------------------------------


async def loopback(mib: int, schemes: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"memcpy_gbps": memcpy_gbps(mib)}
    for scheme in schemes:
        with tempfile.TemporaryDirectory() as tmp:
            config = write_config(Path(tmp), "tcp://127.0.0.1:0", f"{scheme}://127.0.0.1:0")
            env = {"LAMINAR_TOKEN": TOKEN}
            with ProcessCluster(config, Path(tmp) / "logs", env=env) as cluster:
                cluster.serve("manager", "manager")
                try:
                    cluster.serve("relay", "relay-0")
                except Exception as exc:
                    out[f"loopback_{scheme}_error"] = str(exc).splitlines()[0]
                    continue
                bench = Bench(cluster, PublishConfig(chunks=4))
                bench.relays = ["relay-0"]
                task = asyncio.create_task(bench.publisher.run())
                try:
                    await bench.wait_chain(1)
                    tensors = weights(mib, 0)
                    times = []
                    for _ in range(3):
                        t0, _ = await bench.publish(tensors)
                        times.append(await bench.everywhere(bench.version) - t0)
                    out[f"loopback_p2p_gbps_{scheme}"] = mib * MIB * 8 / min(times) / 1e9
                    out[f"loopback_p2p_s_{scheme}"] = times
                finally:
                    task.cancel()
                    await bench.close()
    default = "ucx" if "loopback_p2p_gbps_ucx" in out else "tcp"
    out["loopback_transport"] = default
    out["loopback_p2p_gbps"] = out[f"loopback_p2p_gbps_{default}"]
    out["loopback_p2p_over_memcpy"] = out["loopback_p2p_gbps"] / out["memcpy_gbps"]
    return out


# -- setting 2: network namespaces ---------------------------------------------------------------


async def netns_inner(args: argparse.Namespace) -> dict[str, Any]:
    """Runs inside host 0's namespace: the manager and the trainer's publisher live here."""
    hosts = json.loads(args.netns_inner)  # [[namespace, address], ...]; host 0 is us
    mib, scheme = args.mib, "tcp"
    sizes = [int(s) for s in args.relays.split(",")]
    link_gbps = args.rate_mbit / 1000
    k = optimal_chunks(max(sizes) + 1, mib * MIB, 8 / (link_gbps * 1e9), 200e-6)
    out: dict[str, Any] = {
        "chunks": k,
        "rate_mbit": args.rate_mbit,
        "mib": mib,
    }
    with tempfile.TemporaryDirectory() as tmp:
        # p2p: one transfer host 1 <- host 0, and the star: host 0 -> hosts 1..8 in turn
        star_n = min(8, len(hosts) - 1)
        receivers = [
            start_receiver(["ip", "netns", "exec", hosts[i][0]], f"{scheme}://{hosts[i][1]}:0")
            for i in range(1, star_n + 1)
        ]
        try:
            addresses = [a for _, a in receivers]
            p2p = [(await push_to(addresses[:1], mib, 1, v))[0] for v in (1, 2)]
            out["p2p_s"], out["p2p_runs_s"] = min(p2p), p2p
            print(f"  p2p: {out['p2p_s']:.3f} s", flush=True)
            star = await push_to(addresses, mib, 1, 3)
            out["star_s"] = sum(star)
            out["star_transfers_s"] = star
            print(f"  star of {star_n}: {out['star_s']:.3f} s", flush=True)
        finally:
            for proc, _ in receivers:
                proc.kill()
                proc.wait()
        config = write_config(Path(tmp), f"{scheme}://{hosts[0][1]}:0", "auto")
        env = {"LAMINAR_TOKEN": TOKEN}
        with ProcessCluster(config, Path(tmp) / "logs", env=env) as cluster:
            cluster.serve("manager", "manager")
            publish = PublishConfig(link_gbps=link_gbps, max_chunk_mib=64)
            bench = Bench(cluster, publish)

            def start_relay(i: int) -> None:
                ns, address = hosts[i + 1]
                name = f"relay-{i}"
                cluster.serve(
                    "relay",
                    name,
                    prefix=("ip", "netns", "exec", ns),
                    args=(
                        "--bind",
                        f"tcp://{address}:0",
                        "--set",
                        f"relay.weights_bind={scheme}://{address}:0",
                    ),
                )
                bench.relays.append(name)

            task = asyncio.create_task(bench.publisher.run())
            try:
                chain, stall = await chain_runs(bench, sizes, mib, start_relay, args.reps)
            finally:
                task.cancel()
                await bench.close()
    out["chain_s"] = {n: min(v) for n, v in chain.items()}
    out["chain_runs_s"] = chain
    out["trainer_stall_s"] = {n: statistics.median(v) for n, v in stall.items()}
    out["trainer_stall_runs_s"] = stall
    out["model_chain_s"] = {
        str(n): chain_time(n + 1, mib * MIB, k, 8 / (link_gbps * 1e9), 200e-6) for n in sizes
    }
    return out


def netns(args: argparse.Namespace) -> dict[str, Any]:
    sizes = [int(s) for s in args.relays.split(",")]
    n_hosts = 1 + max(max(sizes), 8)
    with NetLab(n_hosts, rate_mbit=args.rate_mbit, prefix="lmnb") as lab:
        hosts = [[lab.namespace(i), lab.address(i)] for i in range(n_hosts)]
        with tempfile.NamedTemporaryFile(suffix=".json") as result:
            cmd = [
                sys.executable,
                __file__,
                "--netns-inner",
                json.dumps(hosts),
                "--mib",
                str(args.mib),
                "--rate-mbit",
                str(args.rate_mbit),
                "--relays",
                args.relays,
                "--reps",
                str(args.reps),
                "--json",
                result.name,
            ]
            lab.run(0, cmd, check=True, env={**os.environ, "LAMINAR_TOKEN": TOKEN})
            return json.loads(Path(result.name).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--mib", type=int, default=256, help="version size")
    parser.add_argument(
        "--rate-mbit",
        type=float,
        default=500,
        help="netns link rate (500: at 1000 the 8 relays' packet processing saturates 2 cores)",
    )
    parser.add_argument("--relays", default="1,2,4,8", help="chain lengths (netns)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--skip-netns", action="store_true")
    parser.add_argument("--receiver", help=argparse.SUPPRESS)
    parser.add_argument("--netns-inner", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.receiver:
        asyncio.run(receiver(args.receiver))
        return
    if args.netns_inner:
        figures = asyncio.run(netns_inner(args))
        Path(args.json).write_text(json.dumps(figures))
        return

    schemes = ["tcp"]
    try:
        import ucxx  # noqa: F401

        schemes.append("ucx")
    except Exception:
        pass
    print(f"setting 1: loopback, {args.mib} MiB, transports {schemes}", flush=True)
    figures: dict[str, Any] = asyncio.run(loopback(args.mib, schemes))
    print(
        f"  memcpy {figures['memcpy_gbps']:.2f} Gbit/s, trainer -> relay "
        f"{figures['loopback_p2p_gbps']:.2f} Gbit/s ({figures['loopback_transport']})"
    )
    reason = None if not args.skip_netns else "skipped (--skip-netns)"
    reason = reason or probe()
    if reason is not None:
        print(f"setting 2 (network namespaces) not run: {reason}")
        figures["netns"] = reason
    else:
        print(
            f"setting 2: one namespace per node, links shaped to {args.rate_mbit:g} Mbit/s",
            flush=True,
        )
        ns = netns(args)
        figures.update(ns)
        chain = ns["chain_s"]
        stall = ns["trainer_stall_s"]
        last = str(max(int(n) for n in chain))
        figures["chain8_over_p2p"] = chain[last] / ns["p2p_s"]
        figures["star8_over_chain8"] = ns["star_s"] / chain[last]
        figures["stall8_over_stall1"] = stall[last] / stall["1"]
    print(json.dumps({k: v for k, v in figures.items() if not k.endswith("runs_s")}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
