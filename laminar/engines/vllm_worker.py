"""Methods Laminar adds to every vLLM worker (vLLM's ``worker_extension_cls`` hook).

vLLM runs the model in a worker process behind its engine core; the only way in is
``collective_rpc(method_name, ...)``, which calls a method of the worker. vLLM mixes this class
into its worker class, so ``self`` here is the worker (``self.model_runner`` is vLLM's). Arguments
cross vLLM's msgpack channel, which turns nested tensors into lists; so each tensor travels as
``(name, dtype, shape, raw bytes)`` and is rebuilt here without a copy (``torch.frombuffer``).

vLLM imports this module by dotted name inside its worker process; Laminar modules are imported
inside the methods that need them, so loading the extension stays cheap.

**The engine dies with its rollout.** vLLM runs its engine core in a child process of the rollout
and the model in worker processes below it (on CPU always; on GPUs for tensor parallelism, else
the worker lives in the engine core). A worker notices its engine core's death (vLLM's death
pipe), but nothing in vLLM notices the rollout's: the engine core only talks to it over ZMQ
sockets, which wait forever for a peer to come back. So a rollout killed with -9 (OOM killer,
operator, crash in native code) used to leave its engine core and workers running, holding
gigabytes, re-parented to init. A parent-death signal cannot close that gap from outside:
``PR_SET_PDEATHSIG`` is cleared on fork, must be set by the child itself, and fires when the
*thread* that forked it exits, not the process; and vLLM runs none of our code in its engine core.
This module is the one piece of ours that vLLM loads in its processes (the worker imports it
before it loads the model), so the watch lives here:

* the rollout names itself in ``LAMINAR_ENGINE_OWNER`` (``pid:start time``) before it starts the
  engine (:meth:`laminar.engines.vllm_engine.VllmEngine.start`); vLLM's processes inherit it;
* on import in a process started below that rollout, :func:`watch_owner` records which processes
  belong to the engine (itself, and its ancestors up to the rollout that were started with the same
  value: the engine core) and starts a daemon thread that waits on a pidfd of the rollout;
* when the rollout exits, for any reason, the thread SIGKILLs the engine core and then its own
  process. SIGKILL, not SIGTERM: the engine has lost its only client, so there is no work to save,
  and the engine core's graceful shutdown would first terminate this very worker, taking the
  escalation with it. The GPU driver frees device memory and multiprocessing's resource tracker
  (which outlives them) unlinks their shared-memory queues.

A legitimately running engine is never hit: the rollout is named by pid *and* start time, and the
pidfd is opened before the start time is compared, so a recycled pid reads as "gone" only if the
rollout really is; each victim's start time is checked again right before its kill. A process
whose own environment lacks the value (the rollout itself, any unrelated import) watches nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch


class LaminarWorkerExtension:
    model_runner: Any

    def laminar_load_weights(self, packed: Iterable[tuple[str, str, list[int], bytes]]) -> int:
        """Reload the model in place from HF-named tensors; returns how many were given."""
        items = [(name, unpack_tensor(dtype, shape, raw)) for name, dtype, shape, raw in packed]
        self.model_runner.reload_weights(weights_iterator=iter(items))
        return len(items)

    def laminar_load_shared(self, segment: str, manifest: dict[str, Any]) -> str:
        """Reload from a relay's shared-memory segment, mapped here: the bytes cross no socket.

        Every tensor's CRC is checked before loading. Returns "" once loaded, else why nothing
        was loaded (the segment was evicted meanwhile, or its bytes are corrupt).
        """
        from laminar.transport.shm import SegmentGone
        from laminar.weights.manifest import WeightManifest
        from laminar.weights.tensors import CorruptVersion, map_verified, tensors_from

        version = WeightManifest.model_validate(manifest)
        try:
            view = map_verified(segment, version)
        except (SegmentGone, CorruptVersion) as exc:
            return str(exc)
        self.model_runner.reload_weights(weights_iterator=tensors_from(version, view))
        return ""

    def laminar_export_kv(self, request_ids: list[str], limits: list[int]) -> list[Any]:
        """KV rows of live requests: per id ``(layout, bytes)``, or None where not exportable.

        ``limits[i]`` caps the tokens exported for ``request_ids[i]`` (what the client has seen).
        Runs between engine steps; see :mod:`laminar.engines.vllm_kv`.
        """
        from laminar.engines.vllm_kv import describe, export_blocks

        runner = self.model_runner
        try:
            base = describe(runner)
        except ValueError:  # a cache layout we cannot slice by block: the importer re-prefills
            return [None] * len(request_ids)
        # vLLM appends "-<8 random chars>" to the ids it is given (unless told not to)
        internal = {rid.rsplit("-", 1)[0]: rid for rid in runner.requests}
        internal.update({rid: rid for rid in runner.requests})
        out: list[Any] = []
        for request_id, limit in zip(request_ids, limits, strict=True):
            rid = internal.get(request_id, request_id)
            state = runner.requests.get(rid)
            if state is None or rid not in runner.input_batch.req_id_to_index:
                out.append(None)  # finished, preempted or not yet scheduled
                continue
            tokens = min(int(state.num_computed_tokens), int(limit))
            blocks = -(-tokens // base["block_size"])
            if tokens <= 0 or len(state.block_ids) != 1 or len(state.block_ids[0]) < blocks:
                out.append(None)
                continue
            layout = dict(base, tokens=tokens, blocks=blocks)
            out.append((layout, export_blocks(runner, list(state.block_ids[0][:blocks]))))
        return out

    def laminar_stage_kv(self, key: str, layout: dict[str, Any], data: bytes) -> str:
        """Keep an imported state until the connector loads it; "" if accepted, else why not."""
        from laminar.engines import vllm_kv

        try:
            mine = vllm_kv.describe(self.model_runner)
        except ValueError as exc:
            return str(exc)
        for field in ("block_size", "layers", "row_bytes", "dtype"):
            if layout.get(field) != mine[field]:
                return f"KV layout differs in {field}: {layout.get(field)} != {mine[field]}"
        if len(data) != layout["blocks"] * sum(mine["row_bytes"]):
            return f"KV state has {len(data)} bytes, its layout says otherwise"
        vllm_kv.STAGED[key] = (layout, data)
        return ""

    def laminar_drop_kv(self, key: str) -> bool:
        from laminar.engines import vllm_kv

        return vllm_kv.STAGED.pop(key, None) is not None

    def laminar_kv_loaded(self) -> dict[str, int]:
        """Tokens / requests whose KV the connector loaded instead of computing (since start)."""
        from laminar.engines import vllm_kv

        return dict(vllm_kv.LOADED)

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


# -- dying with the rollout (see the module docstring) --------------------------------------------

OWNER_ENV = "LAMINAR_ENGINE_OWNER"


def _stat(pid: int) -> tuple[str, int, int] | None:
    """``(state, ppid, start time in clock ticks since boot)`` of ``pid``, or None if there is
    no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the name may hold spaces and parentheses
    return fields[0], int(fields[1]), int(fields[19])  # fields 3, 4 and 22 of proc(5)


