"""The jail a sandboxed tool call runs in (namespaces and limits, then the tool); its fork server.

A program of the standard library alone, run by path (``python -I -S jail.py``), so that it starts
in milliseconds and needs nothing a tool's user cannot read. Two ways to run it:

* ``jail.py --serve FD``: the **fork server** that :func:`laminar.tools.sandbox.run_python`
  starts once per process and keeps. It reads requests from the socket ``FD`` (a tool's spec, and
  the write ends of the pipes its stdout and stderr go to), forks a jail for each (below) and
  answers with the jail's pid, then its exit status. Why a server: without it a call starts two
  interpreters (this program, then the tool's own), where a fork of this small, warm interpreter
  is a small fraction of that and the tool runs in the fork (docs/benchmarks.md, *The tool
  sandbox*). The server is single-threaded, so its forks are safe (the data role, which
  has threads, only fork-execs the server); it exits, killing its jails, when the caller's end
  of the socket closes (the caller exited or was killed).
* ``jail.py SPEC.json``: one call, the jail below in this process (the tests run it as a plain
  user); its exit status is the tool's.

A jail, in order (each step's failure is an error on stderr and exit status 125, never a tool run
without it):

1. **Namespaces**: a new network namespace (only a loopback device, down: no network at all) and
   a new PID namespace; not as root, a new user namespace first, which is what lets an
   unprivileged user create the other two.
2. **Fork**: the child is PID 1 of the new PID namespace, a small init that forks the tool and
   exits with its status. When it exits, or is killed, the kernel kills every process left in
   the namespace: a fork bomb or a daemon that called ``setsid`` dies with the tool, whatever it
   did to its session or process group.
3. In the child: as root, **a user of its own** (an unused uid and gid from the spec: RLIMIT_NPROC
   then counts only the tool's processes, and the tool cannot write what the project owns), then
   **limits** (RLIMIT_CPU, RLIMIT_AS, RLIMIT_NPROC, RLIMIT_FSIZE, no core dumps), then
   ``PR_SET_PDEATHSIG``: if this jail dies, the tool gets SIGKILL and the namespace with it. As
   that user it makes the tool's **directory** (the spec's ``workdir``, mode 700: its cwd and
   ``HOME``) and writes the tool's code there as ``tool.py``.
4. The tool: a fork of the init runs ``tool.py`` as ``__main__`` (``runpy``) in this
   interpreter, isolated (``-I``: no user site, no ``PYTHONPATH``; ``-S``: no site-packages), in
   its directory, with exactly the environment the spec gives (never the cluster's token: the
   caller builds it) and the default signal dispositions. Its exit status is what a fresh
   ``python tool.py`` would give: 0, ``sys.exit``'s code, 1 with the traceback on stderr for an
   uncaught exception, 128 + the signal that killed it.
5. Once the tool has exited, the init kills whatever it left running (from a namespace's init,
   ``kill(-1)`` reaches every other process in it), reaps it, removes the directory and exits
   with the tool's status. So a call whose jail exits by itself leaves nothing, and its caller
   has nothing to clean up; only a jail that was stopped leaves that to the caller, and the
   server removes such a jail's directory too when it reaps it (the caller may exit first).

The jail waits for the child and exits with its status (128 + signal if it was killed); told to
stop (SIGTERM, SIGINT, SIGHUP), it kills the child first.
"""

from __future__ import annotations

import array
import ctypes
import json
import os
import pkgutil  # noqa: F401 - runpy.run_path imports it on first use: once, here, not per tool
import resource
import runpy
import selectors
import shutil
import signal
import socket
import sys
import traceback

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
CLONE_NEWPID = 0x20000000
PR_SET_PDEATHSIG = 1
SETUP_FAILED = 125
#: largest request (a spec is a few hundred bytes) and the most file descriptors one carries
MAX_MESSAGE = 1 << 16
MAX_FDS = 2


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


def _default_signals() -> None:
    """What a fresh interpreter starts with: every handler this program set undone (SIGINT back
    to Python's own, SIGPIPE ignored as Python does)."""
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def run_tool(spec: dict) -> int:
    """Step 4, in the tool's process: its file as ``__main__``; the status a fresh interpreter
    would exit with."""
    _default_signals()
    os.environ.clear()
    os.environ.update(spec["env"])
    program = os.path.join(spec["workdir"], "tool.py")
    sys.argv[:] = [program]
    code = 0
    try:
        runpy.run_path(program, run_name="__main__")
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code & 0xFF
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # what the interpreter would print, then status 1
        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            if code == 0:
                code = 120  # as the interpreter does when it cannot flush stdout at exit
    return code


def child(spec: dict) -> None:
    """Steps 3 to 5; never returns. This process is PID 1 of the new namespace, and the kernel
    delivers no signal to a namespace's init that it has no handler for (SIGXCPU at the CPU
    limit, SIGSEGV, SIGTERM...): so it stays a small init that forks the tool, waits for it and
    exits with its status, and the tool gets the usual signal semantics. Its exit empties the
    namespace."""
    if spec.get("uid") is not None:
        become(spec["uid"], spec["gid"])  # before the limits: RLIMIT_NPROC is the new uid's
    limit(spec)
    # getppid() is 0 here (the parent is outside the namespace), so a jail that died before this
    # line goes unseen; the caller's stop and, as root, its kill of the uid cover it.
    _die_with_parent()
    work = spec["workdir"]
    os.mkdir(work, 0o700)
    with open(os.path.join(work, "tool.py"), "w") as f:
        f.write(spec["code"])
    os.chdir(work)
    tool = os.fork()
    if tool == 0:
        status = SETUP_FAILED
        try:
            _die_with_parent()  # not inherited across fork
            status = run_tool(spec)
        finally:
            os._exit(status)
    while True:  # reap: orphans of the namespace are ours too
        pid, status = os.wait()
        if pid == tool:
            break
    try:  # step 5: what the tool left running (a daemon), then its directory
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:
        pass
    while True:
        try:
            os.wait()
        except ChildProcessError:
            break
    os.chdir("/")
    shutil.rmtree(work, ignore_errors=True)
    os._exit(exit_status(status))


