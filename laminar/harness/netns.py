"""Several "hosts" on one machine, joined by rate-shaped links (Linux network namespaces + tc).

Why: a benchmark or test that moves data between processes over 127.0.0.1 measures memcpy and
CPU scheduling, not networking. On a cluster the bottleneck is the NIC (e.g. 1-100 Gbit/s per
host, full duplex); on a small dev box with loopback it is the CPU cores, so relay/broadcast
schemes that look good on loopback can be wrong on a real cluster. ``NetLab`` gives each "host"
its own network namespace (its own interfaces, routes, port space and loopback) and shapes its
link with a token bucket (``tc tbf``) to a fixed rate well below what the CPU can push through a
veth, so the link is the bottleneck again, as on a cluster. Traffic crosses the real kernel TCP/IP
stack (congestion control, queueing, backpressure), and nothing needs VMs or containers: only
``ip`` and ``tc`` from iproute2 and root (CAP_NET_ADMIN + CAP_SYS_ADMIN).

Why both directions are shaped: a NIC limits what a host sends *and* what it receives. Shaping
only egress of each host would let N senders converge on one receiver at N times the rate (the
fan-in case, exactly what a broadcast/relay benchmark must not get wrong). So every host link has
two token buckets: on egress of the host-side veth end (limits what the host sends) and on egress
of the bridge-side end (limits what the host receives): a full-duplex link of ``rate_mbit``.

Why a bridge rather than a chain of veths: a cluster is a star, hosts on a (non-blocking) switch,
every pair one hop apart, every host limited only by its own link. A Linux bridge in a separate
"switch" namespace gives exactly that with one veth pair per host and a single flat L2 subnet (no
routing, no ip_forward, no per-pair links, which would be N^2 and would not model a shared NIC).
The bridge itself is unshaped, like a non-blocking switch fabric.

Addresses: host ``i`` is ``198.18.0.{i+1}/24`` on its ``eth0``. 198.18.0.0/15 is reserved for
network benchmarking (RFC 2544), so it never collides with real networks; all of it lives inside
the lab namespaces anyway. ``lo`` is up in every namespace, so servers may also bind 127.0.0.1
inside a host (each host's loopback is private to it).

Names: namespaces are ``{prefix}{pid}-h{i}`` and ``{prefix}{pid}-sw`` (a second lab open at the
same time in the same process gets ``{prefix}{pid}x{k}-...``), so parallel runs do not collide and
``NetLab.cleanup_stale(prefix)`` can recognise leftovers of dead processes. Interface names live
inside the namespaces (``eth0`` in a host, ``br0`` and ``h{i}`` in the switch), so they stay short
(the kernel limit is 15 characters) and never touch the root namespace.

Delay: ``delay_ms`` adds a netem delay on each host's *send* side only, so it is the one-way
host-to-host latency (RTT grows by ``2 * delay_ms``). It needs the ``sch_netem`` kernel module,
which some kernels lack; then ``NetLab`` raises ``NetLabError`` (``probe()`` does not check it).

Usage::

    with NetLab(3, rate_mbit=1000) as lab:
        server = lab.popen(0, [sys.executable, "server.py", "--bind", lab.address(0)])
        lab.run(2, [sys.executable, "client.py", lab.address(0)], check=True)

Processes started with ``popen`` get their own session (process group) unless told otherwise,
and are killed (SIGTERM, then SIGKILL) when the lab closes; the namespaces are then deleted.
"""

from __future__ import annotations

import atexit
import itertools
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["NetLab", "NetLabError", "probe"]

_SUBNET_PREFIX = "198.18.0."
_PREFIXLEN = 24
_CMD_TIMEOUT_S = 30.0
_TERM_GRACE_S = 2.0


class NetLabError(RuntimeError):
    """Setting up (or probing) the lab failed; the message names the command and its stderr."""


