"""Methods Laminar adds to every vLLM worker (vLLM's ``worker_extension_cls`` hook).

vLLM runs the model in a worker process behind its engine core; the only way in is
``collective_rpc(method_name, ...)``, which calls a method of the worker. vLLM mixes this class
into its worker class, so ``self`` here is the worker (``self.model_runner`` is vLLM's). Arguments
cross vLLM's msgpack channel, which turns nested tensors into lists; so each tensor travels as
``(name, dtype, shape, raw bytes)`` and is rebuilt here without a copy (``torch.frombuffer``).

Kept free of Laminar imports: it is imported inside vLLM's worker process by dotted name.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import re
import warnings
import zlib
from collections.abc import Iterable
from typing import Any

import torch

SEGMENT_GONE = "<segment gone>"
_SEGMENT = re.compile(r"^laminar-[0-9a-f]{8}-[0-9a-f]{24}$")


class LaminarWorkerExtension:
    model_runner: Any

    def laminar_load_weights(self, packed: Iterable[tuple[str, str, list[int], bytes]]) -> int:
        """Reload the model in place from HF-named tensors; returns how many were given."""
        items = [(name, unpack_tensor(dtype, shape, raw)) for name, dtype, shape, raw in packed]
        self.model_runner.reload_weights(weights_iterator=iter(items))
        return len(items)

    def laminar_load_shared(self, segment: str, entries: list[list[Any]]) -> list[str]:
        """Reload from a relay's shared-memory segment, mapped here: the bytes cross no socket.

        ``entries`` are ``[name, dtype, shape, offset, nbytes, crc32]``. Every tensor's CRC is
        checked before loading; returns the names that failed (nothing is loaded then).
        """
        if not _SEGMENT.match(segment):
            raise ValueError(f"refusing to map {segment!r}")
        try:
            with open(os.path.join("/dev/shm", segment), "rb") as f:
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:  # the relay evicted it meanwhile: the caller asks again
            return [SEGMENT_GONE]
        view = memoryview(mapped)
        bad = [e[0] for e in entries if zlib.crc32(view[e[3] : e[3] + e[4]]) != e[5]]
        if bad:
            return bad
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a read-only buffer: loaders only read
            items = [
                (
                    name,
                    torch.frombuffer(view[off : off + n], dtype=getattr(torch, dtype)).reshape(
                        shape
                    )
                    if n
                    else torch.empty(shape, dtype=getattr(torch, dtype)),
                )
                for name, dtype, shape, off, n, _ in entries
            ]
            self.model_runner.reload_weights(weights_iterator=iter(items))
        return []

    def laminar_weight_digest(self) -> str:
        """sha256 over the model's parameters (names sorted), for tests that compare engines."""
        digest = hashlib.sha256()
        model = self.model_runner.get_model()
        for name, param in sorted(model.named_parameters()):
            digest.update(name.encode())
            digest.update(param.detach().float().contiguous().cpu().numpy().tobytes())
        return digest.hexdigest()


def pack_tensor(name: str, tensor: torch.Tensor) -> tuple[str, str, list[int], bytes]:
    t = tensor.detach().contiguous().cpu()
    raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return name, str(t.dtype).removeprefix("torch."), list(t.shape), raw


def unpack_tensor(dtype: str, shape: list[int], raw: bytes) -> torch.Tensor:
    torch_dtype = getattr(torch, dtype)
    if not raw:
        return torch.empty(shape, dtype=torch_dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch_dtype).reshape(shape)
