"""``laminar doctor``: what a run needs against what this machine has, checked before it starts.

Why a preflight: a run that cannot work on a machine used to fail minutes in, deep in a child's
log, and then restart until its budget was spent. On a 2-core machine whose NUMA node 0 holds
9.5 of its 23 GiB, both vLLM rollouts of the example refused their KV cache, restarted three
times and the run idled for 15 minutes; a missing SFT model, a small ``/dev/shm`` or a missing
token fail the same way, late. Every one of these is knowable up front from the config and a
few files under ``/proc`` and ``/sys``, so ``laminar doctor`` says so at once, one line per
problem with its fix, and ``laminar run`` runs it first and refuses to start on a blocker.

So that each check is testable on a machine it is not running on, the facts and the needs are
gathered once and the checks are pure functions of them:

* :mod:`.facts` — :class:`MachineFacts`, what this machine has (cores, NUMA memory as vLLM's CPU
  worker computes it, ``/dev/shm``, disks, the environment);
* :mod:`.probe` — whether vLLM and ucxx import, asked of a subprocess that overlaps the rest;
* :mod:`.needs` — :class:`RunNeeds`, what the config asks for, resolved as the supervisor does;
* :mod:`.checks` — ``check_*(facts, needs) -> list[Finding]`` and :data:`CHECKS`;
* :mod:`.findings` — :class:`Finding` (blocker, warning or ok, with its fix) and the report.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..config import LaminarConfig
from .checks import (
    CHECKS,
    SUITE_ONLY,
    check_chromium,
    check_cores,
    check_data,
    check_disk,
    check_kv_cache,
    check_memory,
    check_models,
    check_shm,
    check_token,
    check_ucxx,
    check_vllm,
    run_checks,
)
from .facts import DiskFacts, MachineFacts, NumaNode, gather_facts, parse_cpulist, read_numa_nodes
from .findings import Finding, Mode, Severity, blockers, findings_json, summary
from .needs import (
    LIGHT_CONFIG_MODELS,
    ModelDir,
    RolloutNeed,
    RunNeeds,
    inspect_model_dir,
    needs_from_config,
)
from .probe import ImportFacts, ImportProbe, probe_for

#: what `laminar` (cli.py) and tests/unit/test_doctor.py use; the rest lives in the submodules
__all__ = [
    "CHECKS",
    "LIGHT_CONFIG_MODELS",
    "DiskFacts",
    "Finding",
    "ImportFacts",
    "ImportProbe",
    "MachineFacts",
    "Mode",
    "ModelDir",
    "NumaNode",
    "RolloutNeed",
    "RunNeeds",
    "Severity",
    "blockers",
    "check_chromium",
    "check_cores",
    "check_data",
    "check_disk",
    "check_kv_cache",
    "check_memory",
    "check_models",
    "check_shm",
    "check_token",
    "check_ucxx",
    "check_vllm",
    "doctor",
    "findings_json",
    "inspect_model_dir",
    "needs_from_config",
    "parse_cpulist",
    "read_numa_nodes",
    "summary",
]


def doctor(
    config: LaminarConfig | None,
    mode: Mode = "run",
    serve_roles: Sequence[str] = (),
    *,
    preflight: bool = False,
) -> list[Finding]:
    """Every finding for ``config`` on this machine (None: the machine-only checks).
    ``preflight``: what ``laminar run`` checks before starting (no test-suite-only checks)."""
    probe = probe_for(config, mode, full=not preflight)  # first, so it overlaps loading roles
    try:
        if config is None:
            needs = RunNeeds(mode=mode, token_env="LAMINAR_TOKEN")
        else:
            needs = needs_from_config(config, mode, serve_roles)
    except BaseException:
        probe.cancel()
        raise
    facts = gather_facts([path for path, _, _ in needs.disk_or_cwd], probe)
    checks = [c for c in CHECKS if not (preflight and c in SUITE_ONLY)]
    return run_checks(facts, needs, checks)
