"""One process cluster with two vLLM rollouts, through the scenarios that need real engines.

Manager + ``rollout-0`` + ``rollout-1`` (``laminar serve`` processes, a tiny random Qwen2, fp32,
``kv_migration`` on, the KV cache the derived default in bytes) start once for this module: a
vLLM start is three interpreters importing torch and vLLM, about 35 s of CPU each time, and it
was most of what these scenarios cost when each started its own cluster (four clusters, eight
engine starts; a fifth, in a test of its own, checked a start on a small NUMA node 0 until
2026-11-24).
Each test brings the members its scenario needs (its own data role and store, a relay, a
trainer) and stops them when it ends, so the rollouts are what the tests share, the way a
long-lived rollout fleet outlives the tasks fed to it. The tests run in the order written (one
xdist group, one worker); each also runs alone (``-k``), on a cluster of its own.

0. **A rollout on a small NUMA node** (issue 14: on a fresh machine whose node 0 held 9.5 of its
   23 GiB, vLLM sized its KV cache as a share of the node minus its own RSS, a negative request,
   and refused to start): ``rollout-1`` runs in a mount namespace in which node 0 holds 2 GiB
   (``tests.support.small_node``; where the suite runs as root). vLLM read that node, set aside
   the bytes our sizing derived, and the rollout generates (and is the destination of 1).
1. **Repack with KV migration** (greedy, version 0): ``rollout-1`` is drained (it takes nothing),
   ``rollout-0`` takes prompts; once a sequence is decoding its engine is frozen (SIGSTOP to
   vLLM's engine core), it is drained and migrates everything in flight to ``rollout-1``. The
   move carries KV state; each moved trajectory finishes on ``rollout-1`` with version 0 and
   exactly the tokens transformers' greedy decoding gives; nothing is lost or duplicated.
2. **A kill -9 of the data role** mid-run (the example task's prompts and reward, 32 x 4): every
   trajectory arrives exactly once, scored by the task's reward, with its version and one
   behaviour logprob per token; no completed trajectory and no acknowledged partial token is lost.
3. **The weight path**: a relay and the torch trainer join; after the trainer publishes version v,
   each rollout's next trajectories carry v and the weights it loaded carry the trainer's
   checksums.
4. **A rollout killed with -9 takes its engine along**: every process it started (vLLM's engine
   core, its worker, multiprocessing's resource tracker) is gone within a bound, the engine core
   among those the rollout's watch names as killed (``laminar.engines.vllm_worker``). Before
   that watch they were re-parented to init and lived on, holding gigabytes. Also: they keep the
   cluster's mark in ``/proc`` although vLLM sets their titles (``SPT_NOENV``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from laminar.engines.vllm_worker import IPC_ENV
from laminar.harness.launch import ProcessCluster
from laminar.proc import owned_dirs, procfs
from laminar.roles.data.api import DataApi, SampleRequest
from laminar.roles.rollout import MigrateReport, MigrateRequest, RolloutApi
from laminar.roles.rollout.api import DrainRequest
from laminar.runtime.errors import CallTimeout
from tests.integration.test_rl_loop import (
    Clients,
    check_rollouts_follow,
    loop_config,
    wait_caught_up,
    wait_trained,
)
from tests.support.models import tiny_qwen2
from tests.support.poll import until
from tests.support.procs import ROOT, threads_nice
from tests.support.scenario import kill_data_midway, process_cluster, write_config
from tests.support.skips import skip_without_vllm
from tests.support.small_node import KV_LINE, SMALL, can_unshare, namespace_prefix
from tests.support.task import write_prompts, write_tokenizer

skip_without_vllm()
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.integration,
    pytest.mark.timeout(420),
    pytest.mark.xdist_group("vllm-cluster"),  # one worker: the module's cluster starts once
]

ROLLOUTS = ("rollout-0", "rollout-1")
ARITH = ROOT / "examples" / "arith"
#: the arith task's tokenizer has 80 ids; the tests' own (tests.support.task) fewer
VOCAB = 80


def _engine(model: Path) -> dict[str, Any]:
    return {
        "backend": "vllm",
        "model": str(model),
        "max_model_len": 512,
        "max_num_seqs": 8,  # no kv_cache_bytes: the derived default (rollout-1's small node)
        "kv_migration": True,
        "stream_interval": 1,
        "seed": 0,
    }


#: Heartbeats that a loaded machine keeps up with. These tests do not time failure detection, and
#: with the tests' usual 2 s timeout the migration test beside two busy loops had members marked
#: dead (and revived) five times in 30 s, the data role releasing the leases of each "dead"
#: rollout. Two such deaths in a row while a trajectory's holders acknowledged none of its tokens
#: quarantine it (``quarantine_after``): the likely end of a fresh-clone CI run that finished 95
#: of 96 trajectories, one counted failed (its members' logs were not kept; the test now prints
#: these lines when a count is off). Calls get 30 s: in a fresh-clone CI run (2026-11-24) a
#: ``state`` call to the source, an endpoint that awaits nothing, went unanswered for 10 s while
#: the data role started beside the SFT test's two processes and two other vLLM engines starting:
#: most likely its loop got no CPU for that long (the members' logs were not kept). A call that
#: would answer is not a failure these tests look for.
CLUSTER = {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 10.0, "rpc_timeout_s": 30.0}
#: the fleet's own members (the manager, the rollouts) give way (laminar.proc.placement; off by
#: default); the members a test adds do not
FLEET_CLUSTER = {**CLUSTER, "nice": 10}


@dataclass
class Fleet:
    """The module's cluster: the manager and the two rollouts, and the model they run."""

    cluster: ProcessCluster
    model: Path
    engine: dict[str, Any]
    small_node: bool  # rollout-1 runs on a small node (tests.support.small_node)

    def config(self, tmp: Path, sections: dict[str, Any]) -> Path:
        """A config for the members a test adds: its sections, plus the rollouts' own."""
        return write_config(tmp, {"cluster": CLUSTER, "rollout": _rollout(self.engine), **sections})

    def greedy_data(self, tmp: Path, prompts: int, samples: int, max_tokens: int) -> Path:
        """A config whose data role serves ``prompts`` of the tests' prompts x ``samples``, each
        once, greedy, every response ``max_tokens`` long (``ignore_eos``)."""
        data = {
            "prompts": str(write_prompts(tmp / "prompts.jsonl", prompts)),
            "tokenizer": str(write_tokenizer(tmp / "tok")),
            "reward": "tests.support.task:reward_len",
            "samples_per_prompt": samples,
            "epochs": 1,
            "sampling": {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True},
            "store": str(tmp / "data.sqlite"),
            "metrics": None,
        }
        return self.config(tmp, {"data": data})