def _fmt(argv: Sequence[str]) -> str:
    return " ".join(argv)


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            timeout=_CMD_TIMEOUT_S,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetLabError(f"`{_fmt(argv)}` failed: {exc}") from exc
    if check and proc.returncode != 0:
        err = (proc.stderr or proc.stdout).strip().replace("\n", "; ")
        raise NetLabError(f"`{_fmt(argv)}` failed (rc={proc.returncode}): {err}")
    return proc


def _list_namespaces() -> list[str]:
    proc = _run(["ip", "netns", "list"], check=False)
    if proc.returncode != 0:
        return []
    # Lines look like "name" or "name (id: 3)".
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def _kill_netns_pids(ns: str) -> None:
    proc = _run(["ip", "netns", "pids", ns], check=False)
    for tok in proc.stdout.split():
        try:
            os.kill(int(tok), signal.SIGKILL)
        except (ValueError, ProcessLookupError, PermissionError):
            pass


def _delete_namespace(ns: str) -> None:
    _kill_netns_pids(ns)
    _run(["ip", "netns", "delete", ns], check=False)


def _shape_cmds(dev: str, rate_mbit: float, delay_ms: float) -> list[list[str]]:
    """tc commands (to run inside the device's namespace) shaping ``dev`` egress.

    Token bucket sizing: the burst must hold at least one 64 KiB GSO super-packet (veth passes
    TSO segments unsplit; a smaller bucket makes tbf segment them, costing CPU) and about a
    millisecond of traffic, so a single TCP stream is not starved by timer granularity. The queue
    (``latency``) is short so TCP sees the bottleneck quickly but long enough to keep the link busy.
    """
    rate_bps = rate_mbit * 1e6
    burst = max(128 * 1024, int(rate_bps / 8 * 0.002))
    rate = f"{rate_bps:.0f}bit"
    cmds = [
        [
            "tc", "qdisc", "replace", "dev", dev, "root", "handle", "1:",
            "tbf", "rate", rate, "burst", str(burst), "latency", "20ms",
        ]
    ]  # fmt: skip
    if delay_ms > 0:
        cmds.append(
            [
                "tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:",
                "netem", "delay", f"{delay_ms}ms", "limit", "100000",
            ]
        )  # fmt: skip
    return cmds


def _delay_only_cmd(dev: str, delay_ms: float) -> list[str]:
    return [
        "tc", "qdisc", "replace", "dev", dev, "root", "handle", "1:",
        "netem", "delay", f"{delay_ms}ms", "limit", "100000",
    ]  # fmt: skip


def probe() -> str | None:
    """None if namespaces, veth pairs, a bridge and tc tbf work here; else a one-line reason."""
    if not hasattr(os, "geteuid"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return f"network namespaces need root (running as uid {os.geteuid()})"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) not found on PATH"
    ns = f"lmnprobe{os.getpid()}-{next(_SEQ)}"
    created = False
    try:
        _run(["ip", "netns", "add", ns])
        created = True
        _run(["ip", "-n", ns, "link", "add", "pa", "type", "veth", "peer", "name", "pb"])
        _run(["ip", "-n", ns, "link", "add", "pbr", "type", "bridge"])
        _run(["ip", "-n", ns, "link", "set", "pb", "master", "pbr"])
        for cmd in _shape_cmds("pa", 100, 0.0):
            _run(["ip", "netns", "exec", ns, *cmd])
    except NetLabError as exc:
        return str(exc).replace("\n", " ")
    finally:
        if created:
            _delete_namespace(ns)
    return None


_SEQ = itertools.count()
_LOCK = threading.Lock()
_OPEN: set[NetLab] = set()
_ATEXIT_REGISTERED = False


def _close_all_at_exit() -> None:
    with _LOCK:
        labs = list(_OPEN)
    for lab in labs:
        try:
            lab.close()
        except Exception:
            pass


