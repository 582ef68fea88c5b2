"""The caller's side of the jail's fork server (``jail.py --serve``): one server per process.

:func:`laminar.tools.sandbox.run_python` hands each call's spec and output pipes to
:meth:`JailServer.start`, which returns a :class:`JailCall`: the jail's pid once it is forked,
its exit status once it is reaped, and a way to signal it meanwhile. Why one server per process
and not per event loop: a process runs tool calls from more than one loop (the data role's; an
evaluation's private loop in a worker thread; every ``asyncio.run`` of a test). So the server's
replies are read by a thread of this module, which resolves each call's futures on the loop that
made it.

Lifetime: the server is started on first use (a fork-exec of a small interpreter with a minimal
environment: nothing of ours, no token) in the caller's process group, so whatever ends a role's
group ends it too. It exits by itself, killing its jails, once its end of the socket reads EOF:
when this process exits or is killed, whatever way. If it dies first, every call in flight fails
with :class:`JailServerGone` and the next call starts a new one.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import itertools
import json
import os
import socket
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: the jail program, run by path with ``-I -S`` (no site: it needs the standard library only)
JAIL = str(Path(__file__).with_name("jail.py"))
#: a request that the server has not read within this long means it is stuck: it is replaced
SEND_TIMEOUT_S = 10.0


class JailServerGone(RuntimeError):
    """The fork server exited (or could not be reached) before the call's jail was reaped."""


@dataclass
class JailCall:
    """One call's jail, as the server reports it."""

    server: JailServer
    id: int
    loop: asyncio.AbstractEventLoop
    pid: asyncio.Future[int] = field(init=False)
    status: asyncio.Future[int] = field(init=False)

    def __post_init__(self) -> None:
        self.pid = self.loop.create_future()
        self.status = self.loop.create_future()

    def signal(self, sig: int) -> None:
        """Signal the jail, if it has not been reaped yet (the server checks: never a recycled
        pid). Told SIGTERM, a jail kills its tool and exits; SIGKILL kills it outright (its
        init, then the tool's namespace, die by their parent-death signal)."""
        self.server.signal(self.id, sig)

    def _resolve(self, message: dict[str, Any]) -> None:
        if "error" in message:
            self._fail(JailServerGone(f"no jail started: {message['error']}"))
        elif "pid" in message and not self.pid.done():
            self.pid.set_result(int(message["pid"]))
        elif "status" in message and not self.status.done():
            self.status.set_result(int(message["status"]))

    def _fail(self, error: BaseException) -> None:
        for future in (self.pid, self.status):
            if not future.done():
                future.set_exception(error)
        for future in (self.pid, self.status):  # nobody may await them: no "never retrieved"
            future.exception()


class JailServer:
    """A running fork server and the thread that reads its replies (see the module docstring)."""

    _current: JailServer | None = None
    _lock = threading.Lock()

    @classmethod
    def get(cls, python: str) -> JailServer:
        """This process's server, started now if there is none or the last one died."""
        with cls._lock:
            current = cls._current
            # a fork of this process (no exec) must not share the server's socket with us
            if current is None or not current.alive or current.owner != os.getpid():
                cls._current = current = cls(python)
            return current

    @classmethod
    def close_current(cls) -> None:
        """End this process's server, if any (a process that is done with tools: ``laminar
        doctor``'s one probe); a later call starts another."""
        with cls._lock:
            current, cls._current = cls._current, None
        if current is not None:
            current.close("closed by its owner")

    def __init__(self, python: str) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.process = subprocess.Popen(
                [python, "-I", "-S", JAIL, "--serve", str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,  # its errors go to our stderr (the role's log)
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            )
        finally:
            theirs.close()
        ours.settimeout(SEND_TIMEOUT_S)
        self.owner = os.getpid()
        self.sock = ours
        self.alive = True
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._calls: dict[int, JailCall] = {}
        self._reader = threading.Thread(
            target=self._read_replies, name="laminar-jail-server", daemon=True
        )
        self._reader.start()

    def start(self, spec: dict[str, Any], stdout: int, stderr: int) -> JailCall:
        """Ask for a jail running ``spec`` with these descriptors as its stdout and stderr (the
        caller closes its copies once this returns)."""
        call = JailCall(self, next(self._ids), asyncio.get_running_loop())
        with self._send_lock:
            self._calls[call.id] = call
        message = json.dumps({"op": "run", "id": call.id, "spec": spec}).encode()
        fds = array.array("i", [stdout, stderr])
        self._send(message, [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds.tobytes())])
        return call

    def signal(self, call_id: int, sig: int) -> None:
        with contextlib.suppress(JailServerGone):
            self._send(json.dumps({"op": "signal", "id": call_id, "signal": int(sig)}).encode())

    def _send(self, message: bytes, ancillary: list[tuple[int, int, bytes]] | None = None) -> None:
        try:
            with self._send_lock:
                if not self.alive:
                    raise JailServerGone("the jail server has exited")
                self.sock.sendmsg([message], ancillary or [])
        except OSError as exc:  # a timeout (the server is stuck), a broken pipe (it died)
            why = f"cannot reach the jail server: {exc!r}"
            self.close(why, kill=True)
            raise JailServerGone(why) from exc

    def _read_replies(self) -> None:
        why = "the jail server exited"
        try:
            while True:
                try:
                    data = self.sock.recv(1 << 16)
                except TimeoutError:
                    continue  # the socket's timeout is for sends; replies may be far apart
                if not data:
                    break
                message = json.loads(data)
                with self._send_lock:
                    call = self._calls.get(message["id"])
                    if call is not None and ("status" in message or "error" in message):
                        del self._calls[message["id"]]
                if call is not None:
                    _call_soon(call.loop, call._resolve, message)
        except (OSError, ValueError, KeyError) as exc:  # a failed socket, a garbled reply
            why = f"the jail server's socket failed: {exc!r}"
        self.close(why)
        self.process.wait()  # reaped here, whoever ended it

    def close(self, why: str, *, kill: bool = False) -> None:
        """Stop using this server: its calls in flight fail; the next call starts another. The
        server exits once it reads EOF (its jails with it); with ``kill`` (it did not read a
        request in time: stuck) it is killed."""
        with self._send_lock:
            if not self.alive:
                return
            self.alive = False
            calls, self._calls = self._calls, {}
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        if kill:
            with contextlib.suppress(OSError):
                self.process.kill()
        for call in calls.values():
            _call_soon(call.loop, call._fail, JailServerGone(why))


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> None:
    """``fn(*args)`` on ``loop``, from any thread; nothing if that loop has closed meanwhile (its
    caller is gone: a finished ``asyncio.run``)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)
