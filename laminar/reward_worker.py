"""The reward worker process: one reward call at a time, with what it can reach cut down.

A reward function may run code the model wrote (a unit test of a generated program, say). So
:class:`laminar.roles.data.rewards.RewardPool` never forks it from the data role (a fork shares the
role's memory, environment and connections): it starts ``python -m laminar.reward_worker`` with
an environment that holds neither the cluster token nor any other ``LAMINAR_*`` variable but the
run's process mark (exec'd, so not even ``/proc/self/environ`` has them), in a process group of
its own (killed whole, with whatever left it, when a call times out), its stdout pointed at
stderr (the role's stdout stays the role's). Here, before any user code is imported: resource
limits (``RLIMIT_AS``, ``RLIMIT_CPU``, ``RLIMIT_NPROC``, no core files), which what it starts
inherits, and death with the data role (``PR_SET_PDEATHSIG``).

This is damage control, not a sandbox: the worker runs as the data role's user, so it can read
what that user can (another process's ``/proc/<pid>/environ``, a token file). Run the data role
as a user of its own (or in a container) when rewards execute untrusted code.

Protocol, over two pipes passed by number: ``{"ready": true}`` on the results pipe once the
reward function is loaded (a call's timeout does not count the start); then one JSON line per call
on the jobs pipe (``[record, response]``), one JSON line per reply on the results pipe
(``{"reward": float | null, "error": str | null, "cpu_s": float}``, ``cpu_s`` the CPU time the
worker has used). JSON both ways, never pickle: the parent must not run whatever a reward makes
the worker send back.

Standard library only (plus :mod:`laminar.plugins`): the worker starts in tens of milliseconds,
without the data role's imports.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import numbers
import os
import resource
import signal
import sys
from typing import Any

from laminar.plugins import load_object

#: Environment variable marking every process a reward worker starts (its value is new per
#: worker): the pool kills what carries it when the worker ends, whatever group it moved to.
WORKER_MARK = "LAMINAR_REWARD_WORKER"

_MAX_ERROR = 2000  # characters of an error kept in the reply


def as_reward(value: Any) -> tuple[float | None, str | None]:
    """A reward function's result as a float, or why it is not one.

    Accepted: any real number (``int``, ``float``, ``fractions.Fraction``, NumPy's integer and
    floating scalars) and any 0-dimensional array with ``.item()`` (a NumPy 0-d array, a PyTorch
    scalar tensor), if finite. Refused: bools (``True``, ``numpy.bool_``), which are more often a
    forgotten comparison than a score: return ``float(correct)`` to mean 1.0 / 0.0."""
    if not isinstance(value, (int, float)) and getattr(value, "shape", None) == ():
        item = getattr(value, "item", None)
        if callable(item):
            value = item()
    shown = repr(value)
    shown = shown if len(shown) <= 200 else shown[:200] + "..."
    if isinstance(value, bool):
        return None, f"returned {shown}, a bool, not a number (return float(...) to score it)"
    if not isinstance(value, numbers.Real):
        return None, f"returned {shown}, not a number"
    try:
        number = float(value)
    except (OverflowError, ValueError):
        number = math.inf
    if not math.isfinite(number):
        return None, f"returned {shown}, not a finite number"
    return number, None


def call(fn: Any, record: Any, response: Any) -> tuple[float | None, str | None]:
    try:
        reward, error = as_reward(fn(record, response))
    except Exception as exc:
        reward, error = None, f"raised {type(exc).__name__}: {exc}"
    if error is not None and len(error) > _MAX_ERROR:
        error = error[:_MAX_ERROR] + "..."
    return reward, error


def _set_limit(which: int, soft: int, hard: int) -> None:
    """Lower a limit to (soft, hard), never above a hard limit already there."""
    _, current = resource.getrlimit(which)
    if current != resource.RLIM_INFINITY:
        soft, hard = min(soft, current), min(hard, current)
    resource.setrlimit(which, (soft, hard))


def apply_limits(limits: dict[str, Any]) -> None:
    """The pool's ``RewardSandbox`` settings, as resource limits of this process (inherited by
    what it starts). CPU: SIGXCPU at ``cpu_s``, SIGKILL 5 s later."""
    _set_limit(resource.RLIMIT_CORE, 0, 0)  # a killed worker dumps nothing
    if limits.get("memory_mib"):
        size = int(limits["memory_mib"]) << 20
        _set_limit(resource.RLIMIT_AS, size, size)
    if limits.get("cpu_s"):
        cpu = int(limits["cpu_s"])
        _set_limit(resource.RLIMIT_CPU, cpu, cpu + 5)
    if limits.get("max_processes"):
        n = int(limits["max_processes"])
        _set_limit(resource.RLIMIT_NPROC, n, n)


def _die_with(parent: int) -> None:
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the pipes' EOF still ends it
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the data role died before the signal was armed
        os._exit(1)


def cpu_used() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str]) -> int:
    args = json.loads(argv[0])
    _die_with(int(args["parent"]))
    apply_limits(args["limits"])
    sys.path[:] = args["path"]  # as the data role sees modules (what multiprocessing's spawn did)
    jobs = os.fdopen(int(args["jobs"]), "rb")
    results = os.fdopen(int(args["results"]), "wb")
    fn = load_object(args["spec"], what="reward")
    results.write(b'{"ready": true}\n')  # the pool's call timeouts start from here
    results.flush()
    for line in jobs:  # EOF: the pool closed the pipe, or the data role is gone
        record, response = json.loads(line)
        reward, error = call(fn, record, response)
        reply = {"reward": reward, "error": error, "cpu_s": cpu_used()}
        results.write(json.dumps(reply).encode() + b"\n")
        results.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
