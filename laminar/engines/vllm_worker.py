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

* the rollout names itself in ``LAMINAR_ENGINE_OWNER`` (``pid:start time``) while it starts the
  engine (:meth:`laminar.engines.vllm_engine.VllmEngine.start`); vLLM's processes inherit it;
* on import in a process started below that rollout, :func:`watch_owner` records which processes
  belong to the engine (itself, and its ancestors strictly between it and the rollout: the engine
  core), walking parent pids up to the process whose pid *and* start time the value names, and
  starts a daemon thread that waits on a pidfd of the rollout (``poll``, not ``select``, which fails
  for fd numbers from 1024 on, and a worker holding a model may well be there);
* when the rollout exits, for any reason, the thread waits :data:`GRACE_S` (1 s): a rollout that
  closed its engine before exiting (a clean shutdown) left it on its way out, and this process
  ends within that second, silently. Otherwise it says so on stderr ("the rollout (pid N) is gone;
  killing its vLLM engine (pids ...)") and SIGKILLs the engine core and then its own process.
  SIGKILL, not SIGTERM: the engine has lost its only client, so there is no work to save, and the
  engine core's graceful shutdown would first terminate this very worker, taking the escalation
  with it. The GPU driver frees device memory and multiprocessing's resource tracker (which
  outlives them) unlinks their shared-memory queues. The engine's directory of socket files
  (``VLLM_RPC_BASE_PATH``, made by the rollout: :mod:`laminar.proc.owned_dirs`) is removed
  first, if it names the rollout watched.

The engine's processes are found by parent pids, never by reading ``/proc/<pid>/environ``: vLLM
calls ``setproctitle``, which overwrites that memory unless ``SPT_NOENV`` is set (the rollout sets
it, but the watch must not depend on it). A legitimately running engine is never hit: the rollout
is named by pid *and* start time, and the pidfd is opened before the start time is compared, so a
recycled pid reads as "gone" only if the rollout really is; each victim's start time is checked
again right before its kill. A process whose own environment lacks the value (the rollout itself,
any unrelated import) watches nothing. The module imports only the standard library and
:mod:`laminar.proc` (``procfs``, ``owned_dirs``) for the watch (``torch`` is vLLM's own import
anyway).
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
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

import laminar.engines.vllm_compat as vllm_compat  # not via the package: it leads back here

from ..proc import owned_dirs, procfs


