"""How bytes move: framing, TCP, in-process, shared memory, UCX. Knows nothing of roles.

Importing this package registers every built-in scheme; ``ucx://`` imports ``ucxx`` only when first
used, and needs the ``ucx`` extra.
"""

from . import inproc, shm, tcp, ucx  # noqa: F401  (register schemes; ucxx loads lazily)
from .base import (
    AuthenticationError,
    Connection,
    ConnectionClosed,
    Listener,
    TransportError,
    TransportOptions,
    connect,
    listen,
    split_address,
)
from .frames import Blob, Frame, FrameError, Limits, decode_payload, encode_payload

__all__ = [
    "AuthenticationError",
    "Blob",
    "Connection",
    "ConnectionClosed",
    "Frame",
    "FrameError",
    "Limits",
    "Listener",
    "TransportError",
    "TransportOptions",
    "connect",
    "decode_payload",
    "encode_payload",
    "listen",
    "split_address",
]
