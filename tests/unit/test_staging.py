"""A publish's copy runs while the next step trains (``roles/trainer/staging.py``).

The property that makes it safe: the version holds exactly the weights it was staged with, because
the next optimizer step waits for the copy (the fence). Here the copy is held open on purpose
(its ``then`` blocks on an event), so a step that did not wait would change the weights under it:
the step must not finish while the copy is open, and the buffer must hold the old weights.

And the publisher's side: a version whose copy is under way is handed off at once and goes out
when its copy is done; a newer one handed off meanwhile supersedes it; a failed copy drops its
version and nothing else; and no buffer of a version still being copied is ever recycled.
"""

from __future__ import annotations

import asyncio
import random
import threading
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
import torch

from laminar.roles.trainer.compute import PolicyTrainer
from laminar.roles.trainer.config import TrainerConfig
from laminar.roles.trainer.publisher import WeightPublisher
from laminar.roles.trainer.staging import Fence, copy_plan, whole_tensors
from laminar.transport.tcp import TransportOptions
from laminar.weights.config import PublishConfig
from laminar.weights.manifest import WeightManifest, plan_specs
from laminar.weights.tensors import plan_tensors, tensors_from
from tests.support.cancel import cancel_after
from tests.support.poll import until

from ..support.models import tiny_qwen2
from .test_trainer_device import batch

#: A bound on waiting for a background copy to be taken in: a hang, never a timing check.
COPY_S = 30.0


def test_a_plan_copies_every_tensor_to_its_place() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    named = list(model.state_dict().items())
    manifest = plan_tensors(named, 1)
    buffer = np.zeros(manifest.total_bytes, dtype=np.uint8)
    written = copy_plan(whole_tensors(model, manifest), memoryview(buffer))
    assert written == sum(e.nbytes for e in manifest.tensors)  # the rest is alignment
    staged = dict(tensors_from(manifest, memoryview(buffer)))
    for name, tensor in named:
        assert torch.equal(staged[name], tensor), name


def test_the_fence_waits_for_every_copy_started_and_keeps_their_order() -> None:
    fence, order, gate = Fence(), [], threading.Event()
    first = fence.start(lambda: (gate.wait(), order.append(1)), torch.device("cpu"))
    second = fence.start(lambda: order.append(2), torch.device("cpu"))
    assert fence.busy and not first.done()
    threading.Timer(0.05, gate.set).start()
    assert fence.wait() > 0.0
    assert order == [1, 2] and second.done() and not fence.busy
    assert fence.wait() == 0.0  # nothing under way: no wait
    failing = fence.start(lambda: 1 / 0, torch.device("cpu"))
    fence.wait()  # a copy's error is its publish's, not the optimizer's
    assert isinstance(failing.exception(), ZeroDivisionError)
    fence.close()


def test_the_next_step_waits_for_the_copy_and_the_version_keeps_its_weights(
    tmp_path: Path,
) -> None:
    trainer = PolicyTrainer(
        TrainerConfig(
            model=str(tiny_qwen2(tmp_path / "model")),
            threads_per_rank=1,
            metrics_file=None,
            optim={"name": "adamw", "lr": 1e-2},
        )
    )
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    manifest = plan_specs(trainer.weight_specs(), 1)
    buffer = np.zeros(manifest.total_bytes, dtype=np.uint8)
    gate = threading.Event()
    copying = trainer.copy_out(manifest, memoryview(buffer), then=gate.wait)
    result: list = []
    stepping = threading.Thread(target=lambda: result.append(trainer.train(batch())))
    stepping.start()
    stepping.join(timeout=1.0)
    assert stepping.is_alive() and not copying.done()  # held at the fence, not finished
    gate.set()
    stepping.join(timeout=60)
    assert copying.done() and result, "the step never finished"
    assert result[0].weights_wait_s > 0.0 and result[0].steps == 1
    staged = dict(tensors_from(manifest, memoryview(buffer)))
    after = trainer.model.state_dict()
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert moved, "the step changed no weight"
    for name, tensor in before.items():  # the version holds the weights it was staged with
        assert torch.equal(staged[name], tensor), name
    trainer.close()


def _publisher() -> WeightPublisher:
    # a master nobody listens on: every push fails and is retried, releasing buffers each time
    config = PublishConfig(master="tcp://127.0.0.1:1", retry_s=0.01)
    return WeightPublisher(config, TransportOptions(token=b"x" * 32))


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [("a", torch.randn(64, 8, generator=g)), ("b", torch.randn(5, generator=g))]


def _background(seed: int, gate: threading.Event, writes: list[int]):  # type: ignore[no-untyped-def]
    """A fill that copies ``_weights(seed)`` on a thread once ``gate`` is set."""

    def fill(manifest: WeightManifest, segment: str | None, view: memoryview) -> Future[None]:
        future: Future[None] = Future()

        def run() -> None:
            gate.wait()
            copy_plan(
                [
                    (e.offset, t, t.dtype)
                    for e, (_, t) in zip(manifest.tensors, _weights(seed), strict=True)
                ],
                view,
            )
            writes.append(seed)
            future.set_result(None)

        threading.Thread(target=run, daemon=True).start()
        return future

    return fill


