"""Number lists as raw buffers: token ids and logprobs leave msgpack on the wire.

Why: msgpack spends about 5 bytes on a token id and 9 on a float, and everything inside it counts
against the small ``max_payload_bytes`` limit (the part a receiver must hold whole before it can
decode anything). A batch of a few million tokens would not fit, however large the frame limit.
As int32/float32 in one raw buffer beside the payload they cost 4 bytes each, are received straight
into their final memory (``recv_into``), and are bounded only by the frame limit.

How, without changing what the message models look like: a field declared
``Annotated[list[int], wire_array("int32")]`` is still a plain ``list[int]`` everywhere, including
``model_dump()``. Only when the RPC codec dumps a model with :data:`WIRE_CONTEXT` does the field
turn into a :class:`PackedArray`; :func:`laminar.transport.frames.encode_payload` writes every
PackedArray of a frame into *one* shared pool buffer (so a reply of 10,000 trajectories still has
one buffer, far under ``max_buffers``) and leaves a small extension reference (dtype, offset,
count) in the payload. Decoding turns a reference back into a list, which the model validates as
before. Lists shorter than :data:`MIN_PACKED` stay in msgpack: a buffer is not worth it.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

#: msgpack extension code for "a typed array in this frame's pool buffer" (1 is a plain Blob).
EXT_ARRAY = 2
#: Context key the RPC codec sets on ``model_dump`` to ask for packed arrays.
WIRE_CONTEXT: dict[str, Any] = {"laminar.wire": True}
#: Shorter lists stay inside msgpack.
MIN_PACKED = 16

_DTYPES: dict[int, np.dtype[Any]] = {
    1: np.dtype("<i4"),
    2: np.dtype("<f4"),
    3: np.dtype("<i8"),
    4: np.dtype("<f8"),
}
_CODES = {dtype: code for code, dtype in _DTYPES.items()}
_REF = struct.Struct("!BQQ")  # dtype code, byte offset in the pool, element count
_ALIGN = 8


class ArrayEncodeError(ValueError):
    """A list cannot be written as its declared dtype (a token id that does not fit int32)."""


class PackedArray:
    """A list on its way out as a typed array; only the RPC codec ever sees one."""

    __slots__ = ("dtype", "values")

    def __init__(self, values: list[Any], dtype: np.dtype[Any]) -> None:
        self.values = values
        self.dtype = dtype


def wire_array(dtype: str) -> Any:
    """The annotation that sends a ``list[int]`` / ``list[float]`` field as a raw typed array.

    ``dtype`` is one of int32, float32, int64, float64 (little-endian on the wire).
    """
    resolved = np.dtype(dtype).newbyteorder("<")
    if resolved not in _CODES:
        raise ValueError(f"wire_array supports {sorted(str(d) for d in _DTYPES.values())}")
    return _WireArray(resolved)


class _WireArray:
    """Pydantic metadata: validation and JSON schema stay the list's; only the RPC dump differs."""

    def __init__(self, dtype: np.dtype[Any]) -> None:
        self.dtype = dtype

    def _serialize(self, value: Any, nxt: Any, info: Any) -> Any:
        context = info.context
        if (
            info.mode == "python"
            and isinstance(context, dict)
            and context.get("laminar.wire")
            and isinstance(value, list)
            and len(value) >= MIN_PACKED
        ):
            return PackedArray(value, self.dtype)
        return nxt(value)

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> Any:
        from pydantic_core import core_schema

        schema = handler(source)
        plain = {k: v for k, v in schema.items() if k != "serialization"}
        return {
            **schema,
            "serialization": core_schema.wrap_serializer_function_ser_schema(
                self._serialize, info_arg=True, schema=plain
            ),
        }

    def __get_pydantic_json_schema__(self, schema: Any, handler: Any) -> Any:
        return handler({k: v for k, v in schema.items() if k != "serialization"})


class ArrayPool:
    """The packed arrays of one frame, collected while msgpack runs, then written as one buffer."""

    def __init__(self) -> None:
        self._parts: list[tuple[int, PackedArray]] = []
        self._size = 0

    def __bool__(self) -> bool:
        return bool(self._parts)

    def reference(self, array: PackedArray) -> Any:
        """The msgpack extension that stands for ``array`` (its bytes are written by build())."""
        import msgpack

        offset = -(-self._size // _ALIGN) * _ALIGN
        count = len(array.values)
        self._parts.append((offset, array))
        self._size = offset + count * array.dtype.itemsize
        return msgpack.ExtType(EXT_ARRAY, _REF.pack(_CODES[array.dtype], offset, count))

    def build(self) -> memoryview:
        """The pool buffer: every referenced array at its offset, converted once."""
        pool = np.empty(self._size, dtype=np.uint8)
        for offset, array in self._parts:
            count = len(array.values)
            try:
                converted = np.fromiter(array.values, dtype=array.dtype, count=count)
            except (OverflowError, TypeError, ValueError) as exc:
                raise ArrayEncodeError(
                    f"a list of {count} values cannot be sent as {array.dtype.name}: {exc}"
                ) from exc
            pool[offset : offset + converted.nbytes] = converted.view(np.uint8)
        return pool.data


def decode_array(data: bytes, pool: memoryview | None) -> list[Any]:
    """The list an :data:`EXT_ARRAY` reference stands for; ValueError if it points outside."""
    if len(data) != _REF.size:
        raise ValueError(f"array reference of {len(data)} bytes")
    code, offset, count = _REF.unpack(data)
    dtype = _DTYPES.get(code)
    if dtype is None:
        raise ValueError(f"unknown array dtype code {code}")
    if pool is None:
        raise ValueError("payload refers to an array, frame has no buffers")
    if offset + count * dtype.itemsize > pool.nbytes:
        raise ValueError(
            f"array of {count} x {dtype.name} at offset {offset} runs past the "
            f"{pool.nbytes}-byte pool"
        )
    values: list[Any] = np.frombuffer(pool, dtype=dtype, count=count, offset=offset).tolist()
    return values
