"""What the machine has, gathered once into :class:`MachineFacts` so every check is a pure
function of it and can be tested on a made-up machine.

Memory is read the way vLLM's CPU worker reads it, because that worker is what accepts or refuses
a KV cache: per NUMA node, free + file pages + reclaimable slab, clamped by the cgroup's limit."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .probe import ImportFacts, ImportProbe, MetadataProbe


@dataclass(frozen=True)
class NumaNode:
    """A memory node, with the numbers vLLM's CPU worker uses to accept or refuse a KV cache."""

    id: int
    cpus: frozenset[int]
    total_bytes: int
    available_bytes: int


@dataclass(frozen=True)
class DiskFacts:
    path: str  # the path asked about
    device: int  # st_dev of its nearest existing ancestor (paths on one filesystem share it)
    free_bytes: int


@dataclass(frozen=True)
class MachineFacts:
    cores: tuple[int, ...]  # this process's affinity mask
    nodes: tuple[NumaNode, ...]
    numa_sysfs: bool  # False: one node made from /proc/meminfo
    shm_total_bytes: int | None  # None: no /dev/shm
    shm_free_bytes: int | None
    env: Mapping[str, str] = field(default_factory=dict)
    chromium: str | None = None
    ucxx: ImportFacts | None = None  # None: not probed
    vllm: ImportFacts | None = None  # None: not probed (the config does not use vLLM)
    disks: tuple[DiskFacts, ...] = ()
    #: whether tool code can be jailed here: None, or why not (see ``sandbox_probed``)
    sandbox_problem: str | None = None
    sandbox_probed: bool = False  # False: not asked (the config has no environment)
    #: kernel.sched_autogroup_enabled (None: no such setting, e.g. not Linux)
    autogroup: bool | None = None

    def node_of(self, cpu: int) -> NumaNode:
        for node in self.nodes:
            if cpu in node.cpus:
                return node
        return self.nodes[0]


def _kib_lines(text: str) -> dict[str, int]:
    """``Key: N kB`` lines (``/proc/meminfo``, or ``Node 0 Key: N kB``) to bytes."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        head, sep, rest = line.partition(":")
        parts = rest.split()
        if sep and parts and parts[0].isdigit():
            scale = 1024 if len(parts) > 1 and parts[1] == "kB" else 1
            out[head.split()[-1]] = int(parts[0]) * scale
    return out


def parse_cpulist(text: str) -> frozenset[int]:
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return frozenset(cpus)


def _read_int(path: str | Path) -> int | None:
    try:
        return int(Path(path).read_text().strip())
    except (OSError, ValueError):
        return None


def cgroup_memory(root: str | Path = "/sys/fs/cgroup") -> tuple[int | None, int | None]:
    """``(limit, usage)`` of this process's memory cgroup (v2, else v1), as vLLM reads them."""
    root = Path(root)
    limit = _read_int(root / "memory.max")
    if limit is not None:
        return limit, _read_int(root / "memory.current")
    limit = _read_int(root / "memory" / "memory.limit_in_bytes")
    if limit is None or limit >= 1 << 62:
        return None, None
    return limit, _read_int(root / "memory" / "memory.usage_in_bytes")


def read_numa_nodes(
    sysfs: str | Path = "/sys/devices/system/node",
    proc_meminfo: str | Path = "/proc/meminfo",
    cores: Iterable[int] = (),
    cgroup: tuple[int | None, int | None] = (None, None),
) -> tuple[tuple[NumaNode, ...], bool]:
    """Every memory node as vLLM's CPU worker sees it, and whether they came from NUMA sysfs:
    available = MemFree + Active(file) + Inactive(file) + SReclaimable; with a cgroup limit below
    a node's total, both clamped to the cgroup's. No NUMA sysfs: one node from /proc/meminfo."""
    nodes: list[NumaNode] = []
    base = Path(sysfs)
    for d in sorted(base.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        try:
            info = _kib_lines((d / "meminfo").read_text())
            cpus = parse_cpulist((d / "cpulist").read_text())
        except OSError:
            continue
        if info.get("MemTotal", 0) <= 0:
            continue  # a node without memory (CPU-only or a generic initiator)
        available = sum(
            info.get(k, 0) for k in ("MemFree", "Active(file)", "Inactive(file)", "SReclaimable")
        )
        nodes.append(NumaNode(int(d.name[4:]), cpus, info["MemTotal"], available))
    numa = bool(nodes)
    if not nodes:
        info = _kib_lines(Path(proc_meminfo).read_text())
        total = info.get("MemTotal", 0)
        nodes.append(NumaNode(0, frozenset(cores), total, info.get("MemAvailable", total)))
    limit, usage = cgroup
    if limit is not None:
        nodes = [
            NumaNode(n.id, n.cpus, limit, max(0, min(n.available_bytes, limit - (usage or 0))))
            if limit < n.total_bytes
            else n
            for n in nodes
        ]
    return tuple(nodes), numa


def disk_facts(path: str | Path) -> DiskFacts:
    """Free bytes of the filesystem ``path`` will be on (its nearest existing ancestor)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    st = os.statvfs(p)
    return DiskFacts(str(path), os.stat(p).st_dev, st.f_bavail * st.f_frsize)


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return "/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) else None


def gather_facts(
    disk_paths: Iterable[str] = (".",),
    probe: ImportProbe | MetadataProbe | None = None,
    env: Mapping[str, str] | None = None,
    sandbox: bool = False,
) -> MachineFacts:
    """This machine's facts; ``probe`` (started earlier, see ``probe_for``) is awaited last.
    ``sandbox``: also run one jailed ``pass`` (:func:`laminar.tools.sandbox.check_sandbox`)."""
    cores = tuple(sorted(os.sched_getaffinity(0)))
    nodes, numa = read_numa_nodes(cores=cores, cgroup=cgroup_memory())
    try:
        st = os.statvfs("/dev/shm")
        shm_total: int | None = st.f_blocks * st.f_frsize
        shm_free: int | None = st.f_bavail * st.f_frsize
    except OSError:
        shm_total = shm_free = None
    disks = tuple(disk_facts(path) for path in disk_paths)
    sandbox_problem = None
    if sandbox:
        from ..tools.sandbox import check_sandbox

        sandbox_problem = check_sandbox()
    imports = probe.result() if probe is not None else {}
    return MachineFacts(
        cores=cores,
        nodes=nodes,
        numa_sysfs=numa,
        shm_total_bytes=shm_total,
        shm_free_bytes=shm_free,
        env=dict(os.environ if env is None else env),
        chromium=find_chromium(),
        ucxx=imports.get("ucxx"),
        vllm=imports.get("vllm"),
        disks=disks,
        sandbox_problem=sandbox_problem,
        sandbox_probed=sandbox,
        autogroup=read_autogroup(),
    )


def read_autogroup(path: str | Path = "/proc/sys/kernel/sched_autogroup_enabled") -> bool | None:
    value = _read_int(path)
    return None if value is None else value != 0
