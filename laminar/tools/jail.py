"""The process a sandboxed tool call runs in: namespaces and limits first, then the tool.

``python -m laminar.tools.jail SPEC.json`` is what :func:`laminar.tools.sandbox.run_python`
starts (in a session of its own). Why a separate program rather than a ``preexec_fn``: the data
role has threads, and a forked child of a threaded process may deadlock on a lock another thread
held at the fork; here the parent only fork-execs, and this fresh interpreter sets everything up.

In order (each step's failure is an error on stderr and exit status 125, never a tool run without
it):

1. **Namespaces**: a new network namespace (only a loopback device, down: no network at all) and
   a new PID namespace; not as root, a new user namespace first, which is what lets an
   unprivileged user create the other two.
2. **Fork**: the child is PID 1 of the new PID namespace, a small init that forks the tool and
   exits with its status. When it exits, or is killed, the kernel kills every process left in
   the namespace: a fork bomb or a daemon that called ``setsid`` dies with the tool, whatever it
   did to its session or process group.
3. In the child: **limits** (RLIMIT_CPU, RLIMIT_AS, RLIMIT_NPROC, RLIMIT_FSIZE, no core dumps),
   then, as root, **a user of its own** (an unused uid and gid from the spec: RLIMIT_NPROC then
   counts only the tool's processes, and the tool cannot write what the project owns), then
   ``PR_SET_PDEATHSIG``: if this jail dies, the tool gets SIGKILL and the namespace with it.
4. ``exec`` the interpreter in isolated mode (``-I``: no user site, no ``PYTHONPATH``) on the
   tool's file, in its working directory, with the environment the spec gives (never the
   cluster's token: the caller builds it).

The jail waits for the child and exits with its status (128 + signal if it was killed).
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
CLONE_NEWPID = 0x20000000
PR_SET_PDEATHSIG = 1
SETUP_FAILED = 125


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def unshare(flags: int) -> None:
    if _libc().unshare(flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _map_user(uid: int, gid: int) -> None:
    """In a new user namespace, be root inside, mapped to who we are outside."""
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"0 {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"0 {gid} 1")


def isolate(root: bool) -> None:
    """Step 1 (see the module docstring)."""
    if root:
        unshare(CLONE_NEWNET | CLONE_NEWPID)
        return
    uid, gid = os.getuid(), os.getgid()
    unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID)
    _map_user(uid, gid)


def limit(spec: dict) -> None:
    """Step 3's limits, soft = hard so the tool cannot raise them (but the CPU limit's hard one
    is a second higher: SIGXCPU at the soft one says why; SIGKILL follows if it is ignored)."""
    mib = 1 << 20
    resource.setrlimit(resource.RLIMIT_CPU, (spec["cpu_s"], spec["cpu_s"] + 1))
    for which, value in (
        (resource.RLIMIT_AS, spec["memory_mib"] * mib),
        (resource.RLIMIT_NPROC, spec["max_processes"]),
        (resource.RLIMIT_FSIZE, spec["file_mib"] * mib),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(which, (value, value))


def become(uid: int, gid: int) -> None:
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)


def _die_with_parent() -> None:
    if _libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")


def exit_status(status: int) -> int:
    """A ``waitpid`` status as a shell reports it (128 + the signal that killed it)."""
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def child(spec: dict) -> None:
    """Steps 3 and 4; never returns. This process is PID 1 of the new namespace, and the kernel
    delivers no signal to a namespace's init that it has no handler for (SIGXCPU at the CPU
    limit, SIGSEGV, SIGTERM...): so it stays a small init that forks the tool, waits for it and
    exits with its status, and the tool gets the usual signal semantics. Its exit empties the
    namespace."""
    os.chdir(spec["workdir"])
    if spec.get("uid") is not None:
        become(spec["uid"], spec["gid"])  # before the limits: RLIMIT_NPROC is the new uid's
    limit(spec)
    # getppid() is 0 here (the parent is outside the namespace), so a jail that died before this
    # line goes unseen; the caller's kill of the session and, as root, of the uid cover it.
    _die_with_parent()
    tool = os.fork()
    if tool == 0:
        _die_with_parent()  # not inherited across fork
        os.execve(spec["python"], [spec["python"], "-I", spec["program"]], spec["env"])
    while True:  # reap: orphans of the namespace are ours too
        pid, status = os.wait()
        if pid == tool:
            os._exit(exit_status(status))


def main() -> int:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    try:
        isolate(os.geteuid() == 0)
    except OSError as exc:
        print(f"sandbox: cannot isolate the tool: unshare failed: {exc}", file=sys.stderr)
        return SETUP_FAILED
    pid = os.fork()
    if pid == 0:
        try:
            child(spec)
        except BaseException as exc:
            print(f"sandbox: cannot start the tool: {exc!r}", file=sys.stderr, flush=True)
        os._exit(SETUP_FAILED)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # the caller ends us: end it
        signal.signal(sig, lambda s, _f: os.kill(pid, signal.SIGKILL))
    _, status = os.waitpid(pid, 0)
    return exit_status(status)


if __name__ == "__main__":
    sys.exit(main())
