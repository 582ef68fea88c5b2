"""What the slow tests share, because starting vLLM is what makes them slow.

On CPU a vLLM engine start is three fresh interpreters importing torch and vLLM (the caller, the
engine core and its worker: vLLM's CPU platform forces ``spawn`` and the multiprocessing
executor), about 25 s of one core each time, while the work most tests then ask of it takes a
few seconds. So:

* one in-process engine serves every module that drives an engine directly
  (``test_vllm_engine``, and ``test_kv_migration`` as both ends of its moves): ``vllm_engine``
  hands it to each module as a fresh engine would be (idle, no output left over from another
  module, the tiny model's own weights as version 0), and it is closed once the last of them is
  done (:class:`SessionEngine`), not at the session's end;
* one process cluster with two vLLM rollouts serves every scenario that needs ``laminar serve``
  rollouts (repack, a data role killed, the weight path, a rollout killed): the module fixture of
  ``test_vllm_cluster``.

Under pytest-xdist (``make test``: ``-n 3 --dist loadgroup``) each fixture's users carry one
``xdist_group`` mark (``vllm-engine``, ``vllm-cluster``), so they run on one worker and the
fixture starts once per suite; the other slow tests go wherever a worker is free.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from tests.support.models import tiny_qwen2
from tests.support.skips import VLLM_REASON

#: the shared engine's settings: what both of its users need (32-token blocks, so a migrated
#: sequence of test_kv_migration spans several; Laminar's KV connector, so that module's moves
#: can import KV state into it; a small fixed KV cache; a small step budget)
ENGINE = {
    "max_model_len": 256,
    "max_num_seqs": 8,
    "kv_cache_bytes": "32MiB",
    "kv_migration": True,
    # one step prefills at most 256 tokens (= max_model_len), so several prompts at once cross it
    "extra": {"block_size": 32, "max_num_batched_tokens": 256},
}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Qwen2 the in-process engine tests run (never written to)."""
    return tiny_qwen2(tmp_path_factory.mktemp("tiny"))


class SessionEngine:
    """The session's in-process engine: started by the first module that asks for it, closed as
    soon as no module left in this session does. Its users run one after the other on one
    worker (``xdist_group("vllm-engine")``), and the suite goes on for minutes after them: idle,
    the engine's processes still hold their memory and take ~2% of a core (~10 CPU-s a run). A
    module that asks again after the close (another distribution than ``loadgroup``) gets a
    fresh start."""

    def __init__(self, model: Path) -> None:
        self.model = model
        self.engine: Any = None
        self.done: set[str] = set()  # the modules that have used it

    async def get(self) -> Any:
        if self.engine is None:
            pytest.importorskip("vllm", reason=VLLM_REASON)
            from laminar.engines import VllmEngineConfig, create_engine

            engine = create_engine(VllmEngineConfig(model=str(self.model), **ENGINE))  # type: ignore[arg-type]
            await engine.start()
            self.engine = engine
        return self.engine

    async def module_done(self, module: str, items: list[pytest.Item]) -> None:
        """``module`` is done with the engine: close it if no module left uses it."""
        self.done.add(module)
        users = {item.module.__name__ for item in items if "vllm_engine" in item.fixturenames}  # type: ignore[attr-defined]
        if users <= self.done:
            await self.close()

    async def close(self) -> None:
        if self.engine is not None:
            engine, self.engine = self.engine, None
            ipc = engine.ipc_dir
            await engine.close()
            # vLLM's socket files went with it, in their own directory (laminar.proc.owned_dirs):
            # a killed engine process cannot unlink its own, so they used to stay in /tmp
            assert ipc is not None and not ipc.exists(), ipc


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def _session_engine(tiny_model: Path) -> AsyncIterator[SessionEngine]:
    shared = SessionEngine(tiny_model)
    yield shared
    await shared.close()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def vllm_engine(_session_engine: SessionEngine, tiny_model: Path, request):  # type: ignore[no-untyped-def]
    """The session's engine, as a module that started its own would find it: nothing in flight,
    no output of another module's requests waiting to be read, and the tiny model's weights as
    version 0 (test_vllm_engine loads others). Its tests run on the session's event loop
    (``pytest.mark.asyncio(loop_scope="session")``), the loop the engine was started on."""
    engine = await _session_engine.get()
    assert engine.in_flight == 0, engine.running_ids()
    while not engine._queue.empty():  # outputs of requests another module moved or aborted
        engine._queue.get_nowait()
    if engine.version != 0:
        import torch
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
        await engine.load_weights(0, model.state_dict().items())
    yield engine
    await _session_engine.module_done(request.module.__name__, request.session.items)
