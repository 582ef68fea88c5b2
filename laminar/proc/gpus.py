"""Which GPUs each role instance of ``laminar run`` sees (``CUDA_VISIBLE_DEVICES``).

Without a plan every process would see every GPU, and each would put its CUDA context, or more
(a data role that imports torch, a second vLLM engine sizing its cache from "free" memory), on
GPU 0. So on a machine with GPUs the local supervisor gives each instance its own: a vLLM rollout
its tensor-parallel size, a trainer ``data_parallel`` GPUs when its device is ``cuda`` or
``auto`` (its ranks then take GPU ``rank mod count`` of those), every other role none (an empty
``CUDA_VISIBLE_DEVICES``). Asking for more GPUs than the machine has is a configuration error
naming who asked for what. The same :func:`gpus_wanted` sizes the Ray launcher's bundles
(:mod:`laminar.devmode.ray_place`). On a machine without GPUs nothing is set.

Pure planning, unit-tested; :func:`visible_gpus` is the one probe (``CUDA_VISIBLE_DEVICES`` if
the user set it, else ``nvidia-smi -L``), so the supervisor never imports torch.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping
from typing import Any

from laminar.runtime.errors import ConfigError

__all__ = ["gpu_env", "gpus_wanted", "parse_nvidia_smi", "plan_gpus", "visible_gpus"]


def gpus_wanted(role: str, role_config: Any, machine_has_gpus: bool) -> float:
    """GPUs one instance of ``role`` needs, from its validated config section. A trainer whose
    device is ``cuda`` asks for its GPUs even where none are (placement then says none fit)."""
    if role == "rollout":
        engine = role_config.engine
        if engine.backend != "vllm" or not machine_has_gpus:
            return 0.0
        tp = getattr(engine, "tensor_parallel_size", None) or engine.extra.get(
            "tensor_parallel_size", 1
        )
        return float(tp)
    if role == "trainer":
        device = role_config.device
        if device == "cuda" or (device == "auto" and machine_has_gpus):
            # ranks served by their own processes bring their own GPUs (docs/training.md)
            return float(role_config.data_parallel if role_config.ranks == "spawn" else 1)
    if role == "trainer_rank" and machine_has_gpus:
        return 1.0
    return 0.0


def parse_nvidia_smi(text: str) -> list[str]:
    """GPU indices from ``nvidia-smi -L`` (``GPU 0: NVIDIA H100 ... (UUID: ...)`` lines)."""
    return [m.group(1) for m in re.finditer(r"^GPU (\d+):", text, re.MULTILINE)]


def visible_gpus(env: Mapping[str, str]) -> list[str]:
    """The GPUs the local machine lets the run use: the user's ``CUDA_VISIBLE_DEVICES`` if set, else
    what ``nvidia-smi -L`` lists (none without the driver)."""
    if "CUDA_VISIBLE_DEVICES" in env:
        return [g.strip() for g in env["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return []
    return parse_nvidia_smi(out.stdout) if out.returncode == 0 else []


def plan_gpus(gpus: list[str], wants: list[tuple[str, float]]) -> dict[str, list[str]]:
    """Consecutive GPUs for each ``(instance, count)`` in order; a count must be whole."""
    plan: dict[str, list[str]] = {}
    free = list(gpus)
    total = sum(w for _, w in wants)
    if total > len(gpus):
        asked = ", ".join(f"{name} {w:g}" for name, w in wants if w)
        raise ConfigError(
            f"the roles ask for {total:g} GPUs ({asked}) but this machine has {len(gpus)} "
            f"({','.join(gpus) or 'none'}): lower tensor_parallel_size or data_parallel, run "
            "fewer rollouts, or place roles on several machines (--launcher ray)"
        )
    for name, want in wants:
        if want != int(want):
            raise ConfigError(f"{name} asks for {want} GPUs: the local launcher gives whole GPUs")
        plan[name], free = free[: int(want)], free[int(want) :]
    return plan


def gpu_env(env: Mapping[str, str], gpus: list[str] | None) -> dict[str, str]:
    """``env`` with ``CUDA_VISIBLE_DEVICES`` set to ``gpus`` (None: left as it is)."""
    return dict(env) if gpus is None else {**env, "CUDA_VISIBLE_DEVICES": ",".join(gpus)}
