"""Reading TensorBoard event files back in tests: the framing by hand, the events with the
tensorboard package's protobufs (tests/unit/test_tracking.py also reads them with TensorBoard's own
reader)."""

from __future__ import annotations

import struct
from pathlib import Path


def read_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in ``logdir``'s event files, parsed from the TFRecord framing."""
    from tensorboard.compat.proto.event_pb2 import Event

    out: dict[str, list[tuple[int, float]]] = {}
    files = sorted(logdir.glob("events.out.tfevents.*"))
    assert files, f"no event file in {logdir}"
    for path in files:
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos : pos + 8])
            event = Event.FromString(data[pos + 12 : pos + 12 + n])
            pos += 12 + n + 4  # length, its crc, the event, its crc
            for value in event.summary.value:
                out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out
