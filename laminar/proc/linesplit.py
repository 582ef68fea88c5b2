"""Lines out of a child's output stream, each at most so long, whatever the child prints.

``asyncio.StreamReader.readline`` gives up on a line over its limit (64 KiB by default) with an
error, and a reader that stops leaves the child blocked on a full pipe: alive, but hung. So
``laminar run`` reads its children's output in chunks and splits it here: a line over the limit
keeps its head and says how much of it was left out, and reading goes on.
"""

from __future__ import annotations

#: The longest line kept whole (bytes); the rest of a longer one is dropped and counted.
MAX_LINE_BYTES = 64 * 1024


class LineSplitter:
    """Feed bytes in, get whole lines out (decoded, trailing whitespace stripped)."""

    def __init__(self, limit: int = MAX_LINE_BYTES) -> None:
        self.limit = limit
        self._line = bytearray()
        self._dropped = 0  # bytes of the current line beyond ``limit``

    def feed(self, data: bytes) -> list[str]:
        out: list[str] = []
        start = 0
        while True:
            newline = data.find(b"\n", start)
            end = len(data) if newline < 0 else newline
            room = max(self.limit - len(self._line), 0)
            kept = min(end - start, room)
            self._line += data[start : start + kept]
            self._dropped += end - start - kept
            if newline < 0:
                return out
            out.append(self._take())
            start = newline + 1

    def close(self) -> list[str]:
        """The last line, if the stream ended without a newline."""
        return [self._take()] if self._line or self._dropped else []

    def _take(self) -> str:
        text = self._line.decode(errors="replace").rstrip()
        if self._dropped:
            text += f" ... [line truncated: {self._dropped} more bytes not shown]"
        self._line.clear()
        self._dropped = 0
        return text