class LaminarWorkerExtension:
    model_runner: Any

    def laminar_load_weights(self, packed: Iterable[tuple[str, str, list[int], bytes]]) -> int:
        """Reload the model in place from HF-named tensors; returns how many were given."""
        items = [(name, unpack_tensor(dtype, shape, raw)) for name, dtype, shape, raw in packed]
        vllm_compat.reload_weights(self.model_runner, items)
        return len(items)

    def laminar_load_shared(self, segment: str, manifest: dict[str, Any]) -> str:
        """Reload from a relay's shared-memory segment, mapped here: the bytes cross no socket.

        Every tensor's CRC is checked before loading. Returns "" once loaded, else why nothing
        was loaded (the segment was evicted meanwhile, or its bytes are corrupt).
        """
        from laminar.transport.shm import SegmentGone
        from laminar.weights.manifest import WeightManifest
        from laminar.weights.shared import CorruptVersion, map_verified
        from laminar.weights.tensors import tensors_from

        version = WeightManifest.model_validate(manifest)
        try:
            view = map_verified(segment, version)
        except (SegmentGone, CorruptVersion) as exc:
            return str(exc)
        weights = tensors_from(version, view, release=True)
        if vllm_compat.device_type(self.model_runner) == "cuda":
            # Shared memory -> pinned staging -> this GPU, tensor by tensor, on the stream the
            # loaders then use; each TP rank uploads whole tensors and vLLM's weight loaders
            # keep its shard. On CPU the loaders read the shared-memory views themselves.
            weights = staged_to_device(weights, torch.device("cuda", torch.cuda.current_device()))
        vllm_compat.reload_weights(self.model_runner, weights)
        return ""

    def laminar_export_kv(self, request_ids: list[str], limits: list[int]) -> list[Any]:
        """This rank's KV shard of live requests, written into one shared-memory segment this
        worker owns until the engine has mapped it (``laminar_release_kv``): the bytes never
        cross vLLM's RPC channel. Per id ``(layout, (segment, offset, nbytes))``, or None where
        the request is not exportable (finished, preempted, not yet scheduled), or why not (a
        str: a cache layout this code cannot slice).

        ``limits[i]`` caps the tokens exported for ``request_ids[i]`` (what the client has seen).
        Runs between engine steps; see :mod:`laminar.engines.vllm_kv`.
        """
        from laminar.engines.vllm_kv import EXPORTS, describe, export_blocks
        from laminar.transport.shm import SharedBuffer

        runner = self.model_runner
        try:
            base = describe(runner)
        except ValueError as exc:  # a cache layout we cannot slice: the importer re-prefills
            return [f"KV cache not exportable: {exc}"] * len(request_ids)
        internal = vllm_compat.internal_ids(runner)
        found: list[tuple[dict[str, Any], torch.Tensor] | None] = []
        for request_id, limit in zip(request_ids, limits, strict=True):
            state = vllm_compat.scheduled_request(runner, internal.get(request_id, request_id))
            if state is None:
                found.append(None)  # finished, preempted or not yet scheduled
                continue
            computed, block_ids = vllm_compat.computed_blocks(state)
            tokens = min(computed, int(limit))
            blocks = -(-tokens // base["block_size"])
            if tokens <= 0 or len(block_ids) != 1 or len(block_ids[0]) < blocks:
                found.append(None)
                continue
            layout = dict(base, tokens=tokens, blocks=blocks)
            found.append((layout, export_blocks(runner, block_ids[0][:blocks])))
        total = sum(item[1].numel() for item in found if item is not None)
        if total == 0:  # nothing live to export
            return [None] * len(found)
        segment = SharedBuffer(total)
        EXPORTS[segment.name] = segment
        flat = torch.frombuffer(segment.view, dtype=torch.uint8)
        out: list[Any] = []
        offset = 0
        for item in found:
            if item is None:
                out.append(None)
                continue
            layout, data = item
            flat[offset : offset + data.numel()].copy_(data)
            out.append((layout, (segment.name, offset, data.numel())))
            offset += data.numel()
        return out

    def laminar_release_kv(self, segments: list[str]) -> int:
        """Unlink export segments the engine has mapped (its mappings stay valid)."""
        from laminar.engines.vllm_kv import EXPORTS

        released = [EXPORTS.pop(name, None) for name in segments]
        for segment in released:
            if segment is not None:
                segment.close()
        return sum(segment is not None for segment in released)

    def laminar_stage_kv(
        self, key: str, layout: dict[str, Any], segment: str, slices: list[tuple[int, int]]
    ) -> str:
        """Keep an imported state until the connector loads it; "" if accepted, else why not.

        ``slices[r]`` is TP rank r's shard (offset, bytes) in the engine's shared-memory
        ``segment``; this rank maps its own, read-only (the mapping outlives the segment's name).
        """
        import laminar.engines.kv_layouts as kv_layouts
        import laminar.engines.vllm_kv as vllm_kv  # not via the package: it leads back here
        from laminar.transport.frames import FrameError
        from laminar.transport.shm import map_segment

        try:
            mine = vllm_kv.describe(self.model_runner)
        except ValueError as exc:
            return str(exc)
        why = kv_layouts.refusal(layout, mine)
        if why is not None:
            return why
        if len(slices) != mine["tp_size"]:
            return f"KV state has {len(slices)} shards for {mine['tp_size']} TP ranks"
        offset, nbytes = slices[mine["tp_rank"]]
        if nbytes != layout["blocks"] * sum(mine["row_bytes"]):
            return f"KV state has {nbytes} bytes, its layout says otherwise"
        try:
            data = map_segment(segment, int(offset), int(nbytes))
        except FrameError as exc:  # SegmentGone among them
            return f"KV state not readable here: {exc}"
        vllm_kv.STAGED[key] = (layout, data)
        return ""

    def laminar_drop_kv(self, key: str) -> bool:
        import laminar.engines.vllm_kv as vllm_kv  # not via the package: it leads back here

        return vllm_kv.STAGED.pop(key, None) is not None

    def laminar_kv_loaded(self) -> dict[str, int]:
        """Tokens / requests whose KV the connector loaded instead of computing (since start)."""
        import laminar.engines.vllm_kv as vllm_kv  # not via the package: it leads back here

        return dict(vllm_kv.LOADED)

    def laminar_compat(self) -> dict[str, Any]:
        """vLLM's version, and the internals Laminar reads that this worker lacks (see
        :mod:`laminar.engines.vllm_compat`)."""
        import vllm

        version = getattr(vllm, "__version__", None)
        return {
            "version": version,
            "version_problem": vllm_compat.version_problem(version),
            "missing": vllm_compat.missing_internals(self.model_runner),
        }

    def laminar_weight_digest(self) -> str:
        """sha256 over the model's parameters (names sorted), for tests that compare engines."""
        digest = hashlib.sha256()
        model = vllm_compat.model(self.model_runner)
        for name, param in sorted(model.named_parameters()):
            digest.update(name.encode())
            digest.update(param.detach().float().contiguous().cpu().numpy().tobytes())
        return digest.hexdigest()


#: bytes per pinned staging buffer (two of them: one fills while the other's upload runs)
STAGING_BYTES = 32 << 20


def staged_to_device(
    named: Iterable[tuple[str, torch.Tensor]],
    device: torch.device,
    *,
    chunk_bytes: int = STAGING_BYTES,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Host tensors (views of a relay's shared memory) as fresh tensors on ``device``, copied
    through two reused pinned buffers of ``chunk_bytes``: a pageable-to-device copy would stage
    through the driver's own buffer synchronously, and pinning the shared memory itself would
    register gigabytes per version. Chunk k's upload (asynchronous, on the current stream) runs
    while chunk k+1 is copied into the other buffer; a buffer is refilled only once its last
    upload has finished (a CUDA event). Every yielded tensor is its own device allocation: vLLM's
    layerwise reload keeps them until a layer's weights are all in, so none may alias a buffer.
    On a CPU ``device`` (unit tests) the same copies run unpinned and synchronously.
    """
    cuda = device.type == "cuda"
    buffers = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
    events: list[Any] = [None, None]
    turn = 0
    for name, host in named:
        nbytes = host.numel() * host.element_size()
        out = torch.empty(nbytes, dtype=torch.uint8, device=device)
        src = host.detach().contiguous().reshape(-1).view(torch.uint8) if nbytes else None
        for start in range(0, nbytes, chunk_bytes):
            n = min(chunk_bytes, nbytes - start)
            slot, turn = turn, 1 - turn
            if events[slot] is not None:
                events[slot].synchronize()  # its previous upload is done: safe to overwrite
            staging = buffers[slot][:n]
            # ignored below: src is None only when nbytes is 0, and then the loop never runs
            staging.copy_(src[start : start + n])  # type: ignore[index]
            out[start : start + n].copy_(staging, non_blocking=cuda)
            if cuda:
                events[slot] = torch.cuda.Event()
                events[slot].record()
        yield name, out.view(host.dtype).view(host.shape)


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
#: where vLLM binds its ipc:// socket files; the rollout sets it to a directory of the engine's own
IPC_ENV = "VLLM_RPC_BASE_PATH"
#: Seconds between the rollout's exit and the kill: an engine closed by its rollout is gone by then.
GRACE_S = 1.0


def owner_token(pid: int | None = None) -> str:
    """``pid:start time``: names one process for good (a recycled pid starts later)."""
    pid = os.getpid() if pid is None else pid
    stat = procfs.stat(pid)
    return f"{pid}:{stat.start if stat else 0}"


def engine_processes(owner: int, start: int) -> list[tuple[int, int]]:
    """This engine's processes as ``(pid, start time)``, outermost first, this process last.

    The ancestors strictly between this process and the owner (the rollout, ``owner`` started at
    ``start``) are the owner's descendants: the engine core, when this is a worker process of its
    own. Found by parent pids, not by environment: vLLM's ``setproctitle`` may have wiped
    ``/proc/<pid>/environ`` (see :mod:`laminar.proc.procfs`). If the owner is not among the
    ancestors (gone already, this process re-parented), none is taken: only this process."""
    me = procfs.stat(os.getpid())
    mine = (os.getpid(), me.start if me else 0)
    chain: list[tuple[int, int]] = []
    pid = os.getppid()
    while pid > 1 and len(chain) < 8:
        stat = procfs.stat(pid)
        if stat is None:
            break
        if pid == owner:
            return [*reversed(chain), mine] if stat.start == start else [mine]
        chain.append((pid, stat.start))
        pid = stat.ppid
    return [mine]


def _wait_gone(pid: int, start: int) -> None:
    """Block until the process ``pid`` started at ``start`` has exited (at once if it has)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except OSError:  # no pidfds (a kernel before 5.3, a sandbox): poll
        while procfs.alive(pid, start):
            time.sleep(1.0)
        return
    try:
        # Compared after the pidfd is open: if the start time matches, the pidfd is the owner's.
        if procfs.alive(pid, start):
            poller = select.poll()  # not select(): it fails for fd numbers >= 1024
            poller.register(fd, select.POLLIN)
            while not poller.poll():  # readable once that process has exited
                pass
    finally:
        os.close(fd)


def _die_with_owner(
    owner: int, start: int, victims: list[tuple[int, int]], grace: float = GRACE_S
) -> None:
    _wait_gone(owner, start)
    # A rollout that closed its engine before exiting (a clean shutdown) left it on its way out:
    # this process is gone within the grace, and the thread with it, saying nothing. An engine
    # still here after it lost its rollout to a crash or kill -9: said, and killed.
    time.sleep(grace)
    left = [(pid, t) for pid, t in victims if pid == os.getpid() or procfs.alive(pid, t)]
    pids = ", ".join(str(pid) for pid, _ in left)
    with contextlib.suppress(OSError, ValueError):
        print(
            f"laminar: the rollout (pid {owner}) is gone; killing its vLLM engine (pids {pids})",
            file=sys.stderr,
            flush=True,
        )
    ipc = os.environ.get(IPC_ENV, "")
    if owned_dirs.owner(ipc) == (owner, start):  # the rollout's directory for this engine
        owned_dirs.remove(ipc)
    for pid, pid_start in left:  # the engine core first: this process kills itself last
        if pid == os.getpid():
            os.kill(pid, signal.SIGKILL)
        elif procfs.alive(pid, pid_start):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def watch_owner(environ: Mapping[str, str] | None = None) -> threading.Thread | None:
    """Start the thread that kills this engine when its rollout exits; None where this process
    is not part of a rollout's engine (no owner value, or this process is the rollout)."""
    token = (os.environ if environ is None else environ).get(OWNER_ENV, "")
    try:
        owner, start = (int(part) for part in token.split(":"))
    except ValueError:
        return None
    if owner == os.getpid():
        return None
    victims = engine_processes(owner, start)
    thread = threading.Thread(
        target=_die_with_owner, args=(owner, start, victims), name="laminar-owner", daemon=True
    )
    thread.start()
    return thread


def thread_lock_for_progress_bars() -> None:
    """tqdm's bars in this process share a thread lock, not a multiprocessing one.

    vLLM draws tqdm bars in its worker while it loads weights, and tqdm's first bar makes a
    multiprocessing lock: a named semaphore that multiprocessing's resource tracker (the
    rollout's) is told about. Nothing shares it across processes, and the worker never releases
    it: on CPU the rollout kills its engine at close. So the tracker unlinked it when the
    rollout stopped and said so in every rollout's log ("There appear to be 1 leaked semaphore
    objects to clean up at shutdown"). Only engine processes take this (see ``WATCHDOG``)."""
    with contextlib.suppress(ImportError):
        from tqdm import tqdm

        tqdm.set_lock(threading.RLock())


WATCHDOG = watch_owner()
if WATCHDOG is not None:  # a process of a rollout's engine
    thread_lock_for_progress_bars()
    vllm_compat.quiet_expected_reload_warnings()
