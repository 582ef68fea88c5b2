"""The reward worker process: one job at a time (a trajectory or a batch), its reach cut down.

A reward function may run code the model wrote (a unit test of a generated program, say). So
:class:`laminar.roles.data.rewards.RewardPool` never forks it from the data role (a fork shares the
role's memory, environment and connections): it starts ``python -m
laminar.roles.data.reward_worker`` with
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
reward functions are loaded (a call's timeout does not count the start); then one JSON line per job
on the jobs pipe (``{"items": [{"record", "response", "ids", "version"}, ...]}``: one trajectory,
or a batch for batched functions), one JSON line per reply on the results pipe (``{"results":
[{"reward": float | null, "error": str | null, "extras": {name: float}}, ...], "cpu_s": float}``,
one result per item, ``cpu_s`` the CPU time the worker has used), at most
:data:`MAX_REPLY_BYTES` (errors are cut, then extras dropped, to fit). How the functions are called
and what they may return is :mod:`laminar.reward_calls`. JSON both ways, never pickle: the parent
must not run whatever a reward makes the worker send back.

Standard library only (plus :mod:`laminar.plugins` and the reward modules beside it): the worker
starts in tens of milliseconds, without the data role's imports.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import signal
import sys
from collections.abc import Sequence
from typing import Any

from laminar.plugins import load_object
from laminar.reward_calls import Function, Item, Result, Scorer, as_reward, clip

__all__ = ["MAX_REPLY_BYTES", "WORKER_MARK", "as_reward", "encode_reply", "main"]

#: Environment variable marking every process a reward worker starts (its value is new per
#: worker): the pool kills what carries it when the worker ends, whatever group it moved to.
WORKER_MARK = "LAMINAR_REWARD_WORKER"
#: The most bytes a reply line may have (the pool retires a worker that sends more).
MAX_REPLY_BYTES = 64 * 1024
_SHORT_ERROR = 200  # characters of each error kept when a batch's reply would be too long


def encode_reply(results: Sequence[Result], cpu_s: float) -> bytes:
    """One reply line, within :data:`MAX_REPLY_BYTES`: a batch whose errors and extras would not
    fit has its errors cut short, then (if that is not enough) its extras dropped, saying so on
    stderr; rewards are never dropped."""

    def encode(errors: int | None, extras: bool) -> bytes:
        items = [
            {
                "reward": r.reward,
                "error": r.error if r.error is None or errors is None else clip(r.error, errors),
                "extras": r.extras if extras else {},
            }
            for r in results
        ]
        line = json.dumps({"results": items, "cpu_s": cpu_s}, allow_nan=False)
        return line.encode() + b"\n"

    line = encode(None, True)
    if len(line) > MAX_REPLY_BYTES:
        line = encode(_SHORT_ERROR, True)
    if len(line) > MAX_REPLY_BYTES:
        line = encode(_SHORT_ERROR, False)
        print(
            f"laminar reward worker: the extras of a batch of {len(results)} did not fit in one "
            f"reply of {MAX_REPLY_BYTES} bytes: not logged",
            file=sys.stderr,
            flush=True,
        )
    return line


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


def load(functions: list[dict[str, Any]]) -> list[Function]:
    """The functions the pool names (``spec``, ``kind``, ``name``, ``weight``), imported here."""
    return [
        Function(load_object(f["spec"], what="reward"), f["kind"], f["name"], float(f["weight"]))
        for f in functions
    ]


def main(argv: list[str]) -> int:
    args = json.loads(argv[0])
    _die_with(int(args["parent"]))
    apply_limits(args["limits"])
    sys.path[:] = args["path"]  # as the data role sees modules (what multiprocessing's spawn did)
    jobs = os.fdopen(int(args["jobs"]), "rb")
    results = os.fdopen(int(args["results"]), "wb")
    scorer = Scorer(load(args["functions"]), args["kwargs"], args["prompt_key"])
    results.write(b'{"ready": true}\n')  # the pool's call timeouts start from here
    results.flush()
    for line in jobs:  # EOF: the pool closed the pipe, or the data role is gone
        items = [Item(**item) for item in json.loads(line)["items"]]
        results.write(encode_reply(scorer.score(items), cpu_used()))
        results.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
