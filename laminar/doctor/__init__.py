"""``laminar doctor``: what a run needs against what the machine has, checked before it starts.

Why a preflight: a run that cannot work on a machine fails minutes in, deep in a child's log, and
then restarts until its budget is spent: vLLM rollouts whose KV cache does not fit the NUMA node
they run on refuse it at every restart while the run idles; a missing SFT model, a small
``/dev/shm`` or a missing token fail the same way, late. Every one of these is knowable up front
from the config and a few files under ``/proc`` and ``/sys``, so ``laminar doctor`` says so at once,
one line per problem with its fix, and ``laminar run`` runs it first and refuses to start on a
blocker.

So that each check is testable on a machine it is not running on, the facts and the needs are
gathered once and the checks are pure functions of them:

* :mod:`.facts` — :class:`MachineFacts`, what the machine has (cores, NUMA memory as vLLM's CPU
  worker computes it, ``/dev/shm``, disks, the environment, the kernel's autogroup setting);
* :mod:`.probe` — whether vLLM and ucxx import, asked of a subprocess that overlaps the rest
  (``laminar doctor``), or only whether they are installed, from package metadata (the preflight
  of ``laminar run``, which must not pay a vLLM import);
* :mod:`.needs` — :class:`RunNeeds`, what the config asks for, resolved as the supervisor does;
* :mod:`.checks` — ``check_*(facts, needs) -> list[Finding]`` and :data:`CHECKS`;
* :mod:`.findings` — :class:`Finding` (blocker, warning or ok, with its fix) and the report.

This package exports what ``laminar`` (``laminar.cli``) uses and the entry points; everything
else is imported from its submodule.
"""

from __future__ import annotations

from collections.abc import Sequence

from laminar.runtime.config import LaminarConfig

from .checks import CHECKS, SUITE_ONLY, run_checks
from .facts import gather_facts
from .findings import Finding, Mode, blockers, findings_json, summary
from .needs import RunNeeds, needs_from_config
from .probe import probe_for

__all__ = [
    "Finding",
    "blockers",
    "doctor",
    "findings_json",
    "gather_facts",
    "needs_from_config",
    "run_checks",
    "summary",
]


def doctor(
    config: LaminarConfig | None,
    mode: Mode = "run",
    serve_roles: Sequence[str] = (),
    *,
    preflight: bool = False,
) -> list[Finding]:
    """Every finding for ``config`` on the local machine (None: the machine-only checks).
    ``preflight``: what ``laminar run`` checks before starting: no test-suite-only checks, and
    vLLM and ucxx from their package metadata, not imported (no subprocess)."""
    probe = probe_for(config, mode, full=not preflight)  # first, so it overlaps loading roles
    try:
        if config is None:
            needs = RunNeeds(mode=mode, token_env="LAMINAR_TOKEN")
        else:
            needs = needs_from_config(config, mode, serve_roles)
        disk_paths = [path for path, _, _ in needs.disk_or_cwd]
        facts = gather_facts(disk_paths, probe, sandbox=needs.environment is not None)
    finally:
        probe.cancel()  # nothing once its result is in; else (an error above) no probe outlives us
    checks = [c for c in CHECKS if not (preflight and c in SUITE_ONLY)]
    return run_checks(facts, needs, checks)
