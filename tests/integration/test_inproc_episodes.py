"""Multi-turn episodes on the in-process cluster: the environment's turns, kills and repack.

The sim engine stops at the environment's stop token (``#``, one id in 17, so an episode has a
few tool calls); :class:`tests.support.envs.CountingEnv` answers the k-th call with ``=k`` and
rewards each action 1. Every finished trajectory must therefore read ``=1``, ``=2``, ... in its
environment spans, in order, with logprob 0 there, and have reward = its number of actions
(capped by ``max_turns``) — whatever happened to it on the way.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from laminar.harness.inproc import inproc_cluster, run_inproc
from laminar.roles.data.api import DataApi, SampleRequest
from laminar.roles.rollout.api import DrainRequest, MigrateRequest
from laminar.tools.env import model_spans
from laminar.trajectory import Trajectory

from ..support.poll import until
from ..support.task import write_prompts, write_tokenizer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

MAX_TURNS = 5


def sections(tmp: Path, prompts: int, env: str = "CountingEnv") -> dict[str, Any]:
    return {
        "data": {
            "prompts": str(write_prompts(tmp / "prompts.jsonl", prompts)),
            "tokenizer": str(write_tokenizer(tmp / "tok")),
            "env": {"spec": f"tests.support.envs:{env}", "max_turns": MAX_TURNS, "concurrency": 4},
            "samples_per_prompt": 4,
            "store": str(tmp / "data.sqlite"),
        },
        "rollout": {
            "concurrency": 8,
            "flush_interval_s": 0.1,
            "engine": {
                "backend": "sim",
                "vocab_size": 17,  # the test tokenizer's: "#" (id 15) ends a turn
                "lengths": {"kind": "longtail", "median": 60, "max_length": 400},
                "cost": {"batch_points": [[1, 0.004], [256, 0.008]], "prefill_s_per_token": 0},
            },
        },
    }


def check_episode(t: Trajectory, tok: Any) -> None:
    """The rules of the module docstring, for one finished trajectory."""
    actions = model_spans(len(t.response_token_ids), t.env_spans)
    assert len(t.env_spans) <= MAX_TURNS - 1, t.env_spans
    for k, (a, b) in enumerate(t.env_spans, 1):
        assert tok.decode(t.response_token_ids[a:b]) == f"={k}\n", (t.trajectory_id, k)
        assert all(lp == 0.0 for lp in t.logprobs[a:b])
    for a, b in actions:
        assert all(lp < 0 for lp in t.logprobs[a:b])  # the model's tokens, real logprobs
    assert t.reward == float(len(actions)), (t.trajectory_id, t.reward, len(actions), t.env_spans)


async def _finished(data: DataApi):  # type: ignore[no-untyped-def]
    status = await data.status.call()
    return status if status.finished else None


def _tokenizer(tmp: Path) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tmp / "tok" / "tokenizer.json"))


async def episodes_scenario(tmp: Path, seed: int, kill: str) -> list[tuple]:
    prompts = 12
    total = prompts * 4
    members = [("data", "data"), ("rollout", "rollout-0"), ("rollout", "rollout-1")]
    async with inproc_cluster(sections(tmp, prompts), seed=seed, members=members) as cluster:
        data = cluster.proxy(DataApi, "data")
        victim = cluster.service("rollout-1")
        held: dict[str, int] = {}

        async def mid_episode() -> bool:  # episodes wait for the environment, with observations
            waiting = [f for f in victim.flights.values() if f.waiting]
            acked = [f for f in victim.flights.values() if f.env_spans and f.acked]
            return len(waiting) >= 1 and len(acked) >= 1

        if kill != "none":
            await until(mid_episode, timeout=60, interval=0.01)
            held = {tid: f.acked for tid, f in victim.flights.items() if f.acked}
        if kill == "rollout":  # kill -9: its episodes continue on rollout-0
            await cluster.kill("rollout-1")
        elif kill == "stop":  # stopped: nothing works with its engine once that closes
            working = await _stop_watching_the_engine(cluster, "rollout-1")
            assert not working, f"still at work when the engine closed: {working}"
            assert victim.failures == 0
        elif kill == "data":  # its live environments are lost: rebuilt by replay
            await cluster.kill("data")
            await cluster.restart("data")
            data = cluster.proxy(DataApi, "data")
        elif kill == "repack":  # waiting episodes move too, and get their answers there
            await victim.drain(DrainRequest(reason="test"))
            waiting = {tid for tid, f in victim.flights.items() if f.waiting}
            report = await victim.migrate(
                MigrateRequest(
                    destination="rollout-0", address=cluster.address("rollout-0"), version=0
                )
            )
            assert report.error == "" and waiting <= set(report.moved), report
            assert len(victim.flights) == 0
        status = await until(lambda: _finished(data), timeout=150)
        assert status.trajectories == total and status.failed == 0, status
        assert status.reward_errors == 0, status
        done = (await data.sample.call(SampleRequest(n=total))).items
        assert len({t.trajectory_id for t in done}) == total
        tok = _tokenizer(tmp)
        for t in done:
            check_episode(t, tok)
        assert sum(len(t.env_spans) for t in done) >= total, "too few tool calls to test"
        by_id = {t.trajectory_id: t for t in done}
        if kill == "data":
            assert cluster.service("data").episodes.replays > 0
        if kill in ("rollout", "repack", "stop"):
            resumed = [tid for tid in held if by_id[tid].rollout == "rollout-0"]
            assert resumed, "none of rollout-1's episodes continued elsewhere"
            for tid in resumed:
                assert len(by_id[tid].response_token_ids) >= held[tid]
        return sorted((t.trajectory_id, len(t.response_token_ids), t.reward) for t in done)


#: the tasks of a rollout that work with its engine (roles/rollout/service.py, turns.py, switching)
WORK = ("outputs", "pull", "feed", "flush", "weights", "env-step")


async def _stop_watching_the_engine(cluster: Any, name: str) -> list[str]:
    """Stop ``name`` gracefully; the names of its work tasks still running when it closed its
    engine. They used to be (on_stop closed the engine first): with vLLM, the output reader
    met the closed engine and crashed the stop, and returning episodes failed in the engine."""
    service = cluster.service(name)
    close, working = service.engine.close, []

    async def watched_close() -> None:
        working.extend(
            t.get_name() for t in asyncio.all_tasks()
            if t.get_name().startswith(f"{name}:") and not t.done()
            and t.get_name().removeprefix(f"{name}:").split(" ")[0] in WORK
        )  # fmt: skip
        await close()

    service.engine.close = watched_close
    await cluster.stop(name)
    return working


@pytest.mark.parametrize("kill", ["none", "rollout", "data", "repack", "stop"])
def test_episodes_interleave_model_and_environment_turns(tmp_path: Path, kill: str) -> None:
    run_inproc(lambda: episodes_scenario(tmp_path, seed=0, kill=kill), seed=0)


@pytest.mark.parametrize("seed", [1, 2])
def test_episodes_survive_a_rollout_kill_on_other_seeds(tmp_path: Path, seed: int) -> None:
    run_inproc(lambda: episodes_scenario(tmp_path, seed=seed, kill="rollout"), seed=seed)


async def failing_scenario(tmp: Path) -> None:
    members = [("data", "data"), ("rollout", "rollout-0")]
    async with inproc_cluster(sections(tmp, 6, "FailingEnv"), seed=0, members=members) as cluster:
        data = cluster.proxy(DataApi, "data")
        status = await until(lambda: _finished(data), timeout=150)
        assert status.trajectories == 24 and status.failed == 0, status
        done = (await data.sample.call(SampleRequest(n=24))).items
        broken = [t for t in done if t.reward is None]
        assert broken and all("the tool broke" in (t.reward_error or "") for t in broken)
        assert all(len(t.env_spans) == 1 for t in broken)  # ended at the failing call
        assert all(t.reward is not None for t in done if len(t.env_spans) == 0)


def test_a_failing_environment_ends_its_episode_alone(tmp_path: Path) -> None:
    run_inproc(lambda: failing_scenario(tmp_path), seed=0)


async def redundant_scenario(tmp: Path) -> None:
    """6 samples started per prompt, the first 4 to finish kept (``data.redundant_samples``)."""
    prompts = 12
    config = sections(tmp, prompts)
    config["data"]["redundant_samples"] = 2
    members = [("data", "data"), ("rollout", "rollout-0"), ("rollout", "rollout-1")]
    async with inproc_cluster(config, seed=0, members=members) as cluster:
        data = cluster.proxy(DataApi, "data")
        status = await until(lambda: _finished(data), timeout=150)
        assert status.trajectories == prompts * 4 and status.failed == 0, status
        assert 0 < status.cancelled <= prompts * 2, status
        done = (await data.sample.call(SampleRequest(n=prompts * 4, whole_groups=True))).items
        groups: dict[str, list[Trajectory]] = {}
        for t in done:
            groups.setdefault(t.prompt_id, []).append(t)
        assert len(groups) == prompts and all(len(g) == 4 for g in groups.values())
        assert any(max(t.sample_index for t in g) > 3 for g in groups.values())
        tok = _tokenizer(tmp)
        for t in done:
            check_episode(t, tok)
        assert cluster.service("data").episodes.stats()["env_live"] == 0  # none left behind


def test_redundant_samples_keep_the_first_to_finish(tmp_path: Path) -> None:
    run_inproc(lambda: redundant_scenario(tmp_path), seed=0)
