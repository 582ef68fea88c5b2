"""``laminar simulate run``: a user's config, every role's real code, on virtual time.

The shipped example runs from the CLI at two rollout counts and prints its table; the figures are
the capacity planner's (more rollouts: more trained tokens/s, a busier trainer); a config whose
roles have no cost model (a vLLM rollout, the torch trainer) is refused with the reason, before
anything starts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import structlog

from laminar.cli import main
from laminar.runtime.config import ConfigError, load_config
from laminar.simulate.cluster import check_simulatable, with_schedule

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples/simulate/cluster.yaml"


@pytest.fixture(autouse=True)
def logging_restored():  # type: ignore[no-untyped-def]
    """The CLI configures structlog for its process, to this test's captured stderr (closed
    after it): the next test in this worker must get the configuration it had."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def test_the_example_answers_how_many_rollouts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)  # the example's paths are relative to the repository
    out = tmp_path / "rows.json"
    argv = ["simulate", "run", "--config", str(EXAMPLE), "--rollouts", "2,4"]
    # 25 s measured after 5 of warm-up (virtual time; the simulator is deterministic under its
    # seed): 4 and 10 versions, 1.93x the trained tokens/s (2026-11-28; 40 after 10 read 2.17x
    # for twice the CPU)
    argv += ["--duration", "25", "--warmup", "5", "--json", str(out)]
    argv += ["--set", "sim_trainer.batch.prompts=16"]  # 64 trajectories: several per run
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "trained tok/s" in table and "trainer busy" in table
    two, four = json.loads(out.read_text())
    assert (two["rollouts"], four["rollouts"]) == (2, 4)
    assert two["schedule"] == four["schedule"] == "laminar"
    # rollout-bound at these counts: twice the rollouts, about twice the trained tokens/s
    assert 1.5 < four["trained_tokens_per_s"] / two["trained_tokens_per_s"] < 2.5
    assert four["trainer_busy"] > two["trainer_busy"]
    assert two["versions"] >= 3 and four["staleness_max"] >= 1


def test_roles_without_a_cost_model_are_refused(tmp_path: Path) -> None:
    text = EXAMPLE.read_text()
    vllm = tmp_path / "vllm.yaml"
    vllm.write_text(text.replace("backend: sim", "backend: vllm"))
    with pytest.raises(ConfigError, match=r"rollout-0: engine\.backend 'vllm' runs a model"):
        check_simulatable(load_config(vllm))
    torch = tmp_path / "torch.yaml"
    torch.write_text(text.replace("- role: sim_trainer", "- role: trainer"))
    with pytest.raises(ConfigError, match="simulate with role sim_trainer"):
        check_simulatable(load_config(torch))
    with pytest.raises(ConfigError, match="'synchronous': Input should be 'laminar'"):
        with_schedule(load_config(EXAMPLE), "synchronous")
