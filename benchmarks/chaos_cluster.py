"""The chaos benchmark's cluster: emulated hosts, the roles on them, and an orchestrator.

Hosts. With network namespaces (root, iproute2) every host is a ``laminar.harness.netns.NetLab``
namespace with its own hostname (a UTS namespace, as in ``tests/support/multihost.py``), so
rollouts find "the relay on my host" as on a cluster and one rollout's link can be cut without
touching anyone else's. Host 0 holds the control plane (manager, data, trainer); hosts 1..R one
relay each and the rollouts spread over them; the last host holds one rollout alone, the one whose
link is cut. Without namespaces everything runs on loopback and the link cut is skipped.

Why the benchmark restarts roles itself rather than through ``laminar run``: the supervisor
starts every role on this machine's loopback (no namespaces, so no link to cut and no per-host
relay), its restart pause grows with each restart (a property of the supervisor, not of the
roles), and it keeps no timestamps we could read. :class:`Orchestrator` does what Kubernetes or
systemd do with ``restart: always``: it notices a process has exited (``waitpid``, polled every
0.1 s), clears what is left of its group (as a container runtime tears down the container),
and starts the same command again at once, on the same host. The manager listens on a fixed
port (what a Service address or a systemd unit gives it), so members find it again.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from laminar.harness.launch import ProcessCluster
from laminar.harness.netns import NetLab, probe
from laminar.proc.procfs import end_group, group_members

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "chaos-benchmark-token-0123456789abcdef"
MANAGER_PORT = 7420
_SET_HOSTNAME = 'hostname "$0" && exec "$@"'
_CLONE_NEWNET = 0x40000000
FIG4_7B = [[1, 0.007], [64, 0.0125], [128, 0.018], [256, 0.030]]  # paper Fig. 4, seconds


@dataclass
class RoleSpec:
    role: str  # the laminar role (``sim_trainer`` for the trainer)
    name: str  # its instance id
    host: int
    args: tuple[str, ...] = ()
    prefix: tuple[str, ...] = ()


@dataclass
class Incarnation:
    pid: int
    started: float  # wall clock: the command was started
    ready: float | None = None  # its LAMINAR_READY line arrived
    exited: float | None = None  # the orchestrator saw it gone
    code: int | None = None
    planned: bool = False  # the benchmark killed it (a fault), not a crash
    leftovers: int = 0  # processes its group still held after it died


@dataclass
class Topology:
    """Which role runs on which host, and how each host's command line is wrapped."""

    lab: NetLab | None
    specs: list[RoleSpec] = field(default_factory=list)
    cut_rollout: str | None = None  # alone on its host: the link-cut victim

    def address(self, host: int) -> str:
        return self.lab.address(host) if self.lab is not None else "127.0.0.1"

    def host_namespace(self, host: int) -> str | None:
        return self.lab.namespace(host) if self.lab is not None else None

    def link(self, host: int, up: bool) -> None:
        """Bring host ``host``'s link up or down at the switch end of its veth: a cable pulled
        at the switch. Frames to and from the host vanish silently (nobody gets a reset or an
        "unreachable"), as in a real partition; the host itself sees only its carrier go."""
        assert self.lab is not None
        state = "up" if up else "down"
        switch = self.lab.switch_namespace
        subprocess.run(["ip", "-n", switch, "link", "set", f"h{host}", state], check=True)


def open_lab(hosts: int, prefix: str = "lmnchaos") -> tuple[NetLab | None, str | None]:
    """A lab of ``hosts`` namespaces, or (None, why not)."""
    reason = probe()
    if reason is not None:
        return None, reason
    NetLab.cleanup_stale(prefix)
    return NetLab(hosts, rate_mbit=None, prefix=prefix), None


def enter_host(lab: NetLab, host: int) -> Callable[[], None]:
    """Move this thread (call it on the main thread, before any other starts) into ``host``'s
    network namespace, so the benchmark reaches the roles at their lab addresses; threads
    started later inherit it (``ip netns`` commands name namespaces by path: they work from
    anywhere). Returns the way back, to take before the lab is closed: closing kills every
    process in the lab's namespaces, and this one would be in host 0's."""
    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open("/proc/self/ns/net", os.O_RDONLY)

    def setns(fd: int) -> None:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns failed")

    fd = os.open(f"/run/netns/{lab.namespace(host)}", os.O_RDONLY)
    try:
        setns(fd)
    finally:
        os.close(fd)

    def leave() -> None:
        try:
            setns(home)
        finally:
            os.close(home)

    return leave


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def plan(lab: NetLab | None, rollouts: int, relays: int) -> Topology:
    """Host 0: manager, data, trainer. Hosts 1..relays: a relay each, rollouts round-robin.
    With a lab, one more host holds the last rollout alone (its link is the one cut)."""
    topo = Topology(lab)
    manager_port = MANAGER_PORT if lab is not None else free_port()

    def spec(role: str, name: str, host: int, *extra: str) -> RoleSpec:
        address = topo.address(host)
        bind = f"tcp://{address}:{manager_port if role == 'manager' else 0}"
        args: tuple[str, ...] = ("--bind", bind, *extra)
        prefix: tuple[str, ...] = ()
        if lab is not None:
            prefix = ("ip", "netns", "exec", lab.namespace(host), "unshare", "--uts",
                      "sh", "-c", _SET_HOSTNAME, f"chaoshost{host}")  # fmt: skip
        return RoleSpec(role, name, host, args, prefix)

    topo.specs.append(spec("manager", "manager", 0))
    topo.specs.append(spec("data", "data", 0))
    topo.specs.append(spec("sim_trainer", "trainer", 0))
    for i in range(relays):
        weights = f"relay.weights_bind=tcp://{topo.address(i + 1)}:0"
        topo.specs.append(spec("relay", f"relay-{i}", i + 1, "--set", weights))
    shared = rollouts - 1 if lab is not None else rollouts
    for i in range(shared):
        topo.specs.append(spec("rollout", f"rollout-{i}", 1 + i % relays))
    if lab is not None:
        topo.cut_rollout = f"rollout-{rollouts - 1}"
        topo.specs.append(spec("rollout", topo.cut_rollout, relays + 1))
    return topo