def _rollout(engine: dict[str, Any]) -> dict[str, Any]:
    return {
        "metrics": None,
        "concurrency": CONCURRENCY,
        "flush_interval_s": FLUSH_S,
        "take_wait_s": 0.5,
        "engine": engine,
    }


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("fleet")
    model = tiny_qwen2(tmp / "model", vocab=VOCAB)
    engine = _engine(model)
    fleet = Fleet(
        process_cluster(
            tmp, write_config(tmp, {"cluster": FLEET_CLUSTER, "rollout": _rollout(engine)})
        ),
        model,
        engine,
        small_node=can_unshare(),
    )
    small = namespace_prefix(tmp / "small-node") if fleet.small_node else ()
    try:
        fleet.cluster.serve("manager", "manager")
        # one after another: two vLLM 0.32 CPU engines that initialised at the same moment left
        # one hung after its KV cache set-up (tests/integration/test_rl_loop.start_loop)
        fleet.cluster.serve("rollout", ROLLOUTS[0], timeout=300)
        fleet.cluster.serve("rollout", ROLLOUTS[1], timeout=300, prefix=small)
        yield fleet
    finally:
        fleet.cluster.shutdown()


def _stop(cluster: ProcessCluster, *names: str) -> None:
    for name in names:
        if name in cluster.procs:
            cluster.stop(name)


# -- 0. a rollout on a small NUMA node ------------------------------------------------------------