def jail(spec: dict) -> int:
    """Steps 1 and 2 in this process, 3 to 5 in its child; the child's exit status."""
    try:
        isolate(os.geteuid() == 0)
    except OSError as exc:
        print(f"sandbox: cannot isolate the tool: unshare failed: {exc}", file=sys.stderr)
        return SETUP_FAILED
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            child(spec)
        except BaseException as exc:
            print(f"sandbox: cannot start the tool: {exc!r}", file=sys.stderr, flush=True)
        os._exit(SETUP_FAILED)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # told to stop: end the child
        signal.signal(sig, lambda s, _f: os.kill(pid, signal.SIGKILL))
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            return exit_status(status)
        except InterruptedError:  # pragma: no cover - PEP 475 retries; kept for old Pythons
            continue


# -- the fork server ------------------------------------------------------------------------


def _jail_of_server(spec: dict, out: int, err: int) -> int:
    """In a fork of the server: the call's pipes as stdout and stderr, every other descriptor of
    the server closed, death with the server, then the jail."""
    _default_signals()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.closerange(3, 1 << 16)  # the server's socket and wake-up pipe, these pipes' copies
    _die_with_parent()
    return jail(spec)


def _receive(sock: socket.socket) -> tuple[dict | None, list[int]]:
    """One request and the descriptors it carries; ``(None, [])`` once the caller is gone."""
    room = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
    data, ancillary, _, _ = sock.recvmsg(MAX_MESSAGE, room)
    fds = array.array("i")
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    if not data:
        return None, list(fds)
    return json.loads(data), list(fds)


def serve(fd: int) -> int:
    """The fork server's loop (see the module docstring). Requests: ``{"op": "run", "id": N,
    "spec": {...}}`` with two descriptors (stdout, stderr), answered ``{"id": N, "pid": P}`` and
    later ``{"id": N, "status": S}`` (or ``{"id": N, "error": "..."}`` when no jail started);
    ``{"op": "signal", "id": N, "signal": S}`` signals that call's jail while it has not been
    reaped (so never a recycled pid)."""
    sock = socket.socket(fileno=fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wake-up byte is written
    jobs: dict[int, int] = {}  # jail pid -> request id
    dirs: dict[int, str] = {}  # jail pid -> its tool's directory
    calls: dict[int, int] = {}  # request id -> jail pid
    signalled: set[int] = set()  # jail pids the caller signalled: stopped, not finished

    def send(message: dict) -> None:
        sock.send(json.dumps(message).encode())

    def reap() -> None:
        while jobs:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            call = jobs.pop(pid, None)
            work = dirs.pop(pid, None)
            if pid in signalled:
                # A stopped jail's init did not remove the directory. The caller removes it
                # too, but off its event loop: a role that exits right after cancelling its
                # calls (os._exit, as roles stop) never gets there, so the server does it here.
                signalled.discard(pid)
                if work is not None:
                    shutil.rmtree(work, ignore_errors=True)
            if call is not None:
                calls.pop(call, None)
                send({"id": call, "status": exit_status(status)})

    def run(message: dict, fds: list[int]) -> None:
        call = message["id"]
        if len(fds) != 2:
            send({"id": call, "error": f"a run carries 2 descriptors, not {len(fds)}"})
            return
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = os.fork()
        except OSError as exc:
            send({"id": call, "error": f"fork failed: {exc}"})
            return
        if pid == 0:
            status = SETUP_FAILED
            try:
                status = _jail_of_server(message["spec"], *fds)
            except BaseException as exc:
                print(f"sandbox: cannot start the jail: {exc!r}", file=sys.stderr, flush=True)
            finally:
                os._exit(status)
        jobs[pid] = call
        calls[call] = pid
        dirs[pid] = str(message["spec"]["workdir"])
        send({"id": call, "pid": pid})

    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    try:
        while True:
            for key, _ in selector.select():
                if key.fileobj is not sock:
                    while True:
                        try:
                            if not os.read(wake_r, 4096):
                                break
                        except BlockingIOError:
                            break
                    continue
                message, fds = _receive(sock)
                try:
                    if message is None:
                        return 0  # the caller is gone
                    if message.get("op") == "run":
                        run(message, fds)
                    elif message.get("op") == "signal" and message.get("id") in calls:
                        signalled.add(calls[message["id"]])
                        os.kill(calls[message["id"]], int(message["signal"]))
                finally:
                    for f in fds:
                        os.close(f)
            reap()
    except (BrokenPipeError, ConnectionResetError):
        return 0  # the caller is gone
    finally:
        # The caller is gone, so nobody will clean up after these jails: kill each (its init and
        # tool die with it, by their parent-death signals), reap it, remove its tool's directory.
        for pid in jobs:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        for work in dirs.values():
            shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--serve"] and len(argv) == 2:
        return serve(int(argv[1]))
    if len(argv) != 1:
        print("usage: jail.py SPEC.json | jail.py --serve FD", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    return jail(spec)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
