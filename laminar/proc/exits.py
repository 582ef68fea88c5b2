"""What a role instance's exit says: its own error line, an OOM kill, the exit in words.

When a child of ``laminar run`` fails, the supervisor says why on the console beside the exit
status, in every display mode, not only in the child's log file (``docs/deploy.md``, *When a
role fails*). It keeps a bounded tail of each incarnation's output (:class:`OutputTail`) and,
once the process has exited, picks the error line out of it (:func:`error_line`), in this order:

1. the last ``laminar <command>: ...`` line: the CLI's own last word (a configuration it refused,
   a Laminar error it caught), printed instead of a traceback;
2. the exception line of the last Python traceback (``Type: message``, the first line after the
   frames), read per process: behind vLLM's log prefixes (``(EngineCore pid=N) ERROR ...
   [file:line]``: a rollout's engine core and workers share its pipes, and their lines
   interleave) and inside an exception group's borders. One that only points elsewhere ("see the
   stack trace above for the root cause": vLLM's ``EngineDeadError`` in the rollout, the engine
   core's "Worker failed" wrapper) yields to a root cause printed before it, so a vLLM rollout's
   line is what its worker raised; with only such pointers, the first (the nearest to the cause:
   the wrapper quotes it), and an ``ExceptionGroup``'s summary only when nothing else is there.
   ``Fatal Python error: ...`` (a crash in C) counts as a root cause;
3. the last ``error`` or ``critical`` event of the role's structured log
   (:mod:`laminar.runtime.log`,
   console or JSON format).

None of them: no line is claimed (the last line of output is as likely a log line as a reason).
A process ended by SIGKILL, SIGTERM, SIGINT or SIGHUP printed nothing at its end, so its tail is
not searched: a traceback found there would be an old one.

A child killed by SIGKILL that the supervisor did not kill (it kills only while stopping, when no
restart is decided) may have been killed by the kernel's OOM killer. The kernel counts OOM kills
per memory cgroup (``oom_kill`` in cgroup v2's ``memory.events``, or in v1's
``memory.oom_control``; kills of any kind, the machine's or the cgroup's limit): read when an
incarnation starts and again when it exits (:class:`OomCounter`), a rise is said as "killed by
the kernel's OOM killer". Where neither file is readable the supervisor cannot tell, and says so.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

#: The exit status of a ``laminar serve`` whose configuration was refused before it was ready
#: (sysexits' EX_CONFIG): starting it again would refuse it again.
EX_CONFIG = 78

#: How much of an incarnation's output is kept to find its error line: a vLLM rollout's failure
#: prints hundreds of lines (the worker's traceback, the engine core's, the rollout's, each
#: warm-up request's), the root cause among the first of them.
TAIL_LINES = 600
TAIL_CHARS = 512 * 1024

#: Signals whose process printed nothing at its end (killed, or stopped without handling it).
_SILENT = {signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP}

OOM_WORDS = "killed by the kernel's OOM killer (out of memory; `laminar doctor` checks memory)"
OOM_MEANWHILE = "the kernel's OOM killer killed a process of its memory cgroup meanwhile"


# -- the exit --------------------------------------------------------------------------------------


def describe(code: int | None) -> str:
    """An exit status in words: ``code 3``, ``signal 9 (SIGKILL)``, ``unknown status``."""
    if code is None:
        return "unknown status"
    if code >= 0:
        return f"code {code}"
    with contextlib.suppress(ValueError):
        return f"signal {-code} ({signal.Signals(-code).name})"
    return f"signal {-code}"


@dataclass(frozen=True)
class Exit:
    """How one incarnation ended: what the restart policy decides on, and what is said.

    ``code``: the exit status (negative: the signal; None: unknown). ``error``: the child's own
    error line, if one was found. ``oom``: whether the kernel's OOM-kill count of its memory
    cgroup rose while it ran (None: not readable). ``ready_s``: how long it had been ready when
    it exited (None: it never was)."""

    code: int | None
    error: str | None = None
    oom: bool | None = None
    ready_s: float | None = None

    @property
    def failed(self) -> bool:
        return self.code != 0

    @property
    def killed(self) -> bool:
        return self.code == -signal.SIGKILL

    def reason(self) -> str | None:
        """Why it failed, in words (None: not known)."""
        if self.killed:
            return OOM_WORDS if self.oom else None
        if self.oom and self.failed:
            return f"{self.error} ({OOM_MEANWHILE})" if self.error else OOM_MEANWHILE
        return self.error

    def words(self) -> str:
        """``code 1: ValueError: ...``, ``signal 9 (SIGKILL): killed by ...``, ``code 0``."""
        reason = self.reason() if self.failed else None
        return describe(self.code) + (f": {reason}" if reason else "")

    def hint(self) -> str | None:
        """What to say beside a SIGKILL whose source cannot be told."""
        if self.killed and self.oom is None:
            return (
                "SIGKILL did not come from the supervisor: unless you sent it, the kernel's OOM "
                "killer may have (this machine's OOM counters are not readable; `laminar doctor` "
                "checks memory)"
            )
        return None

    def signature(self) -> tuple[int | None, str] | None:
        """What two failures must share to be "the same way": the exit status and the reason
        with its numbers masked (a pid, a port or an address differs between two incarnations
        failing for the same cause). None: no reason known, so never the same."""
        reason = self.reason()
        if not self.failed or reason is None:
            return None
        return self.code, re.sub(r"0x[0-9a-fA-F]+|\d+", "#", reason)

    def wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Exit:
        return cls(**data)


# -- the output's tail -----------------------------------------------------------------------------


class OutputTail:
    """The last lines of one incarnation's output (stdout and stderr as they arrived), bounded in
    lines and characters; when the last one came."""

    def __init__(self, lines: int = TAIL_LINES, chars: int = TAIL_CHARS) -> None:
        self.chars = chars
        self._lines: deque[str] = deque(maxlen=lines)
        self._size = 0
        self.last_at = time.monotonic()

    def add(self, line: str) -> None:
        if len(self._lines) == self._lines.maxlen:
            self._size -= len(self._lines[0])
        self._lines.append(line)
        self._size += len(line)
        while self._size > self.chars and len(self._lines) > 1:
            self._size -= len(self._lines.popleft())
        self.last_at = time.monotonic()

    def lines(self) -> list[str]:
        return list(self._lines)

    def error_line(self, code: int | None) -> str | None:
        """The error line of a process that exited with ``code`` (see the module docstring)."""
        if code is not None and code < 0 and -code in _SILENT:
            return None
        return error_line(self._lines)


# -- the error line --------------------------------------------------------------------------------

#: vLLM's prefix on what its processes print: ``(EngineCore pid=12) ERROR 12-02 01:56:05
#: [core.py:1512] `` (the level part only on log records; older versions name the process
#: ``(VllmWorker rank=0 pid=12)``); the process part tells whose traceback a line belongs to.
_VLLM = re.compile(
    r"^(?P<who>\([^()]*\bpid=\d+\)) ?"
    r"(?:(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? \[[^\]]*\] ?)?"
)
#: an exception group's borders: ``  | `` before its lines, ``  + Exception Group Traceback``
_BORDER = re.compile(r"^ *[|+](?: |$)")
_SEPARATOR = re.compile(r"^ *\+?-[-+]")  # ``  +-+---- 1 ----``, ``    +------``
_HEADER = re.compile(r"^(?:Exception Group )?Traceback \(most recent call last\):$")
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(?::(?: .*)?)?$")
_FATAL = re.compile(r"^Fatal Python error: ")
_CLI = re.compile(r"^laminar [a-z][\w-]*: \S")
#: a line that only points to another's traceback
_POINTER = re.compile(r"\b(?:see|check)\b.*\babove\b|\babove\b.*\broot cause\b", re.IGNORECASE)
#: structlog's console renderer: ``2026-12-02T01:46:17.123Z [error    ] event   key=value``
_EVENT = re.compile(r"^\S+ \[(?P<level>error|critical) *\] (?P<rest>.*)$")
_EVENT_KEYS = re.compile(r"\s+(?=[A-Za-z_][\w.]*=)")


def _is_group(line: str) -> bool:
    return line.split(":", 1)[0].endswith("ExceptionGroup")


def _event(line: str) -> str | None:
    """The words of a structured log line at level error or critical (None: not one)."""
    if line.startswith("{"):
        try:
            record = json.loads(line)
        except ValueError:
            return None
        if not isinstance(record, dict) or record.get("level") not in ("error", "critical"):
            return None
        exc = record.get("exception")
        if isinstance(exc, str) and (found := error_line(exc.splitlines())):
            return found
        event = str(record.get("event", "")).strip()
        error = record.get("error")
        return f"{event}: {error}" if error else event or None
    m = _EVENT.match(line)
    if m is None:
        return None
    return _EVENT_KEYS.split(m["rest"], maxsplit=1)[0].strip() or None


def error_line(lines: Any) -> str | None:
    """The error line among a process's output ``lines`` (an iterable of str), by the rule of
    the module docstring; None if there is none."""
    cli: str | None = None
    roots: list[str] = []  # exception lines in order; pointers and group summaries apart
    pointers: list[str] = []
    groups: list[str] = []
    event: str | None = None
    in_traceback: set[str] = set()  # the processes (vLLM prefix, or "") inside a traceback
    for raw in lines:
        who = ""
        text = raw
        m = _VLLM.match(text)
        if m is not None:
            who, text = m["who"], text[m.end() :]
        if _SEPARATOR.match(text):
            continue
        while _BORDER.match(text):
            text = _BORDER.sub("", text, count=1)
        if not text.strip():
            continue
        if _HEADER.match(text):
            in_traceback.add(who)
            continue
        if who in in_traceback:
            if text[0].isspace():
                continue  # a frame, its source line, its carets
            in_traceback.discard(who)
            if _EXCEPTION.match(text):
                kind = groups if _is_group(text) else pointers if _POINTER.search(text) else roots
                kind.append(text.strip())
            continue
        if _FATAL.match(text):
            roots.append(text.strip())
        elif _CLI.match(text):
            cli = text.strip()
        elif (found := _event(text)) is not None:
            event = found
    if cli is not None:
        return cli
    if roots:
        return roots[-1]
    if pointers:
        return pointers[0]
    return groups[-1] if groups else event


# -- OOM kills -------------------------------------------------------------------------------------


CGROUP_ROOT = Path("/sys/fs/cgroup")


def _counter(path: Path, key: str) -> int | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            with contextlib.suppress(ValueError):
                return int(value)
    return None


class OomCounter:
    """The kernel's count of OOM kills in one process's memory cgroup (cgroup v2's
    ``memory.events``, else v1's ``memory.oom_control``), read at an incarnation's start and
    again at its end. :meth:`of` gives None where neither is readable."""

    def __init__(self, path: Path, start: int) -> None:
        self.path = path
        self.start = start

    @classmethod
    def of(cls, pid: int | str = "self", root: Path = CGROUP_ROOT) -> OomCounter | None:
        """The counter of ``pid``'s memory cgroup, its count now; None where none is readable."""
        try:
            entries = Path(f"/proc/{pid}/cgroup").read_text()
        except OSError:
            return None
        return cls.from_entries(entries, root)

    @classmethod
    def from_entries(cls, entries: str, root: Path = CGROUP_ROOT) -> OomCounter | None:
        """The counter named by the lines of a ``/proc/PID/cgroup`` file: cgroup v2's
        ``memory.events`` (a unified mount, or beside v1 under ``unified/``), else v1's
        ``memory.oom_control``."""
        v2: list[Path] = []
        v1: list[Path] = []
        for entry in entries.splitlines():
            hierarchy, _, rest = entry.partition(":")
            controllers, _, where = rest.partition(":")
            relative = where.strip().lstrip("/")
            if hierarchy == "0" and not controllers:
                v2 += [
                    root / relative / "memory.events",
                    root / "unified" / relative / "memory.events",
                ]
            elif "memory" in controllers.split(","):
                v1.append(root / "memory" / relative / "memory.oom_control")
        for path in v2 + v1:
            count = _counter(path, "oom_kill")
            if count is not None:
                return cls(path, count)
        return None

    def rose(self) -> bool | None:
        """Whether an OOM kill was counted since the start (None: no longer readable)."""
        now = _counter(self.path, "oom_kill")
        return None if now is None else now > self.start


def oom_rose(counter: OomCounter | None) -> bool | None:
    return None if counter is None else counter.rose()


def ready_for(ready_at: float | None) -> float | None:
    """Seconds since ``ready_at`` (a :func:`time.monotonic` reading), None if never ready."""
    return None if ready_at is None else max(0.0, time.monotonic() - ready_at)