async def test_vllm_rollout_on_a_small_node_sizes_its_cache_in_bytes(
    tmp_path: Path, fleet: Fleet
) -> None:
    if not fleet.small_node:
        pytest.skip("needs root and unshare(1) to give a rollout a small node")
    from laminar.engines import VllmEngineConfig
    from laminar.engines.kvcache import rollout_kv_bytes

    log = fleet.cluster.log_tail(ROLLOUTS[1], 1_000_000)
    seen = KV_LINE.search(log)
    assert seen is not None, log[-3000:]
    cache_gib, node_gib = float(seen.group(1)), float(seen.group(2))
    # what vLLM read as the node's total is the small node's, so the namespace took effect
    assert node_gib == pytest.approx(SMALL["MemTotal"] / (1 << 20), abs=0.05), seen[0]
    # and the cache is the bytes derived from the rollout's needs (not a share of the node)
    derived = rollout_kv_bytes(VllmEngineConfig(**fleet.engine)) / (1 << 30)
    assert cache_gib == pytest.approx(derived, abs=0.01), (seen[0], derived)

    # it generates: four trajectories, the other rollout drained so this one takes them all
    config = fleet.greedy_data(tmp_path, prompts=2, samples=2, max_tokens=16)
    clients = Clients(fleet.cluster)
    other = clients.proxy(RolloutApi, ROLLOUTS[0])
    try:
        await other.drain.call(DrainRequest(reason="the small node's rollout takes everything"))
        fleet.cluster.serve("data", "data", config=config)
        data = clients.proxy(DataApi, "data")
        status = await until(lambda: _finished(data), timeout=120, interval=0.2)
        assert status.trajectories == 4, status
        done = (await data.sample.call(SampleRequest(n=4))).items
    finally:
        await other.resume.call()
        await clients.close()
        _stop(fleet.cluster, "data")
    assert {t.rollout for t in done} == {ROLLOUTS[1]}
    assert all(len(t.response_token_ids) == 16 for t in done)


# -- 1. repack with KV migration -----------------------------------------------------------------

CONCURRENCY = 8
# Every response runs its full length (ignore_eos): a frozen sequence is never one that stopped.
#: 32 sequences, four times what one rollout runs at once (``concurrency`` 8). Until a move, the
#: destination is drained and the source takes them all, 8 at a time: a try that found nothing to
#: move (see the test) resumes the source, which takes the next 8, so there is work for
#: ``PROMPTS * SAMPLES / CONCURRENCY`` tries. After the move the rest is only waited for: with
#: 64 sequences (until 2026-11-29) this test took 82 CPU-s, with 32 it takes 50 (measured alone).
PROMPTS, SAMPLES, MAX_TOKENS = 16, 2, 480
#: the migration test's tries at most (see there): one for each refill of the source
TRIES = PROMPTS * SAMPLES // CONCURRENCY
#: the rollouts' ``flush_interval_s``: how often partial tokens reach the data role
FLUSH_S = 0.1


