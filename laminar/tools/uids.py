"""The uid each sandboxed call runs as (as root): one no other call holds, on the whole host.

Why it matters: a call's clean-up kills every process of its uid (:mod:`.sandbox`), so two calls
on one uid would kill each other's tools. Drawn at random from 60,000 uids, 8 calls in flight
share one with a chance of about 1 in 2,000 per call, which a tool-calling run (hundreds of calls
a minute) meets within minutes: it shows as a call ``killed by SIGKILL``.

A claim is a byte-range lock on one file (``/tmp/laminar-sandbox-uids.lock``, byte ``uid -
first``): the kernel releases it when the holder exits, whatever way, so a claim never outlives
its process. POSIX locks belong to the process, not to the call, so the calls of one process
also keep a set of what they hold (and the file stays open: closing any descriptor of it would
drop every lock the process holds on it).
"""

from __future__ import annotations

import fcntl
import os
import secrets
import threading
from collections.abc import Iterator
from contextlib import contextmanager

#: uids a tool runs as (as root): one per call, drawn from a range no distribution allocates
#: (systemd's dynamic users stop at 61183; container ranges start at 524288).
SANDBOX_UIDS = range(200_000, 260_000)
LOCK_FILE = "/tmp/laminar-sandbox-uids.lock"


class UidClaims:
    """Claims on :data:`SANDBOX_UIDS` for this process (see the module docstring)."""

    def __init__(self, path: str = LOCK_FILE, uids: range = SANDBOX_UIDS) -> None:
        self.path = path
        self.uids = uids
        self._held: set[int] = set()
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._pid = 0  # the process that opened the file (a fork holds none of its locks)

    def claim(self) -> int:
        """A uid that no other call on the host holds, held until :meth:`release`."""
        with self._lock:
            fd = self._file()
            for _ in range(1000):
                uid = self.uids[secrets.randbelow(len(self.uids))]
                if uid in self._held:
                    continue
                try:
                    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, uid - self.uids.start)
                except OSError:  # another process holds it
                    continue
                self._held.add(uid)
                return uid
        raise RuntimeError(f"no free sandbox uid in {self.uids} after 1000 draws")

    def release(self, uid: int) -> None:
        with self._lock:
            if uid in self._held and self._fd is not None:
                self._held.discard(uid)
                fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, uid - self.uids.start)

    @contextmanager
    def claimed(self) -> Iterator[int]:
        uid = self.claim()
        try:
            yield uid
        finally:
            self.release(uid)

    def _file(self) -> int:
        if self._fd is None or self._pid != os.getpid():
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            self._pid = os.getpid()
            self._held.clear()
        return self._fd


#: this process's claims
CLAIMS = UidClaims()
