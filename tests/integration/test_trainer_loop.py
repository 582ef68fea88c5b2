"""The torch trainer's loop against a real data role and a real relay, in one process.

The test itself plays the rollout (``take`` / ``report`` on the data role), so it chooses every
response, hence every reward, exactly. Two findings of issue 15:

* a reward that fails (the reward function raises) is excluded from training, not trained as a
  wrong answer (0.0);
* a trainer restarted with ``checkpoint.every > 1`` used to resume at its checkpoint's version and
  publish numbers the relays already held for other weights (they kept those, newer in their
  eyes; staleness went negative). It continues after the highest version ever published.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from laminar.roles.data.api import DataApi, Report, TakeRequest
from laminar.roles.data.service import DataConfig, DataService
from laminar.roles.relay import RelayConfig, RelayService
from laminar.roles.relay.api import LatestRequest, RelayApi
from laminar.roles.trainer.api import TrainerStatus
from laminar.roles.trainer.checkpoint import latest_checkpoint, load_state, published_mark
from laminar.roles.trainer.config import TrainerConfig
from laminar.roles.trainer.service import TrainerService
from laminar.runtime.config import ClusterConfig, ServiceConfig
from laminar.runtime.context import ServiceContext, transport_options
from laminar.runtime.rpc.client import RpcClient, remote
from laminar.runtime.service import Service, ServiceHost
from laminar.trajectory import Trajectory
from tests.support.models import tiny_qwen2
from tests.support.poll import until
from tests.support.procs import TOKEN
from tests.support.task import ALPHABET, write_prompts, write_tokenizer

pytestmark = pytest.mark.timeout(120)

ARITH = Path(__file__).resolve().parents[2] / "examples" / "arith"

CLUSTER = ClusterConfig(heartbeat_interval_s=0.5, heartbeat_timeout_s=60.0, rpc_timeout_s=10.0)
OPTIONS = transport_options(CLUSTER, TOKEN.encode())
HASH = 2 + ALPHABET.index("#")  # the tokenizer's id of "#" (the reward below raises on it)

REWARD = """
def reward(record, response):
    if "#" in response:
        raise ValueError("cannot score " + record["id"])
    return float(len(response) % 2)  # odd lengths are "right"