def write_config(directory: Path, args: Any) -> Path:
    """The emulated cluster (sim engines, sim trainer), time-scaled as benchmarks/schedules.py:
    lengths are the paper's over ``length_scale``, decode steps ``step_scale`` times Fig. 4's."""
    from tests.support.task import write_prompts, write_tokenizer

    s, L = args.step_scale, args.length_scale
    prompts = write_prompts(directory / "prompts.jsonl", 4096)
    config = {
        "cluster": {
            "name": "chaos",
            "heartbeat_interval_s": 0.5,
            "heartbeat_timeout_s": args.heartbeat_timeout,
            "rpc_timeout_s": 30.0,
            "log_level": "info",
        },
        "manager": {
            "metrics": None,
            "admin": "127.0.0.1:0",
            "repack": {"enabled": not args.no_repack, "period_s": 1.0},
        },
        "data": {
            "prompts": str(prompts),
            "tokenizer": str(write_tokenizer(directory / "tok")),
            "reward": "tests.support.task:reward_len",
            "samples_per_prompt": args.samples,
            "epochs": None,
            "store": str(directory / "data.sqlite"),
            "sampling": {"max_tokens": int((16384 if args.lengths == "paper" else 8192) / L)},
            "metrics": None,
            "queue_ahead": args.rollouts * args.concurrency,
        },
        "relay": {"metrics": None, "keep": 3},
        "rollout": {
            "metrics": None,
            "concurrency": args.concurrency,
            "flush_interval_s": 0.5,
            "take_wait_s": 0.5,
            "engine": {
                "backend": "sim",
                "vocab_size": 64,
                "seed": 0,
                "lengths": lengths(args),
                "cost": {
                    "batch_points": [[b, t * s] for b, t in FIG4_7B],
                    "prefill_s_per_token": 2e-5 * s,
                },
                "load_time_s": 0.2,
            },
        },
        "sim_trainer": {
            "metrics": None,
            "batch": {"prompts": args.batch_prompts, "samples": args.samples},
            "cost": {"gpus": 8, "time_scale": s, "base_s": args.train_base_s},
            "weight_bytes": int(args.weight_mib * (1 << 20)),
            "publish": {"chunks": 4},
            "sample_wait_s": 2.0,
            "metrics_file": str(directory / "trainer.jsonl"),
        },
    }
    from laminar.roles.trainer.sim import SimTrainerConfig

    if "state_file" in SimTrainerConfig.model_fields:  # a restarted trainer continues from it
        config["sim_trainer"]["state_file"] = str(directory / "trainer-state.json")
    path = directory / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def lengths(args: Any) -> dict[str, Any]:
    L = args.length_scale
    if args.lengths == "paper":
        return {"kind": "paper", "short_median": 1024 / L, "long_median": 8192 / L,
                "max_length": int(16384 / L)}  # fmt: skip
    return {"kind": "lognormal", "median": 2048 / L, "sigma": 0.5, "max_length": int(8192 / L)}


