"""Messages larger than the limits: token arrays travel as raw buffers (so the msgpack payload limit
does not bound a batch), a trainer gets a batch larger than a frame in pieces, and a message over
the frame limit fails at its sender with a clear error while the connection stays usable.

The limits are set small here so that "large" costs little: a 32 KiB payload, a 256 KiB frame.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import ClassVar

import msgpack
import numpy as np
import pytest
import structlog
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from laminar.roles.data.api import DataApi, Report, TakeRequest
from laminar.roles.data.service import DataService
from laminar.roles.trainer.batches import BatchSource
from laminar.runtime.context import transport_options
from laminar.runtime.endpoint import endpoint
from laminar.runtime.errors import RemoteError
from laminar.runtime.rpc.client import RpcClient, remote
from laminar.runtime.rpc.server import decode_model, encode_model
from laminar.runtime.service import Service
from laminar.trajectory import PartialChunk, Trajectory
from laminar.transport import Frame, FrameError, Limits, MessageTooLarge, decode_payload
from laminar.transport.arrays import EXT_ARRAY, ArrayEncodeError
from tests.conftest import TRANSPORTS
from tests.integration.test_generation import data_config
from tests.support.procs import TOKEN

LIMITS = Limits(max_payload_bytes=32 << 10, max_frame_bytes=256 << 10)


@pytest.fixture
def options(cluster):  # type: ignore[no-untyped-def]
    return replace(transport_options(cluster, TOKEN.encode()), limits=LIMITS)


def trajectory(i: int, tokens: int, prompt: list[int] | None = None) -> Trajectory:
    rng = np.random.default_rng(i)
    return Trajectory(
        trajectory_id=f"p{i}/0",
        prompt_id=f"p{i}",
        sample_index=0,
        prompt_token_ids=prompt if prompt is not None else [1, 2, 3],
        response_token_ids=rng.integers(0, 150_000, tokens).tolist(),
        logprobs=(-rng.random(tokens) * 20).astype(np.float32).tolist(),
        version=0,
        finish_reason="length",
        queued_at=1.0,
        started_at=2.0,
        finished_at=3.0,
    )


class Batch(BaseModel):
    items: list[Trajectory]


class Inflate(BaseModel):
    count: int
    tokens: int


class Echo(Service):
    role: ClassVar[str] = "echo"

    @endpoint
    async def echo(self, req: Batch) -> Batch:
        return req

    @endpoint
    async def inflate(self, req: Inflate) -> Batch:
        return Batch(items=[trajectory(i, req.tokens) for i in range(req.count)])


def test_token_arrays_leave_msgpack_in_one_buffer() -> None:
    # 3,000 trajectories: one pool buffer whatever their number (max_buffers is 4096)
    batch = Batch(items=[trajectory(i, 40, prompt=list(range(20))) for i in range(3000)])
    payload, buffers = encode_model(batch)
    assert len(buffers) == 1 and buffers[0].nbytes >= 3000 * (4 * 20 + 8 * 40)
    back = decode_model(Batch, Frame({}, payload, buffers))
    assert back == batch  # the logprobs were float32 already: exact
    # the payload does not grow with the tokens: they are all in the buffer
    short, _ = encode_model(Batch(items=[trajectory(1, 100)]))
    long, _ = encode_model(Batch(items=[trajectory(1, 100_000)]))
    assert len(long) == len(short)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.lists(st.integers(-(2**31), 2**31 - 1), max_size=40).flatmap(
            lambda ids: st.tuples(
                st.just(ids),
                st.lists(st.floats(width=32), min_size=len(ids), max_size=len(ids)),
            )
        ),
        max_size=6,
    )
)
def test_any_chunks_round_trip_exactly(chunks) -> None:  # type: ignore[no-untyped-def]
    # lengths on both sides of the packing threshold; float32 values (NaN and inf included)
    sent = [
        PartialChunk(trajectory_id="t", version=0, offset=0, token_ids=ids, logprobs=lps)
        for ids, lps in chunks
    ]
    for chunk in sent:
        payload, buffers = encode_model(chunk)
        back = decode_model(PartialChunk, Frame({}, payload, buffers))
        assert back.token_ids == chunk.token_ids
        assert np.array_equal(np.array(back.logprobs), np.array(chunk.logprobs), equal_nan=True)


def test_bad_array_references_and_values_are_clear_errors() -> None:
    ref = msgpack.ExtType(EXT_ARRAY, bytes([1]) + (0).to_bytes(8, "big") + (100).to_bytes(8, "big"))
    payload = msgpack.packb({"ids": ref})
    with pytest.raises(FrameError, match="runs past"):
        decode_payload(payload, [memoryview(bytes(8))])
    with pytest.raises(FrameError, match="no buffers"):
        decode_payload(payload, [])
    too_big = trajectory(0, 20).model_copy(update={"response_token_ids": [2**40] * 20})
    with pytest.raises(ArrayEncodeError, match="int32"):
        encode_model(too_big)


async def test_a_message_over_the_payload_limit_arrives_whole(serve, options, bind_all) -> None:  # type: ignore[no-untyped-def]
    host, _ = await serve(Echo, bind_all)
    client = RpcClient(host.ctx.address, options, timeout=10)
    try:
        batch = Batch(items=[trajectory(i, 2_000) for i in range(8)])  # ~220 KB as msgpack
        assert len(encode_payload_plain(batch)) > LIMITS.max_payload_bytes
        back = await remote(Echo, client).echo.call(batch)
        assert back == batch
    finally:
        await client.close()


async def test_an_oversized_message_fails_at_its_sender(serve, options, bind_all) -> None:  # type: ignore[no-untyped-def]
    host, _ = await serve(Echo, bind_all)
    client = RpcClient(host.ctx.address, options, timeout=10)
    echo = remote(Echo, client)
    try:
        huge = Batch(items=[trajectory(i, 20_000) for i in range(4)])  # 640 KB of arrays
        with pytest.raises(MessageTooLarge, match=r"echo request .* over the frame limit"):
            await echo.echo.call(huge)
        with pytest.raises(MessageTooLarge, match="echo notification"):
            echo.echo.notify(huge)
        # a reply too large: the server says so instead of dropping the connection
        with pytest.raises(RemoteError) as info:
            await echo.inflate.call(Inflate(count=4, tokens=20_000))
        assert info.value.cause_type == "MessageTooLarge" and "frame limit" in info.value.cause
        assert client.connected  # nothing was torn down: the same connection still works
        small = Batch(items=[trajectory(0, 100)])
        assert await echo.echo.call(small) == small
    finally:
        await client.close()


async def test_a_batch_larger_than_a_frame_reaches_the_trainer_in_pieces(serve, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # 4 groups of 2 samples, 5,000 tokens each: ~40 KB a trajectory, ~320 KB the batch, over the
    # 256 KiB frame; a group (~80 KB) fits.
    samples, groups, tokens = 2, 4, 5_000
    data_host, _ = await serve(
        DataService, config=data_config(tmp_path, groups, samples_per_prompt=samples)
    )
    data = data_host.ctx.connect(DataApi, data_host.ctx.address)
    lease = (await data.take.call(TakeRequest(rollout="r", max_count=8, version=0))).items
    assert len(lease) == samples * groups
    sent = {}
    for a in lease:
        t = trajectory(len(sent), tokens, prompt=a.prompt_token_ids)
        t = t.model_copy(
            update={
                "trajectory_id": a.trajectory_id,
                "prompt_id": a.prompt_id,
                "sample_index": a.sample_index,
            }
        )
        sent[a.trajectory_id] = t
        await data.report.call(Report(rollout="r", completed=[t]))
    async with asyncio.timeout(30):
        while (await data.status.call()).scored < len(sent):  # noqa: ASYNC110
            await asyncio.sleep(0.05)

    log = structlog.get_logger("test")
    source = BatchSource(data_host.ctx, log, data_host.ctx.address, wait_s=0.5, group=samples)
    got = await asyncio.wait_for(source.next(len(sent), version=0, after=0), 60)
    assert sorted(t.trajectory_id for t in got.items) == sorted(sent)  # each exactly once
    for t in got.items:
        assert t.response_token_ids == sent[t.trajectory_id].response_token_ids
        assert t.logprobs == sent[t.trajectory_id].logprobs
    assert got.cursor == len(sent)
    assert source.piece is not None and source.piece % samples == 0  # it did split


def encode_payload_plain(model: BaseModel) -> bytes:
    """What the payload would be with every list inside msgpack (the old encoding)."""
    return msgpack.packb(model.model_dump(), use_bin_type=True)


@pytest.fixture(params=TRANSPORTS)
def bind_all(request):  # type: ignore[no-untyped-def]
    return request.param