async def test_a_version_under_copy_goes_out_when_its_copy_is_done() -> None:
    publisher = _publisher()
    specs = [(n, t.dtype, list(t.shape)) for n, t in _weights(0)]
    runner = asyncio.create_task(publisher.run())
    try:
        gates = {v: threading.Event() for v in (1, 2, 3)}
        writes: list[int] = []
        v0 = publisher.stage(0, _weights(0))  # copied at once: pending, pushed, failing
        await publisher.hand_off(v0)
        assert publisher._pending is v0
        v1 = publisher.stage(1, specs=specs, fill=_background(1, gates[1], writes), shared=False)
        await publisher.hand_off(v1)  # returns at once: the copy is still under way
        assert publisher._pending is v0
        for _ in range(20):  # pushes fail and release buffers meanwhile: v1's must survive
            await asyncio.sleep(0.01)
        v2 = publisher.stage(2, specs=specs, fill=_background(2, gates[2], writes), shared=False)
        assert v2.view.obj is not v1.view.obj  # v1's buffer was not recycled under its copy
        gates[1].set()
        await until(lambda: asyncio.sleep(0, publisher._pending is v1), COPY_S)
        assert publisher._pending is v1 and 1 in publisher.digests
        staged = dict(tensors_from(v1.manifest, v1.view))
        for name, tensor in _weights(1):
            assert torch.equal(staged[name], tensor)
        # v2 and v3 handed off while v2's copy is open: v2 is superseded, v3 goes out
        await publisher.hand_off(v2)
        v3 = publisher.stage(3, specs=specs, fill=_background(3, gates[3], writes), shared=False)
        await publisher.hand_off(v3)
        gates[3].set()
        gates[2].set()
        await until(lambda: asyncio.sleep(0, publisher._pending is v3), COPY_S)
        assert publisher._pending is v3 and 2 not in publisher.digests
        assert sorted(writes) == [1, 2, 3]
        # a copy that fails loses its version only
        failed: Future[None] = Future()
        v4 = publisher.stage(4, specs=specs, fill=lambda m, s, v: failed, shared=False)
        await publisher.hand_off(v4)
        failed.set_exception(RuntimeError("a rank died"))
        await until(
            lambda: asyncio.sleep(0, not publisher._unfinished and not publisher._copies), COPY_S
        )
        assert publisher._pending is v3 and 4 not in publisher.digests
        assert not publisher._unfinished and not publisher._copies
    finally:
        runner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await runner


def test_an_abandoned_fence_ends_its_thread_after_the_copy_under_way() -> None:
    fence, gate = Fence("abandoned-copy"), threading.Event()
    copying = fence.start(gate.wait, torch.device("cpu"))
    fence.abandon()  # returns at once, the copy still blocked
    assert not copying.done()
    gate.set()
    copying.result(timeout=10)
    for _ in range(100):
        if not any(t.name == "abandoned-copy" for t in threading.enumerate()):
            break
        threading.Event().wait(0.01)
    assert not any(t.name == "abandoned-copy" for t in threading.enumerate())


@pytest.mark.parametrize("seed", [0, 1])
async def test_a_publisher_retrying_a_dead_master_ends_when_cancelled(seed: int) -> None:
    """The push loop retries a master that refuses it until its owner stops, which cancels it
    once. Its end-of-try clean-up awaited the tasks it had cancelled with every exception
    suppressed, so a cancellation arriving then was swallowed and the loop retried on; the
    cancel is sent after a seeded number of loop turns, so it lands at every point of a try."""
    rng = random.Random(seed)
    for i in range(100):
        publisher = _publisher()
        await publisher.hand_off(publisher.stage(0, _weights(0)))
        runner = asyncio.create_task(publisher.run())
        await cancel_after(runner, rng.randrange(1, 60), f"cancel {i} of a push loop (seed {seed})")


def test_specs_plan_the_same_layout_from_a_dtype_or_its_name() -> None:
    """The emulated trainer describes its bytes by dtype name (it loads no torch); the layout is
    the one a real trainer's torch dtypes give, and a name nobody knows is refused by name."""
    shapes = [("embed", (80, 64)), ("norm", (64,)), ("head", (3, 5, 7))]
    dtypes = [torch.bfloat16, torch.float32, torch.int64, torch.float16, torch.uint8, torch.bool]
    for dtype in dtypes:
        by_torch = plan_specs([(n, dtype, s) for n, s in shapes], 3)
        by_name = plan_specs([(n, str(dtype).removeprefix("torch."), s) for n, s in shapes], 3)
        assert by_name == by_torch, dtype
    with pytest.raises(ValueError, match="tensor 'w': unknown dtype 'bf16'"):
        plan_specs([("w", "bf16", (2,))], 1)
