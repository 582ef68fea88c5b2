"""The RPC protocol on the wire: frame kinds and how models are encoded. Shared by the serving side
(:mod:`laminar.runtime.rpc.server`), its bookkeeping (:mod:`laminar.runtime.rpc.calls`) and the
calling side
(:mod:`laminar.runtime.rpc.client`).

Frame kinds (meta ``k``), all other meta keys short: ``i`` call id, ``m`` method::

    CALL    i m  payload=request      ->  REPLY i payload=response | ERROR i e
    NOTIFY    m  payload=request      ->  (nothing; failures are logged on the server)
    STREAM  i m c  payload=request    ->  ITEM i payload=item ... END i | ERROR i e
    CREDIT  i n                       ->  (the stream may send n more items)
    CANCEL  i                         ->  the server cancels the handler task of call i
    PING                              ->  PONG (liveness of an otherwise quiet connection)

``c`` on a STREAM is the number of items the server may send before it waits for CREDIT; a
STREAM without it is not flow-controlled (see :mod:`laminar.runtime.rpc.calls`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from laminar.transport import WIRE_CONTEXT, Frame, decode_payload, encode_payload

K_CALL, K_REPLY, K_ERROR, K_NOTIFY, K_STREAM, K_ITEM, K_END, K_CANCEL = range(16, 24)
K_PING, K_PONG, K_CREDIT = 24, 25, 26

#: Requests (calls, streams, notifies) one connection may have running at once; see
#: :class:`laminar.runtime.rpc.calls.Calls`. A stream counts for as long as it is open.
MAX_IN_FLIGHT = 64

#: Stream items a consumer lets the producer send ahead of what it has taken; it grants half a
#: window more each time it has taken half a window.
STREAM_WINDOW = 16

#: Quiet checks per ``peer_timeout`` on the calling side (:mod:`laminar.runtime.rpc.client`): a
#: ping goes
#: out at each of the first ones, the connection is closed at the last, so a healthy peer has two
#: pings' worth of round trips to answer.
PING_CHECKS = 3


def encode_model(model: BaseModel | None) -> tuple[bytes, list[memoryview]]:
    # WIRE_CONTEXT: ``wire_array`` fields come out as typed arrays, sent as one raw buffer. The
    # pydantic-core serializer and validator are called directly: ``model_dump`` and
    # ``model_validate`` wrap them in about as much Python again (docs/benchmarks.md,
    # *Transport*), four times per round trip.
    if model is None:
        return encode_payload(None)
    return encode_payload(model.__pydantic_serializer__.to_python(model, context=WIRE_CONTEXT))


def decode_model(cls: type[BaseModel] | None, frame: Frame) -> Any:
    data = decode_payload(frame.payload, frame.buffers)
    return cls.__pydantic_validator__.validate_python(data) if cls is not None else None