"""


class Hosted:
    """One service in this event loop; ``start`` fails fast if the service does."""

    def __init__(
        self,
        cls: type[Service],
        role: str,
        instance: str,
        config: ServiceConfig,
        cluster: ClusterConfig = CLUSTER,
    ):
        ctx = ServiceContext(
            role=role, instance=instance, cluster=cluster, config=config, options=OPTIONS
        )
        self.host = ServiceHost(cls, ctx)
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> Any:
        self.task = asyncio.create_task(self.host.run())
        started = asyncio.ensure_future(self.host.started())
        await asyncio.wait({self.task, started}, return_when=asyncio.FIRST_COMPLETED)
        if not started.done():
            started.cancel()
            self.task.result()  # the service failed to start: raise its error
        return started.result()

    @property
    def address(self) -> str:
        assert self.host.ctx.address is not None
        return self.host.ctx.address

    async def stop(self) -> None:
        if self.task is not None:
            self.host.stop()
            await asyncio.wait_for(self.task, 30)
            self.task = None


class Loop:
    """A data role and a relay; trainers come and go. ``bind``: where every service listens
    (``inproc://*``: in this event loop, no sockets)."""

    def __init__(
        self, tmp: Path, cluster: ClusterConfig = CLUSTER, bind: str = "tcp://127.0.0.1:0"
    ) -> None:
        self.tmp, self.cluster, self.bind = tmp, cluster, bind
        self.model = tiny_qwen2(tmp / "model")
        (tmp / "reward.py").write_text(REWARD)
        data = DataConfig(
            prompts=str(write_prompts(tmp / "prompts.jsonl", 64)),
            tokenizer=str(write_tokenizer(tmp / "tok")),
            reward=f"{tmp / 'reward.py'}:reward",
            samples_per_prompt=4,
            epochs=None,
            store=str(tmp / "data.sqlite"),
            queue_ahead=8,
            metrics=None,
            bind=bind,
        )
        self.data = Hosted(DataService, "data", "data", data, cluster)
        relay = RelayConfig(weights_bind=bind, keep=2, metrics=None, bind=bind)
        self.relay = Hosted(RelayService, "relay", "relay-0", relay, cluster)
        self.trainer: Hosted | None = None
        self.clients: list[RpcClient] = []

    async def start(self) -> None:
        await self.data.start()
        self.relay_service = await self.relay.start()

    def client(self, address: str) -> RpcClient:
        self.clients.append(RpcClient(address, OPTIONS, timeout=10.0))
        return self.clients[-1]

    async def start_trainer(
        self,
        every: int,
        max_versions: int | None = None,
        metrics_file: Path | None = None,
        eval: dict[str, Any] | None = None,
    ) -> TrainerService:
        config = TrainerConfig(
            model=str(self.model),
            batch={"prompts": 2, "samples": 4, "micro_batch_rows": 8},
            optim={"lr": 1e-3},
            threads_per_rank=1,
            max_versions=max_versions,
            sample_wait_s=0.3,
            checkpoint={"dir": str(self.tmp / "ckpt"), "every": every, "keep": 2},
            publish={"master": self.relay_service.advertise()["weights"], "chunks": 2},
            data=self.data.address,
            metrics_file=str(metrics_file) if metrics_file else None,
            eval=eval,
            metrics=None,
            bind=self.bind,
        )
        self.trainer = Hosted(TrainerService, "trainer", "trainer", config, self.cluster)
        return await self.trainer.start()  # type: ignore[no-any-return]

    async def stop_trainer(self) -> None:
        assert self.trainer is not None
        await self.trainer.stop()
        self.trainer = None

    async def generate(self, groups: int, response: Callable[[int], list[int]]) -> None:
        """Play a rollout: take ``groups`` whole groups and complete each sample with
        ``response(sample_index)``."""
        data = remote(DataApi, self.client(self.data.address))
        taken: list[Any] = []
        while len(taken) < 4 * groups:
            reply = await data.take.call(
                TakeRequest(rollout="r0", max_count=4 * groups - len(taken), version=0, wait_s=1)
            )
            taken += reply.items
        now = time.time()
        done = [
            Trajectory(
                trajectory_id=a.trajectory_id,
                prompt_id=a.prompt_id,
                sample_index=a.sample_index,
                prompt_token_ids=a.prompt_token_ids,
                response_token_ids=(ids := response(a.sample_index)),
                logprobs=[-1.0] * len(ids),
                version=0,
                finish_reason="stop",
                queued_at=a.queued_at,
                started_at=now,
                finished_at=now,
                rollout="r0",
            )
            for a in taken
        ]
        await data.report.call(Report(rollout="r0", completed=done))

    async def relay_latest(self) -> tuple[int, str]:
        shared = await remote(RelayApi, self.client(self.relay.address)).latest.call(
            LatestRequest()
        )
        assert shared.available and shared.manifest is not None
        return shared.version, shared.manifest.digest()

    async def close(self) -> None:
        for client in self.clients:
            await client.close()
        if self.trainer is not None:
            await self.trainer.stop()
        await self.relay.stop()
        await self.data.stop()


@pytest.fixture
async def loop(tmp_path: Path) -> AsyncIterator[Loop]:
    lp = Loop(tmp_path)
    await lp.start()
    try:
        yield lp
    finally:
        await lp.close()


async def trained(trainer: TrainerService, version: int, published: bool = True) -> TrainerStatus:
    async def probe() -> TrainerStatus | None:
        s = await trainer.status()
        return s if s.version >= version and (not published or s.published >= version) else None

    return await until(probe, 60)


async def test_a_failed_reward_is_left_out_not_trained_as_zero(loop: Loop) -> None:
    # Two groups; in each, sample 0's response has a "#" and its reward raises. The other three
    # are all "right" (odd length), so without the failure every advantage is 0 and the update
    # is exactly nothing; counting the failure as 0.0 would make it a real update.
    await loop.generate(2, lambda i: [HASH, 3, 4] if i == 0 else [3, 4, 5])
    trainer = await loop.start_trainer(every=1, max_versions=1)
    status = await trained(trainer, 1)
    assert status.excluded == {"reward_failed": 2}
    assert trainer.stats()["excluded_trajectories"] == 2.0  # what the heartbeat carries
    path = latest_checkpoint(loop.tmp / "ckpt")
    assert path is not None
    (entry,) = load_state(path).history
    failed = sorted(entry["excluded"]["reward_failed"])
    assert [tid.rsplit("/", 1)[1] for tid in failed] == ["0", "0"]
    assert len(entry["ids"]) == 6 and not set(entry["ids"]) & set(failed)
    before = load_file(loop.model / "model.safetensors")
    after = load_file(path / "model.safetensors")
    moved = [k for k in before if not (before[k] == after[k]).all()]
    assert not moved, f"the failed rewards were trained on: {moved[:3]}"


async def test_a_restarted_trainer_never_reuses_a_published_version(loop: Loop) -> None:
    lengths = [1, 2, 3, 2]  # mixed rewards: every version really changes the weights
    await loop.generate(10, lambda i: [3] * lengths[i])
    first = await loop.start_trainer(every=3)
    before = await trained(first, 5)  # v1..v5 published, only v3 checkpointed
    assert await loop.relay_latest() == (5, before.digests[5])
    await loop.stop_trainer()
    assert published_mark(loop.tmp / "ckpt") == 5

    # Resumes from v3 (cursor after batch 3): batches 4 and 5 come back. Its checkpoint's
    # weights go out as v6, the retrained batches as v7 and v8; 4 and 5 are never reused.
    second = await loop.start_trainer(every=3)
    status = await trained(second, 8)
    assert status.resumed_version == 3
    assert sorted(status.digests) == [6, 7, 8]
    assert await loop.relay_latest() == (8, status.digests[8])
    await loop.stop_trainer()

    # The mark lost with its disk: the master relay refuses the reused number, and the trainer
    # continues after the relay's newest instead.
    (loop.tmp / "ckpt" / "published").unlink()
    third = await loop.start_trainer(every=3)

    async def past_the_relay() -> TrainerStatus | None:
        s = await third.status()
        return s if s.published > 8 and s.published == s.version else None

    status = await until(past_the_relay, 60)
    assert status.resumed_version == 3 and status.version_conflicts >= 1
    assert await loop.relay_latest() == (status.version, status.digests[status.version])


async def test_a_trainer_stopped_while_it_evaluates_stops_the_evaluation(
    loop: Loop, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An evaluation (200 greedy episodes: tens of seconds on a CPU) runs on the compute's one
    thread, and the trainer's close waited behind it: `laminar run` stopped in its first minute
    (during the evaluation of the starting weights) saw the trainer's close time out ("on_stop
    failed") and the trainer killed. The evaluation now gives up at its next decoding step, and
    the close runs to its end. Here the evaluation is a stand-in that takes a minute."""
    from laminar.recipe import evaluate, model
    from laminar.recipe.episodes import check_stop

    evaluating, told = threading.Event(), threading.Event()

    def a_minute_of_batches(*args: Any, stop: Any = None, **kwargs: Any) -> Any:
        evaluating.set()
        for _ in range(600):
            if stop is not None and stop():
                told.set()
            check_stop(stop)
            time.sleep(0.1)
        raise AssertionError("the evaluation was never told to stop")

    monkeypatch.setattr(evaluate, "evaluate_model", a_minute_of_batches)
    monkeypatch.setattr(model, "load_tokenizer", lambda path: None)
    trainer = await loop.start_trainer(every=1, eval={"task": str(ARITH), "n": 4})
    closed = asyncio.Event()
    close = trainer.loop.close

    async def recorded_close() -> None:
        await close()
        closed.set()

    trainer.loop.close = recorded_close  # type: ignore[method-assign]
    assert await asyncio.to_thread(evaluating.wait, 30)
    await loop.stop_trainer()
    assert told.is_set()  # asked to stop, and it gave up
    assert closed.is_set()  # the close ran to its end (it timed out behind the evaluation)