class Orchestrator:
    """Keeps every role running: start, notice an exit, clear its group, start it again."""

    def __init__(self, topo: Topology, config: Path, logs: Path) -> None:
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        env = {"LAMINAR_TOKEN": TOKEN, "PYTHONPATH": path}
        self.cluster = ProcessCluster(config, logs, env=env, cwd=ROOT)
        self.topo = topo
        self.specs = {s.name: s for s in topo.specs}
        self.history: dict[str, list[Incarnation]] = {n: [] for n in self.specs}
        self.restarting: set[str] = set()
        self.failures: list[dict[str, Any]] = []  # restarts that never became ready
        self._lock = threading.Lock()
        self._planned: set[str] = set()
        self._stopping = threading.Event()
        self._starting = 0  # serve() calls under way
        self._watcher: threading.Thread | None = None

    # -- starting --

    def start(self, name: str) -> None:
        spec = self.specs[name]
        with self._lock:
            if self._stopping.is_set():  # stop() has begun: nothing new may start behind it
                raise RuntimeError("stopping")
            self._starting += 1
        before = time.time()
        try:
            info = self.cluster.serve(
                spec.role, name, args=spec.args, prefix=spec.prefix, timeout=240.0
            )
        except Exception as exc:
            self.failures.append({"role": name, "at": before, "error": str(exc)[-2000:]})
            raise
        finally:
            with self._lock:
                self._starting -= 1
        with self._lock:
            self.history[name].append(Incarnation(int(info["pid"]), before, time.time()))

    def start_all(self) -> None:
        """The manager first (everyone joins it), then the rest four at a time (their imports
        overlap), the trainer among the first (as benchmarks/schedules.py: rollouts that start
        long before it fill the buffer with a backlog)."""
        from concurrent.futures import ThreadPoolExecutor

        self.start("manager")
        rest = [n for n in self.specs if n != "manager"]
        pool = ThreadPoolExecutor(4)
        try:
            for future in [pool.submit(self.start, n) for n in rest]:
                future.result()
        finally:  # on an error or Ctrl-C, stop() waits for the starts already under way
            pool.shutdown(wait=False, cancel_futures=True)
        self._watcher = threading.Thread(target=self._watch, name="orchestrator", daemon=True)
        self._watcher.start()

    # -- faults --

    def kill9(self, name: str) -> float:
        """SIGKILL the role's own process, as a crash does; returns the wall time."""
        proc = self.cluster.procs[name]
        with self._lock:
            self._planned.add(name)
        at = time.time()
        proc.send_signal(signal.SIGKILL)
        return at

    def pid(self, name: str) -> int | None:
        proc = self.cluster.procs.get(name)
        return proc.pid if proc is not None and proc.poll() is None else None

    def current(self, name: str) -> Incarnation | None:
        return self.history[name][-1] if self.history[name] else None

    # -- the watch loop (a thread: ProcessCluster.serve blocks until the ready line) --

    def _watch(self) -> None:
        while not self._stopping.is_set():
            for name in list(self.specs):
                proc = self.cluster.procs.get(name)
                if name in self.restarting or proc is None or proc.poll() is None:
                    continue
                self.restarting.add(name)
                threading.Thread(
                    target=self._restart, args=(name, proc.returncode), daemon=True
                ).start()
            self._stopping.wait(0.1)

    def _restart(self, name: str, code: int) -> None:
        try:
            inc = self.current(name)
            if inc is not None:
                with self._lock:
                    inc.exited, inc.code = time.time(), code
                    inc.planned = name in self._planned
                    self._planned.discard(name)
                # what the dead process started (the data role's reward workers) goes with it
                inc.leftovers = len(end_group(inc.pid, 2.0, self.cluster.mark).left)
            delay = 1.0
            while not self._stopping.is_set():
                try:
                    self.start(name)
                    return
                except Exception:
                    self._stopping.wait(delay)  # a crash loop backs off, as a kubelet does
                    delay = min(2 * delay, 10.0)
        finally:
            self.restarting.discard(name)

    # -- memory --

    def memory_mib(self) -> dict[str, dict[str, float]]:
        """Memory of each role, its process and everything in its group: ``rss`` (resident)
        and ``anon`` (resident anonymous memory: the heaps, where a leak shows; a relay's
        weight versions are shared memory, bounded by ``relay.keep``, and not in it)."""
        out = {}
        for name in self.specs:
            pid = self.pid(name)
            if pid is None:
                continue
            total = {"rss": 0.0, "anon": 0.0}
            for member in group_members(pid, self.cluster.mark):
                got = _status_kib(member, ("VmRSS", "RssAnon"))
                total["rss"] += got.get("VmRSS", 0) / 1024
                total["anon"] += got.get("RssAnon", 0) / 1024
            out[name] = total
        return out

    # -- the end --

    def stop(self, order: list[list[str]], grace: float = 15.0) -> dict[str, int | None]:
        """Stop the watcher, then SIGTERM the roles tier by tier (rollouts before what they report
        to, the manager last) and clear every group ever started; exit code per role."""
        with self._lock:
            self._stopping.set()
        if self._watcher is not None:
            self._watcher.join(timeout=5)
        deadline = time.monotonic() + 60  # a start under way ends at its ready line (or death)
        while (self.restarting or self._starting) and time.monotonic() < deadline:
            time.sleep(0.1)
        codes: dict[str, int | None] = {}
        for tier in order:
            procs = {n: self.cluster.procs[n] for n in tier if n in self.cluster.procs}
            for proc in procs.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            end = time.monotonic() + grace
            for n, proc in procs.items():
                try:
                    proc.wait(timeout=max(0.1, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
                codes[n] = proc.returncode
        self.cluster.shutdown(grace=5.0)
        return codes


def _status_kib(pid: int, keys: tuple[str, ...]) -> dict[str, int]:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in keys:
                    out[key] = int(value.split()[0])
    except (OSError, ValueError):
        pass
    return out
