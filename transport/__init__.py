"""How bytes move: framing, TCP, in-process, shared memory, UCX. Knows nothing of roles.

Importing this package registers every built-in scheme; ``ucx://`` imports ``ucxx`` only when first
used, and needs the ``ucx`` extra.
"""

from . import inproc, shm, tcp, ucx  # noqa: F401  (register schemes; ucxx loads lazily)
from .arrays import WIRE_CONTEXT, wire_array
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
from .frames import (
    Blob,
    Frame,
    FrameError,
    Limits,
    MessageTooLarge,
    decode_payload,
    encode_payload,
)

__all__ = [
    "WIRE_CONTEXT",
    "AuthenticationError",
    "Blob",
    "Connection",
    "ConnectionClosed",
    "Frame",
    "FrameError",
    "Limits",
    "Listener",
    "MessageTooLarge",
    "TransportError",
    "TransportOptions",
    "connect",
    "decode_payload",
    "encode_payload",
    "listen",
    "split_address",
    "wire_array",
]