def greedy(model_dir: Path, prompts: list[list[int]]) -> dict[tuple[int, ...], list[int]]:
    """Transformers' greedy decoding of each distinct prompt, never stopping at EOS (vLLM's
    ``ignore_eos``): one model, prompts of one length in one batch (no padding)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    by_length: dict[int, list[tuple[int, ...]]] = {}
    for prompt in dict.fromkeys(tuple(p) for p in prompts):
        by_length.setdefault(len(prompt), []).append(prompt)
    out: dict[tuple[int, ...], list[int]] = {}
    for n, group in by_length.items():
        ids = torch.tensor(group)
        rows = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip
        out.update((prompt, row[n:].tolist()) for prompt, row in zip(group, rows, strict=True))
    return out


async def test_vllm_migration_keeps_tokens_and_version(tmp_path: Path, fleet: Fleet) -> None:
    cluster = fleet.cluster
    config = fleet.greedy_data(tmp_path, PROMPTS, SAMPLES, MAX_TOKENS)
    clients = Clients(cluster)
    source, dest = (clients.proxy(RolloutApi, name) for name in ROLLOUTS)
    core = _engine_core(descendants(cluster.procs[ROLLOUTS[0]].pid))
    try:
        # the destination only receives: drained before there is anything to take. The source
        # too, until the data role is up: its start-up takes longer than the source's whole run.
        await dest.drain.call(DrainRequest(reason="repack destination"))
        await source.drain.call(DrainRequest(reason="until the data role is up"))
        cluster.serve("data", "data", config=config)
        await source.resume.call()
        # The tiny model decodes all 480 tokens of a sequence in about a second, and every way
        # of timing a look-then-move against it failed somewhere (suite runs under load and
        # fresh-clone CI runs: moves after every sequence had finished, moves of sequences none
        # of which was prefilled, stale looks, tries that used up every prompt): under load
        # vLLM's engine core runs ahead of the rollout that reads its outputs, so what the store
        # shows can be seconds behind the engine. So each try freezes the source's engine
        # (SIGSTOP to vLLM's engine core, which schedules every step) and looks only once the
        # store has caught up with it; a frozen sequence cannot finish, so one that has decoded
        # a few tokens is moved with its KV state (the migrate is sent while frozen: its export
        # queues in the engine core, which serves it within a step of the thaw). Until then it
        # steps the engine in short thaws. A try that finds the source empty resumes it and
        # tries again; what every try moved is checked below.
        data = clients.proxy(DataApi, "data")
        reports: list[MigrateReport] = []
        moved_before: set[str] = set()
        tries = 0
        for tries in range(1, TRIES + 1):  # noqa: B007 - printed below
            await until(lambda: _holds_some(source), timeout=60, interval=0.005)
            await source.drain.call(DrainRequest(reason="repack source"))
            report = await _migrate_frozen(cluster, core, source, data, moved_before)
            await source.resume.call()
            if report is None:  # its sequences had finished
                continue
            reports.append(report)
            moved_before |= set(report.moved)
            if report.error or report.mode == "kv":
                break
        assert reports, f"no sequence decoding in {TRIES} freezes"
        print(f"moved on try {tries}: {len(reports)} reports, modes {[r.mode for r in reports]}")
        assert all(r.error == "" and not r.returned for r in reports), reports
        report = reports[-1]
        assert report.mode == "kv" and report.kv_tokens > 0 and report.kv_bytes > 0, reports
        await dest.resume.call()  # the rest on both rollouts: what is left is only waited for

        status = await until(lambda: _finished(data), timeout=180, interval=0.2)
        assert status.trajectories == PROMPTS * SAMPLES, (status, _failures(cluster))
        done = (await data.sample.call(SampleRequest(n=PROMPTS * SAMPLES))).items
        assert len({t.trajectory_id for t in done}) == PROMPTS * SAMPLES
    finally:
        for rollout in (source, dest):
            await rollout.resume.call()
        await clients.close()
        _stop(cluster, "data")
    moved = [t for t in done if t.trajectory_id in moved_before]
    assert len(moved) == len(moved_before)
    expected = greedy(fleet.model, [t.prompt_token_ids for t in moved])
    for t in moved:
        # Which rollout the record names is not checked: two fresh-clone runs recorded a moved
        # trajectory under the source (an open question, noted on issue 18's stop), while its
        # tokens were the destination's, exact, as checked here.
        assert t.version == 0
        assert t.response_token_ids == expected[tuple(t.prompt_token_ids)], t.trajectory_id


def _engine_core(engine: dict[int, str]) -> int:
    """The pid of vLLM's engine core (the process that schedules every step) among a rollout's
    processes (:func:`descendants`)."""
    cores = [pid for pid, title in engine.items() if "EngineCore" in title]
    assert len(cores) == 1, engine
    return cores[0]


async def _holds_some(rollout: RolloutApi) -> bool:
    return (await rollout.state.call()).in_flight > 0


async def _migrate_frozen(
    cluster: ProcessCluster, core: int, source: RolloutApi, data: DataApi, moved: set[str]
) -> MigrateReport | None:
    """Freeze the (drained) source's engine core until a sequence it holds has decoded a few
    tokens, and migrate everything it holds to the destination while frozen; None (nothing
    sent) if it holds no sequence any more. The destination only holds what earlier tries
    ``moved``; every other partial in the store is the source's."""
    try:
        while True:
            os.kill(core, signal.SIGSTOP)
            lengths = await _caught_up(data)
            if (await source.state.call()).in_flight == 0:
                return None
            if any(n >= 4 for t, n in lengths.items() if t not in moved):
                break
            os.kill(core, signal.SIGCONT)  # a few steps more
            await asyncio.sleep(0.02)
        request = MigrateRequest(
            destination=ROLLOUTS[1], address=cluster.info[ROLLOUTS[1]]["address"], version=0
        )
        move = asyncio.create_task(source.migrate.call(request))
        await asyncio.sleep(0.3)  # the export request reaches the frozen engine core
    finally:
        os.kill(core, signal.SIGCONT)
    return await move


async def _caught_up(data: DataApi) -> dict[str, int]:
    """The store's partial lengths once they stop changing over a few flushes (the source's
    engine is frozen: the rollout reads the outputs it had already made and reports them)."""
    last = None
    while (lengths := (await data.partial_lengths.call()).lengths) != last:
        last = lengths
        await asyncio.sleep(3 * FLUSH_S)
    return lengths


