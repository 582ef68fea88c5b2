"""The rollout hands its engine the owner value only while the engine starts.

``LAMINAR_ENGINE_OWNER`` (:mod:`laminar.engines.vllm_worker`) is how vLLM's engine core and worker
know the rollout to die with; the kill -9 itself, with real processes, is scenario 4 of
``tests/slow/test_vllm_cluster.py``.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.support.skips import skip_without_vllm

skip_without_vllm()

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


async def test_the_owner_value_is_set_only_while_the_engine_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``LAMINAR_ENGINE_OWNER`` is there while ``AsyncLLM.from_engine_args`` starts the engine
    core (which the workers inherit from), then the previous value (or none) is back: nothing
    the rollout starts later takes it for its engine's owner. ``SPT_NOENV`` is set for vLLM.

    Likewise ``VLLM_RPC_BASE_PATH``: each start's own directory for vLLM's socket files
    (``laminar.proc.owned_dirs``), which vLLM reads through its environment cache (the second
    start's cache is on: the first start turned it on), and which ``close`` removes."""
    from vllm import envs
    from vllm.v1.engine.async_llm import AsyncLLM

    from laminar.engines.configs import VllmEngineConfig
    from laminar.engines.vllm_engine import VllmEngine
    from laminar.engines.vllm_worker import IPC_ENV, OWNER_ENV, owner_token
    from laminar.proc import owned_dirs

    seen: list[tuple[str | None, str | None]] = []
    ipc: list[tuple[str | None, str]] = []  # the environment's, vLLM's own reading

    def from_engine_args(*args: Any, **kwargs: Any) -> Any:
        seen.append((os.environ.get(OWNER_ENV), os.environ.get("SPT_NOENV")))
        ipc.append((os.environ.get(IPC_ENV), envs.VLLM_RPC_BASE_PATH))
        # what the engine reads back after the start: its resolved limits
        model_config = SimpleNamespace(max_model_len=64, get_vocab_size=lambda: 32)

        async def collective_rpc(method: str, *a: Any, **k: Any) -> list[dict[str, Any]]:
            assert method == "laminar_compat"  # the one worker call a start makes
            return [{"version": "0.32.0", "version_problem": None, "missing": []}]

        return SimpleNamespace(
            shutdown=lambda **_: None, model_config=model_config, collective_rpc=collective_rpc
        )

    monkeypatch.setattr(AsyncLLM, "from_engine_args", from_engine_args)
    config = VllmEngineConfig(model=str(tmp_path), warmup=False, kv_cache_bytes="32MiB")
    monkeypatch.delenv(OWNER_ENV, raising=False)
    monkeypatch.delenv(IPC_ENV, raising=False)
    first = VllmEngine(config)
    await first.start()
    assert OWNER_ENV not in os.environ and IPC_ENV not in os.environ
    monkeypatch.setenv(OWNER_ENV, "an outer engine's")
    second = VllmEngine(config)
    await second.start()
    assert os.environ[OWNER_ENV] == "an outer engine's"
    assert seen == [(owner_token(), "1")] * 2

    dirs = [first.ipc_dir, second.ipc_dir]
    assert ipc == [(str(d), str(d)) for d in dirs], ipc
    pid, start = (int(part) for part in owner_token().split(":"))
    for d in dirs:
        assert d is not None and d.is_dir() and owned_dirs.owner(d) == (pid, start), d
        assert d.stat().st_mode & 0o777 == 0o700
    assert dirs[0] != dirs[1]
    for engine in (first, second):
        await engine.close()
    assert not any(d.exists() for d in dirs if d is not None), dirs


def test_an_engine_started_without_the_rollout_gets_a_socket_directory_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``start_async_llm``, as the benchmarks' bare vLLM starts (each such start left 7 socket
    files in ``/tmp``): vLLM reads a directory of this process's own while it starts, the caller
    gets it to remove after the shutdown, and a start that fails removes it itself."""
    import tempfile

    from vllm import envs
    from vllm.v1.engine.async_llm import AsyncLLM

    from laminar.engines.vllm_engine import start_async_llm
    from laminar.engines.vllm_worker import IPC_ENV
    from laminar.proc import owned_dirs

    seen: list[tuple[str | None, str]] = []

    def from_engine_args(args: Any, **kwargs: Any) -> Any:
        seen.append((os.environ.get(IPC_ENV), envs.VLLM_RPC_BASE_PATH))
        if args == "refused":
            raise RuntimeError("less than requested memory for kv")
        return SimpleNamespace(args=args, kwargs=kwargs)

    def ours() -> set[Path]:
        return {
            p for p in Path(tempfile.gettempdir()).iterdir() if owned_dirs.owner(p) is not None
            and owned_dirs.owner(p)[0] == os.getpid()  # type: ignore[index]
        }  # fmt: skip

    monkeypatch.setattr(AsyncLLM, "from_engine_args", from_engine_args)
    monkeypatch.delenv(IPC_ENV, raising=False)
    before = ours()
    llm, ipc = start_async_llm("args", stat_loggers=[])
    assert (llm.args, llm.kwargs) == ("args", {"stat_loggers": []})
    assert seen == [(str(ipc), str(ipc))] and IPC_ENV not in os.environ
    assert ipc.is_dir() and ipc.stat().st_mode & 0o777 == 0o700 and ours() - before == {ipc}
    owned_dirs.remove(ipc)

    with pytest.raises(RuntimeError, match="requested memory"):
        start_async_llm("refused")
    assert len(seen) == 2 and seen[1][0] is not None and seen[1][0] != str(ipc)
    assert ours() == before and IPC_ENV not in os.environ
