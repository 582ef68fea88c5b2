"""A vLLM rollout whose engine refuses its model ends ``laminar run`` with the engine's reason.

The model: a tiny random Llama whose head size (40) vLLM's CPU attention does not support. The
engine starts, and its first step (the rollout's warm-up, before it is ready) fails in vLLM's
worker with ``RuntimeError: Unsupported CPU attention configuration: head_dim=40 ...``, which
reaches the rollout's output under the engine core's and the rollout's own tracebacks (each only
pointing above). The supervisor must say the worker's line beside the rollout's exit status,
restart it once, and end the run at its second identical failure, with status 1, long before its
budget, and leave none of the run's processes (vLLM's engine core and worker included) behind.
Two vLLM starts: the one slow test of this behaviour (``tests/integration/test_run_failures.py``
has the fast ones, on a role that fails on purpose).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.failed_runs import ended, launched, said
from tests.support.models import tiny_model
from tests.support.skips import skip_without_vllm

skip_without_vllm()

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

#: A bound on a hang (two vLLM starts, maybe beside the suite's other vLLM tests), not a timing
#: check.
ENDS_S = 600.0


def test_a_rollout_whose_engine_refuses_the_model_ends_the_run_with_the_engines_reason(
    tmp_path: Path,
) -> None:
    model = tiny_model(tmp_path / "model", "llama", head_dim=40)
    engine = {
        "backend": "vllm",
        "model": str(model),
        "max_model_len": 256,
        "max_num_seqs": 4,
        "kv_cache_bytes": "32MiB",
    }
    rollout = {"role": "rollout", "config": {"metrics": None, "engine": engine}}
    with launched(tmp_path, [rollout]) as run:
        out = ended(run, ENDS_S)
    assert run.returncode == 1, out
    lines = said(out)
    reason = r"code 1: RuntimeError: Unsupported CPU attention configuration: head_dim=40\b[^;]*"
    exits = [line for line in lines if line.startswith("rollout-0 exited")]
    assert len(exits) == 2, out
    assert re.fullmatch(rf"rollout-0 exited with {reason}; restarting \(1/3\)", exits[0]), out
    assert re.fullmatch(
        rf"rollout-0 exited with {reason}; not restarting: it failed the same way twice in a "
        r"row, before it was ready \(a restart would fail again\)",
        exits[1],
    ), out
    assert "ending the run: rollout-0 fails the same way at every start" in lines, out
    assert re.fullmatch(rf"rollout-0 ended dead: exited with {reason}", lines[-2]), out
    assert lines[-1] == "run failed (exit status 1): rollout-0 fails the same way at every start"