def _failures(cluster: ProcessCluster) -> list[str]:
    """The members' log lines about failed trajectories and dead members (a count that is off
    says which)."""
    return [
        line[:400]
        for name in ("manager", "data", *ROLLOUTS)
        for line in cluster.log_tail(name, 1_000_000).splitlines()
        if any(word in line for word in ("failed", "refused", "quarantined", "dead"))
    ]


async def _finished(data: DataApi) -> Any:
    # A status call can take over its 10 s when the suite's first minutes start three vLLM
    # engines at once (seen in a fresh-clone run): that is not the answer, so ask again; the
    # caller's ``until`` still bounds the wait.
    with contextlib.suppress(CallTimeout):
        status = await data.status.call()
        return status if status.finished else None
    return None


# -- 2. a kill -9 of the data role ---------------------------------------------------------------


async def test_vllm_rollouts_with_a_kill_9_of_the_data_role(tmp_path: Path, fleet: Fleet) -> None:
    task = subprocess.run(  # noqa: ASYNC221 - setup before this test's members start
        [sys.executable, str(ARITH / "task.py"), "generate", "--out", str(tmp_path / "data"),
         "--train", "0", "--test", "32", "--seed", "3"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert task.returncode == 0, task.stderr
    from laminar.recipe.tasks import load_task
    from laminar.recipe.tokenizer import build_tokenizer, save_tokenizer

    tokenizer = build_tokenizer(load_task(str(ARITH)).alphabet)
    assert tokenizer.get_vocab_size() <= VOCAB
    save_tokenizer(tokenizer, tmp_path / "tok")
    config = fleet.config(
        tmp_path,
        {
            "data": {
                "prompts": str(tmp_path / "data" / "test.jsonl"),
                "tokenizer": str(tmp_path / "tok"),
                "reward": f"{ARITH / 'task.py'}:reward",
                "samples_per_prompt": 4,
                "sampling": {"max_tokens": 48, "temperature": 1.0, "seed": 0},
                "store": str(tmp_path / "data.sqlite"),
                "metrics": None,
            }
        },
    )
    try:
        trajectories, figures = await kill_data_midway(
            fleet.cluster, total=128, kill_after=32, timeout=300, config=config
        )
    finally:
        _stop(fleet.cluster, "data-0")
    assert figures["done_before_kill"] >= 32
    assert {t.rollout for t in trajectories} == set(ROLLOUTS)
    for t in trajectories:
        assert t.version == 0
        assert t.reward in (0.0, 1.0) and t.reward_error is None
        assert 0 < len(t.response_token_ids) == len(t.logprobs) <= 48
        assert all(lp <= 0.0 for lp in t.logprobs)
        assert t.finish_reason in ("stop", "length")


# -- 3. the weight path ----------------------------------------------------------------------------


async def test_vllm_rollouts_load_each_published_version(tmp_path: Path, fleet: Fleet) -> None:
    # the RL loop's data, relay and trainer (tests/integration/test_rl_loop.loop_config), the
    # trainer starting from the fleet's model: the weights the rollouts run as version 0
    sections = yaml.safe_load(loop_config(tmp_path, 3, fleet.engine).read_text())
    sections["trainer"]["model"] = str(fleet.model)
    config = fleet.config(tmp_path, {k: sections[k] for k in ("data", "relay", "trainer")})
    cluster = fleet.cluster
    clients = Clients(cluster)
    try:
        cluster.serve("data", "data", config=config)
        cluster.serve("relay", "relay-0", config=config)
        cluster.serve("trainer", "trainer", config=config, timeout=120)
        status = await wait_trained(clients.trainer(), 3, 300)
        await wait_caught_up(clients, len(ROLLOUTS), 3, 120)
        histories = await check_rollouts_follow(
            clients, status, tmp_path / "data.sqlite", len(ROLLOUTS)
        )
        for name, history in histories.items():
            assert history.loads[-1].digest == status.digests[3], name
        for name in ROLLOUTS:  # vLLM's worker logs reach the rollout's; its expected
            # "RotaryEmbedding: Failed to load weights" at each reload is not among them
            # (vllm_compat.quiet_expected_reload_warnings)
            log = cluster.log_tail(name, 1_000_000)
            assert "Reloading weights inplace" in log, name
            assert "Failed to load weights" not in log, name
    finally:
        await clients.close()
        _stop(cluster, "trainer", "relay-0", "data")


def test_roles_give_way_to_the_vllm_engine_processes(fleet: Fleet) -> None:
    """``cluster.nice: 10`` (laminar.proc.placement): every thread of the rollout and of the
    manager runs at nice 10 once they are ready; vLLM's engine core and worker, which the rollout
    started before that, keep the niceness they started at; the rollout and its engine core run
    off the core the worker bound itself to (so the rollout may give way)."""
    cluster = fleet.cluster
    rollout = cluster.procs[ROLLOUTS[0]].pid
    engine = descendants(rollout)
    assert any("EngineCore" in name for name in engine.values()), engine

    # The cluster binds each rollout's vLLM worker to one core (VLLM_CPU_OMP_THREADS_BIND) and
    # leaves the rollout unpinned: it moved itself and its other processes off that core.
    everything = os.sched_getaffinity(0)
    workers = [pid for pid, name in engine.items() if "VLLM::Worker" in name]
    bound = set().union(*(os.sched_getaffinity(pid) for pid in workers))
    spare = everything - bound or everything  # one core: nowhere to move (nor to give way)
    assert len(bound) == 1, (workers, bound)
    ours = os.getpriority(os.PRIO_PROCESS, 0)  # what the cluster's processes started at
    assert threads_nice(rollout) == {max(10, ours) if spare != everything else ours}
    assert threads_nice(cluster.procs["manager"].pid) == {max(10, ours)}
    assert {pid: threads_nice(pid) for pid in engine} == {pid: {ours} for pid in engine}, engine
    assert os.sched_getaffinity(rollout) == spare
    assert {pid: os.sched_getaffinity(pid) for pid in engine if pid not in workers} == {
        pid: spare for pid in engine if pid not in workers
    }, engine


# -- 4. a rollout killed with -9 takes its engine along -------------------------------------------

BOUND_S = 10.0


def _environ_value(pid: int, name: str) -> str:
    """``name``'s value in the environment ``pid`` started with (kept readable: ``SPT_NOENV``)."""
    for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        key, _, value = entry.partition(b"=")
        if key == name.encode():
            return value.decode()
    raise AssertionError(f"{name} not in the environment of {pid}")


def descendants(root: int) -> dict[int, str]:
    """Every live process below ``root``: pid -> its command line (vLLM's processes set it to
    their title, e.g. ``VLLM::EngineCore``)."""
    out: dict[int, str] = {}
    for pid in procfs.descendants(root):
        try:
            out[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            out[pid] = "?"
        out[pid] = out[pid].strip()[:80]
    return out


def test_vllm_engine_dies_with_its_rollout_killed_with_minus_9(fleet: Fleet) -> None:
    cluster, victim = fleet.cluster, ROLLOUTS[0]
    rollout = cluster.procs[victim].pid
    engine = descendants(rollout)
    core = _engine_core(engine)
    # vLLM set their titles, and the cluster's mark is still readable (SPT_NOENV)
    assert all(procfs.has_env(pid, cluster.mark) for pid in engine), engine
    born = {pid: procfs.stat(pid).start for pid in engine}  # type: ignore[union-attr]

    # vLLM's socket files are in the engine's own directory (laminar.proc.owned_dirs), which the
    # watch removes before it kills: a killed process cannot unlink its sockets (issue 16's
    # 2026-11-29 session found 511 of them in /tmp, 7 from each engine start)
    ipc = Path(_environ_value(core, IPC_ENV))
    assert owned_dirs.owner(ipc) == (rollout, procfs.stat(rollout).start), ipc  # type: ignore[union-attr]
    assert any(stat.S_ISSOCK(p.lstat().st_mode) for p in ipc.iterdir()), list(ipc.iterdir())

    cluster.kill9(victim)
    killed = time.monotonic()

    def survivors() -> dict[int, str]:  # the same processes (pid and start time), not zombies
        return {pid: name for pid, name in engine.items() if procfs.alive(pid, born[pid])}

    while survivors() and time.monotonic() - killed < BOUND_S:
        time.sleep(0.1)
    took = time.monotonic() - killed
    assert not survivors(), f"outlived their rollout by {BOUND_S} s: {survivors()}"
    log = cluster.log_tail(victim)
    said = re.search(rf"the rollout \(pid {rollout}\) is gone; killing its vLLM engine "
                     r"\(pids ([\d, ]+)\)", log)  # fmt: skip
    assert said, log
    assert core in [int(pid) for pid in said.group(1).split(", ")], (core, said.group(0))
    assert not ipc.exists(), list(ipc.iterdir())
    print(f"{len(engine)} processes ({', '.join(sorted(engine.values()))}) gone {took:.1f} s")
