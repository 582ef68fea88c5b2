"""A vLLM engine process draws tqdm bars (vLLM's weight loading does) without a multiprocessing
lock (:func:`laminar.engines.vllm_worker.thread_lock_for_progress_bars`): the semaphore tqdm
would make was never released by the killed worker, and every rollout's stop logged "1 leaked
semaphore objects". A fresh interpreter below this test's process plays the engine's process,
this process its rollout; without the owner value the same code registers tqdm's semaphore."""

from __future__ import annotations

import subprocess
import sys

import pytest

from laminar.engines.vllm_worker import OWNER_ENV, owner_token
from tests.support.procs import ROOT, env

ENGINE_PROCESS = """
import multiprocessing, sys
from multiprocessing import resource_tracker
multiprocessing.set_start_method("spawn")  # as in vLLM's processes: named semaphores
kinds = []
register = resource_tracker.register
resource_tracker.register = lambda name, rtype: (kinds.append(rtype), register(name, rtype))
from laminar.engines import vllm_worker
from tqdm import tqdm
for _ in tqdm(range(3), file=sys.stdout):
    pass
print("watching" if vllm_worker.WATCHDOG is not None else "not watching")
print("semaphores", kinds.count("semaphore"))
"""


@pytest.mark.parametrize("owned", [True, False], ids=["engine-process", "any-other"])
def test_an_engine_process_draws_progress_bars_without_a_semaphore(owned: bool) -> None:
    extra = {OWNER_ENV: owner_token()} if owned else {}
    done = subprocess.run(
        [sys.executable, "-c", ENGINE_PROCESS], cwd=ROOT, env=env(**extra),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    if owned:
        assert "watching" in done.stdout.splitlines(), done.stdout
        assert "semaphores 0" in done.stdout, done.stdout
        assert "leaked semaphore" not in done.stderr, done.stderr
    else:
        assert "not watching" in done.stdout and "semaphores 1" in done.stdout, done.stdout
