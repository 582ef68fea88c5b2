"""Transport throughput and RPC latency between two processes on this machine.

Every figure is measured in this run, against a baseline measured in the same run:

* ``raw_socket_gbps`` — plain blocking ``sendall`` / ``recv_into`` of the buffer (the baseline);
* ``tcp_gbps`` — the same buffer as one Laminar frame over ``tcp://`` (handshake done, framing,
  receive into preallocated memory, an ack frame back);
* ``shm_gbps`` — one frame over ``shm://`` whose buffer lies in a ``SharedBuffer`` the sender
  owns (the relay's path): only a descriptor travels; the receiver maps the segment and reads one
  byte of every page, so the figure includes making all of it reachable;
  ``shm_inline_gbps`` — an ordinary buffer over ``shm://``, which goes inline on its Unix socket;
* ``memcpy_gbps`` — one in-process numpy copy of the buffer: the machine's memory limit;
* ``ucx_gbps`` — one frame over ``ucx://`` when the ``ucx`` extra is installed;
* ``rpc_rtt_us_p50`` / ``rpc_calls_per_s`` — a small typed call, sequential and 64 in flight, with
  ``raw_rtt_us_p50`` (a 1-byte asyncio echo on uvloop, the same loop both ends) as its baseline.

The two ratios with goals, ``tcp_over_raw`` (>= 0.8) and ``rpc_rtt_over_raw`` (<= 2), are measured
in alternating pairs (``benchmarks/pairs.py``): baseline, subject, baseline, subject, ... each side
timed for ``--seconds``; the median pair ratio is the figure, the spread of the pairs says how
much to trust it.

Usage: ``python benchmarks/transport.py [--mib 256] [--pairs 3] [--seconds 2] [--json OUT.json]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from typing import Any

import numpy as np
from pydantic import BaseModel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pairs  # benchmarks/pairs.py

TOKEN = b"benchmark-token-0123456789"
ACK = b"k"


# ----------------------------------------------------------------------------------------------
# receivers (run in a child process)


def raw_receiver(queue: Any, size: int) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    queue.put(server.getsockname()[1])
    while True:  # one connection per measurement
        conn, _ = server.accept()
        dest = memoryview(np.empty(size, dtype=np.uint8))
        while True:
            got = 0
            while got < size:
                n = conn.recv_into(dest[got:])
                if not n:
                    break
                got += n
            if got < size:
                break
            conn.sendall(ACK)
        conn.close()


def frame_receiver(queue: Any, address: str, touch: bool, use_uvloop: bool) -> None:
    import laminar.transport as lt

    if address.startswith("ucx"):
        import laminar.transport.ucx  # noqa: F401

    options = lt.TransportOptions(token=TOKEN)

    async def handler(conn: lt.Connection) -> None:
        with contextlib.suppress(lt.ConnectionClosed):  # the sender is done with this connection
            while True:
                frame = await conn.recv()
                if touch:
                    for buf in frame.buffers:  # read one byte per page: the data must be reachable
                        np.frombuffer(buf, dtype=np.uint8)[::4096].sum()
                await conn.send(lt.Frame({"k": "ack"}))

    async def main() -> None:
        listener = await lt.listen(address, options, handler)
        queue.put(listener.address)
        await asyncio.sleep(3600)

    _run(main(), use_uvloop)


class Pair(BaseModel):
    a: int
    b: int


class Sum(BaseModel):
    value: int


def rpc_receiver(queue: Any) -> None:
    from laminar.runtime.config import ClusterConfig, ServiceConfig
    from laminar.runtime.context import ServiceContext, transport_options
    from laminar.runtime.endpoint import endpoint
    from laminar.runtime.service import Service, ServiceHost

    class Adder(Service):
        role = "adder"

        @endpoint
        async def add(self, req: Pair) -> Sum:
            return Sum(value=req.a + req.b)

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1):
            writer.write(data)

    async def main() -> None:
        cluster = ClusterConfig()
        ctx = ServiceContext(
            role="adder",
            instance="adder-0",
            cluster=cluster,
            config=ServiceConfig(metrics=None),
            options=transport_options(cluster, TOKEN),
        )
        host = ServiceHost(Adder, ctx)
        task = asyncio.create_task(host.run())
        await host.started()
        raw = await asyncio.start_server(echo, "127.0.0.1", 0)
        queue.put((ctx.address, raw.sockets[0].getsockname()[1]))
        await task

    _run(main(), True)


def _run(coro: Any, use_uvloop: bool) -> None:
    if use_uvloop:
        import uvloop

        uvloop.run(coro)
    else:
        asyncio.run(coro)


def spawn(target: Any, *args: Any) -> tuple[Any, Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(queue, *args), daemon=True)
    proc.start()
    return proc, queue.get(timeout=60)


# ----------------------------------------------------------------------------------------------
# senders (this process)


def gbps(size: int, seconds: list[float]) -> float:
    return size / statistics.median(seconds) / 1e9


def bench_memcpy(size: int, repeat: int) -> float:
    src = np.ones(size, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in first
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    return gbps(size, times)


def timed_rounds(one_round: Any, seconds: float, min_rounds: int = 3) -> list[float]:
    """Time ``one_round()`` after one warm-up round, until ``seconds`` have passed."""
    one_round()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_rounds or time.perf_counter() - start < seconds:
        t = time.perf_counter()
        one_round()
        times.append(time.perf_counter() - t)
    return times


def bench_raw(port: int, size: int, seconds: float) -> float:
    data = memoryview(np.ones(size, dtype=np.uint8))
    sock = socket.create_connection(("127.0.0.1", port))

    def one_round() -> None:
        sock.sendall(data)
        sock.recv(1)

    try:
        return gbps(size, timed_rounds(one_round, seconds))
    finally:
        sock.close()


class FrameSender:
    """One connection to a frame receiver in a child process, reused across pairs."""

    def __init__(self, scheme: str, size: int, *, zero_copy: bool = False) -> None:
        bind = {"tcp": "tcp://127.0.0.1:0", "shm": "shm://*", "ucx": "ucx://127.0.0.1:0"}[scheme]
        self.scheme, self.size, self.zero_copy = scheme, size, zero_copy
        self.proc, self.address = spawn(frame_receiver, bind, scheme == "shm", True)

    def measure(self, seconds: float) -> float:
        import laminar.transport as lt
        from laminar.transport.shm import SharedBuffer

        if self.scheme == "ucx":
            import laminar.transport.ucx  # noqa: F401
        size = self.size
        result: list[float] = []

        async def main() -> None:
            conn = await lt.connect(self.address, lt.TransportOptions(token=TOKEN))
            shared = None
            if self.zero_copy:
                shared = SharedBuffer(size)
                shared.view[:] = memoryview(np.ones(size, dtype=np.uint8))
                data = shared.view
            else:
                data = memoryview(np.ones(size, dtype=np.uint8))

            async def one_round() -> None:
                await conn.send(lt.Frame({"k": "data"}, b"", [data]))
                await conn.recv()

            await one_round()
            times: list[float] = []
            start = time.perf_counter()
            while len(times) < 3 or time.perf_counter() - start < seconds:
                t = time.perf_counter()
                await one_round()
                times.append(time.perf_counter() - t)
            conn.close()
            if shared is not None:
                shared.close()
            result.append(gbps(size, times))

        _run(main(), True)
        return result[0]

    def close(self) -> None:
        self.proc.kill()
        self.proc.join(10)


def bench_frames(scheme: str, size: int, seconds: float, *, zero_copy: bool = False) -> float:
    sender = FrameSender(scheme, size, zero_copy=zero_copy)
    try:
        return sender.measure(seconds)
    finally:
        sender.close()


class RpcPair:
    """An RPC server and a raw asyncio echo server in one child process, measured in turns."""

    def __init__(self) -> None:
        self.proc, (self.address, self.raw_port) = spawn(rpc_receiver)

    def rpc(self, calls: int) -> dict[str, float]:
        from laminar.runtime.config import ClusterConfig
        from laminar.runtime.context import transport_options
        from laminar.runtime.rpc.client import RpcClient

        out: dict[str, float] = {}

        async def main() -> None:
            client = RpcClient(self.address, transport_options(ClusterConfig(), TOKEN))
            req = Pair(a=1, b=2)
            for _ in range(200):  # warm up
                await client.call("add", req, Sum)
            lat = []
            for _ in range(calls):
                t = time.perf_counter()
                await client.call("add", req, Sum)
                lat.append(time.perf_counter() - t)
            out["p50"] = statistics.median(lat) * 1e6
            out["p99"] = float(np.percentile(lat, 99) * 1e6)
            sem = asyncio.Semaphore(64)

            async def one() -> None:
                async with sem:
                    await client.call("add", req, Sum)

            t = time.perf_counter()
            await asyncio.gather(*(one() for _ in range(calls * 2)))
            out["calls_per_s"] = calls * 2 / (time.perf_counter() - t)
            await client.close()

        _run(main(), True)
        return out

    def raw(self, calls: int) -> float:
        out: list[float] = []

        async def main() -> None:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.raw_port)
            lat = []
            for i in range(calls + 200):
                t = time.perf_counter()
                writer.write(b"x")
                await reader.readexactly(1)
                if i >= 200:
                    lat.append(time.perf_counter() - t)
            writer.close()
            out.append(statistics.median(lat) * 1e6)

        _run(main(), True)
        return out[0]

    def close(self) -> None:
        self.proc.kill()
        self.proc.join(10)


def ucx_available() -> bool:
    try:
        import ucxx  # noqa: F401
    except Exception:
        return False
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--pairs", type=int, default=3, help="alternating pairs per ratio (>= 3)")
    parser.add_argument("--seconds", type=float, default=2.0, help="timed seconds per side")
    parser.add_argument("--calls", type=int, default=10000, help="sequential RPCs per side")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    size = args.mib << 20
    fig: dict[str, Any] = {
        "buffer_mib": args.mib,
        "pairs": args.pairs,
        "seconds": args.seconds,
        "cpus": os.cpu_count(),
    }

    # tcp against a plain socket, in alternating pairs over one connection each
    raw_proc, raw_port = spawn(raw_receiver, size)
    tcp = FrameSender("tcp", size)
    try:
        tcp_pairs = pairs.alternate(
            lambda: bench_raw(raw_port, size, args.seconds),
            lambda: tcp.measure(args.seconds),
            pairs=args.pairs,
        )
    finally:
        tcp.close()
        raw_proc.kill()
        raw_proc.join(10)
    fig["raw_socket_gbps"] = tcp_pairs["baseline_median"]
    fig["tcp_gbps"] = tcp_pairs["subject_median"]
    fig["tcp_over_raw"] = tcp_pairs["ratio_median"]
    fig["tcp_over_raw_pairs"] = tcp_pairs

    # RPC round trip against a raw echo, in alternating pairs, both servers in one process
    rpc = RpcPair()
    rpc_runs: list[dict[str, float]] = []
    try:

        def rpc_side() -> float:
            rpc_runs.append(rpc.rpc(args.calls))
            return rpc_runs[-1]["p50"]

        # baseline first, as everywhere; a ratio above 1 here means the RPC is slower
        rpc_pairs = pairs.alternate(lambda: rpc.raw(args.calls), rpc_side, pairs=args.pairs)
    finally:
        rpc.close()
    fig["raw_rtt_us_p50"] = rpc_pairs["baseline_median"]
    fig["rpc_rtt_us_p50"] = rpc_pairs["subject_median"]
    fig["rpc_rtt_us_p99"] = statistics.median(r["p99"] for r in rpc_runs)
    fig["rpc_calls_per_s"] = statistics.median(r["calls_per_s"] for r in rpc_runs)
    fig["rpc_rtt_over_raw"] = rpc_pairs["ratio_median"]
    fig["rpc_rtt_over_raw_pairs"] = rpc_pairs

    # figures without a goal: one run each
    fig["memcpy_gbps"] = bench_memcpy(size, 5)
    fig["shm_gbps"] = bench_frames("shm", size, args.seconds, zero_copy=True)
    fig["shm_inline_gbps"] = bench_frames("shm", size, args.seconds)
    fig["shm_over_memcpy"] = fig["shm_gbps"] / fig["memcpy_gbps"]
    if ucx_available():
        try:
            fig["ucx_gbps"] = bench_frames("ucx", size, args.seconds)
        except Exception as exc:  # report, do not hide: the figure is absent and says why
            fig["ucx_error"] = f"{type(exc).__name__}: {exc}"

    width = max(len(k) for k in fig if not k.endswith("_pairs"))
    for key, value in fig.items():
        if key.endswith("_pairs"):
            continue
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        print(f"{key:<{width}}  {shown}")
    print(pairs.describe("tcp_over_raw", tcp_pairs, goal=0.8))
    rtt = pairs.describe("rpc_rtt_over_raw", rpc_pairs)
    verdict = "meets" if rpc_pairs["ratio_median"] <= 2.0 else "MISSES"
    print(f"{rtt}; {verdict} the goal of <= 2 (lower is better)")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(fig, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