def owner_token(pid: int | None = None) -> str:
    """``pid:start time``: names one process for good (a recycled pid starts later)."""
    pid = os.getpid() if pid is None else pid
    stat = _stat(pid)
    return f"{pid}:{stat[2] if stat else 0}"


def _started_with(pid: int, token: str) -> bool:
    """Whether ``pid`` was started with ``LAMINAR_ENGINE_OWNER=token`` in its environment."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return f"{OWNER_ENV}={token}".encode() in environ.split(b"\0")


def _alive(pid: int, start: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[2] == start and stat[0] != "Z"


def engine_processes(token: str, owner: int) -> list[tuple[int, int]]:
    """This engine's processes as ``(pid, start time)``, outermost first, this process last: the
    ancestors below the rollout that were started with the same owner value (the engine core,
    when this is a worker process of its own), then this process."""
    chain: list[tuple[int, int]] = []
    pid = os.getppid()
    while pid > 1 and pid != owner and len(chain) < 8 and _started_with(pid, token):
        stat = _stat(pid)
        if stat is None:
            break
        chain.append((pid, stat[2]))
        pid = stat[1]
    me = _stat(os.getpid())
    return [*reversed(chain), (os.getpid(), me[2] if me else 0)]


def _wait_gone(pid: int, start: int) -> None:
    """Block until the process ``pid`` started at ``start`` has exited (at once if it has)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except OSError:  # no pidfds (a kernel before 5.3): poll
        while _alive(pid, start):
            time.sleep(1.0)
        return
    try:
        # Compared after the pidfd is open: if the start time matches, the pidfd is the owner's.
        if _alive(pid, start):
            select.select([fd], [], [])  # readable once that process has exited
    finally:
        os.close(fd)


def _die_with_owner(owner: int, start: int, victims: list[tuple[int, int]]) -> None:
    _wait_gone(owner, start)
    pids = ", ".join(str(pid) for pid, _ in victims)
    with contextlib.suppress(OSError):
        print(
            f"laminar: the rollout (pid {owner}) is gone; killing its vLLM engine (pids {pids})",
            file=sys.stderr,
            flush=True,
        )
    for pid, pid_start in victims:  # the engine core first: this process kills itself last
        if pid == os.getpid():
            os.kill(pid, signal.SIGKILL)
        elif _alive(pid, pid_start):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def watch_owner(environ: dict[str, str] | None = None) -> threading.Thread | None:
    """Start the thread that kills this engine when its rollout exits; None where this process
    is not part of a rollout's engine (no owner value, or this process is the rollout)."""
    token = (os.environ if environ is None else environ).get(OWNER_ENV, "")
    try:
        owner, start = (int(part) for part in token.split(":"))
    except ValueError:
        return None
    if owner == os.getpid():
        return None
    victims = engine_processes(token, owner)
    thread = threading.Thread(
        target=_die_with_owner, args=(owner, start, victims), name="laminar-owner", daemon=True
    )
    thread.start()
    return thread


WATCHDOG = watch_owner()
