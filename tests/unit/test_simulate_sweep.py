"""``laminar simulate sweep``: the figures the issue asks for are there, and the figure draws.

A reduced sweep (7B at its smallest and largest scales, two systems, one warm-up and one measured
update per cell) through the CLI: the JSON carries the
per-cell throughputs, Laminar's speedup over each baseline (average and maximum),
``laminar_over_verl_max`` and the strong-scaling efficiency by the paper's definition, and a PNG
is written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from laminar.cli import main
from laminar.simulate.workload import SCALES


def test_a_reduced_sweep_writes_its_figures_and_plot(tmp_path: Path) -> None:
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    argv = ["simulate", "sweep", "--models", "7B", "--systems", "verl,laminar"]
    argv += ["--gpus", "16,256", "--warmup", "1", "--measured", "1"]
    assert main([*argv, "--json", str(out), "--plot", str(png)]) == 0
    result = json.loads(out.read_text())
    cells = result["cells"]["7B"]
    assert [SCALES["7B"][0], SCALES["7B"][-1]] == [16, 256]
    assert sorted(cells, key=int) == ["16", "256"]
    for row in cells.values():
        assert row["laminar"]["tokens_per_s"] > 0 and row["verl"]["tokens_per_s"] > 0
    ratios = [
        row["laminar"]["tokens_per_s"] / row["verl"]["tokens_per_s"] for row in cells.values()
    ]
    assert result["laminar_over_verl_max"] == max(ratios)
    assert result["avg_speedup"]["verl"] == sum(ratios) / len(ratios)
    low, high = cells["16"]["laminar"]["tokens_per_s"], cells["256"]["laminar"]["tokens_per_s"]
    assert result["scaling_efficiency"]["7B"] == (high / low) / (256 / 16)
    assert png.stat().st_size > 10_000


def test_one_cell_from_the_cli(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["simulate", "cell", "--system", "laminar", "--model", "72B", "--gpus", "64"]) == 0
    cell = json.loads(capsys.readouterr().out)
    assert cell["train_gpus"] == 32 and cell["rollout_gpus"] == 32 and cell["tokens_per_s"] > 0


def test_a_scale_not_in_table_2_is_a_clear_error(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["simulate", "sweep", "--models", "7B", "--gpus", "16,48"]) == 2
    err = capsys.readouterr().err
    assert "7B has no Table 2 scale of [48] GPUs; its scales: 16, 32, 64, 128, 256" in err, err


def test_counts_that_are_not_whole_numbers_are_a_usage_error(capsys) -> None:  # type: ignore[no-untyped-def]
    for argv in (["sweep", "--gpus", "16,x"], ["run", "--config", "c.yaml", "--rollouts", "0,2"]):
        with pytest.raises(SystemExit) as exit_:
            main(["simulate", *argv])
        assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "not comma-separated whole numbers: '16,x'" in err, err
    assert "counts must be at least 1: '0,2'" in err, err