class NetLab:
    """``n_hosts`` namespaces on one bridge, each link shaped to ``rate_mbit`` in each direction.

    ``rate_mbit=None`` leaves links unshaped. ``delay_ms`` is the added one-way latency between
    any two hosts (netem on each host's send side). See the module docstring for the topology.
    """

    def __init__(
        self,
        n_hosts: int,
        rate_mbit: float | None = 1000,
        delay_ms: float = 0.0,
        prefix: str = "lmn",
    ) -> None:
        if not 1 <= n_hosts <= 253:
            raise ValueError(f"n_hosts must be in 1..253, got {n_hosts}")
        if rate_mbit is not None and rate_mbit <= 0:
            raise ValueError(f"rate_mbit must be positive or None, got {rate_mbit}")
        if delay_ms < 0:
            raise ValueError(f"delay_ms must be >= 0, got {delay_ms}")
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", prefix) or re.search(r"\d$", prefix):
            raise ValueError(
                f"prefix must be letters/digits/_ , start with a letter and not end in a digit "
                f"(the pid follows it), got {prefix!r}"
            )
        self.n_hosts = n_hosts
        self.rate_mbit = rate_mbit
        self.delay_ms = delay_ms
        self.prefix = prefix
        pid = os.getpid()
        seq = next(_SEQ)
        tag = f"{prefix}{pid}" if seq == 0 else f"{prefix}{pid}x{seq}"
        self._switch_ns = f"{tag}-sw"
        self._host_ns = [f"{tag}-h{i}" for i in range(n_hosts)]
        self._created: list[str] = []
        self._procs: list[tuple[subprocess.Popen[Any], bool]] = []
        self._closed = False
        self._lock = threading.Lock()
        self._register()
        try:
            self._setup()
        except BaseException:
            self.close()
            raise

    # -- public API -------------------------------------------------------------------------

    def address(self, i: int) -> str:
        """IPv4 address of host ``i`` (on its ``eth0``)."""
        self._check_host(i)
        return f"{_SUBNET_PREFIX}{i + 1}"

    def namespace(self, i: int) -> str:
        """Name of host ``i``'s network namespace (for ``ip netns exec``)."""
        self._check_host(i)
        return self._host_ns[i]

    @property
    def switch_namespace(self) -> str:
        return self._switch_ns

    def command(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside host ``i``'s namespace."""
        if isinstance(argv, str | bytes):
            raise TypeError("argv must be a sequence of arguments, not a string")
        return ["ip", "netns", "exec", self.namespace(i), *map(str, argv)]

    def popen(self, i: int, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside host ``i``; the lab kills it on close if still running.

        Unless ``start_new_session``/``process_group`` is given, the child gets its own session,
        so close() can kill its whole process group (children included).
        """
        if self._closed:
            raise NetLabError("NetLab is closed")
        if "start_new_session" not in popen_kwargs and "process_group" not in popen_kwargs:
            popen_kwargs["start_new_session"] = True
        own_group = bool(popen_kwargs.get("start_new_session")) or (
            popen_kwargs.get("process_group") == 0
        )
        proc = subprocess.Popen(self.command(i, argv), **popen_kwargs)
        with self._lock:
            self._procs.append((proc, own_group))
        return proc

    def run(
        self, i: int, argv: Sequence[str], **run_kwargs: Any
    ) -> subprocess.CompletedProcess[Any]:
        """``subprocess.run(argv)`` inside host ``i``."""
        if self._closed:
            raise NetLabError("NetLab is closed")
        return subprocess.run(self.command(i, argv), **run_kwargs)

    def close(self) -> None:
        """Kill processes started with popen, delete every namespace made. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            procs, self._procs = self._procs, []
            created, self._created = self._created, []
        self._kill_procs(procs)
        for ns in reversed(created):
            _delete_namespace(ns)
        with _LOCK:
            _OPEN.discard(self)

    def __enter__(self) -> NetLab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"NetLab(n_hosts={self.n_hosts}, rate_mbit={self.rate_mbit}, "
            f"delay_ms={self.delay_ms}, switch={self._switch_ns!r}, {state})"
        )

    @classmethod
    def cleanup_stale(cls, prefix: str = "lmn") -> list[str]:
        """Delete namespaces named ``{prefix}{pid}...`` whose pid is no longer alive.

        Returns the names deleted. (A recycled pid keeps its namespaces; harmless, rare.)
        """
        pattern = re.compile(rf"^{re.escape(prefix)}(\d+)(?:x\d+)?-(?:sw|h\d+)$")
        removed = []
        for ns in _list_namespaces():
            m = pattern.match(ns)
            if m is None or _pid_alive(int(m.group(1))):
                continue
            _delete_namespace(ns)
            removed.append(ns)
        return removed

    # -- internals --------------------------------------------------------------------------

    def _check_host(self, i: int) -> None:
        if not 0 <= i < self.n_hosts:
            raise IndexError(f"host index {i} out of range 0..{self.n_hosts - 1}")

    def _register(self) -> None:
        global _ATEXIT_REGISTERED
        with _LOCK:
            _OPEN.add(self)
            if not _ATEXIT_REGISTERED:
                atexit.register(_close_all_at_exit)
                _ATEXIT_REGISTERED = True

    def _add_ns(self, ns: str) -> None:
        _run(["ip", "netns", "add", ns])
        self._created.append(ns)
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def _setup(self) -> None:
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                raise NetLabError(f"`{tool}` (iproute2) not found on PATH")
        sw = self._switch_ns
        self._add_ns(sw)
        _run(["ip", "-n", sw, "link", "add", "br0", "type", "bridge",
              "forward_delay", "0", "stp_state", "0"])  # fmt: skip
        _run(["ip", "-n", sw, "link", "set", "br0", "up"])
        for i, ns in enumerate(self._host_ns):
            self._add_ns(ns)
            port = f"h{i}"
            # Create the pair inside the switch namespace with the peer placed straight into the
            # host namespace: no names ever appear in the root namespace.
            _run(["ip", "-n", sw, "link", "add", port, "type", "veth",
                  "peer", "name", "eth0", "netns", ns])  # fmt: skip
            _run(["ip", "-n", sw, "link", "set", port, "master", "br0"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.address(i)}/{_PREFIXLEN}", "dev", "eth0"])
            if self.rate_mbit is not None:
                # Host send side: eth0 egress (with the optional one-way delay).
                for cmd in _shape_cmds("eth0", self.rate_mbit, self.delay_ms):
                    _run(["ip", "netns", "exec", ns, *cmd])
                # Host receive side: the bridge port's egress towards the host.
                for cmd in _shape_cmds(port, self.rate_mbit, 0.0):
                    _run(["ip", "netns", "exec", sw, *cmd])
            elif self.delay_ms > 0:
                _run(["ip", "netns", "exec", ns, *_delay_only_cmd("eth0", self.delay_ms)])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", sw, "link", "set", port, "up"])

    @staticmethod
    def _kill_procs(procs: list[tuple[subprocess.Popen[Any], bool]]) -> None:
        for p, group in procs:
            if p.poll() is None:
                _signal_proc(p, group, signal.SIGTERM)
        deadline = time.monotonic() + _TERM_GRACE_S
        for p, _ in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p, group in procs:
            # Even when the leader has exited, its group may still hold children.
            _signal_proc(p, group, signal.SIGKILL)
            try:
                p.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                pass


def _signal_proc(p: subprocess.Popen[Any], group: bool, sig: signal.Signals) -> None:
    if group:
        try:
            os.killpg(p.pid, sig)
            return
        except (ProcessLookupError, PermissionError):
            pass
    if p.poll() is None:
        try:
            p.send_signal(sig)
        except (ProcessLookupError, PermissionError):
            pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
