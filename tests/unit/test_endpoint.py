from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from pydantic import BaseModel

from laminar.runtime.endpoint import endpoint, endpoints_of, stream
from laminar.runtime.errors import EndpointDefinitionError
from tests.support.roles import Calculator


class Req(BaseModel):
    x: int


def test_specs_are_derived_from_signatures() -> None:
    specs = {name: spec for name, (spec, _) in endpoints_of(Calculator).items()}
    assert specs["add"].kind == "call" and specs["add"].request.__name__ == "Pair"
    assert specs["add"].response.__name__ == "Sum"
    assert specs["note"].response is None and specs["history"].request is None
    assert specs["count"].kind == "stream" and specs["count"].response.__name__ == "Item"


@pytest.mark.parametrize(
    ("source", "match"),
    [
        ("def f(self, req: Req) -> Req: ...", "async def"),
        ("async def f(self, a: Req, b: Req) -> Req: ...", "at most one"),
        ("async def f(self, req: int) -> Req: ...", "pydantic model"),
        ("async def f(self, req: Req): ...", "annotate the return"),
        ("async def f(self, req: Req) -> dict: ...", "pydantic model"),
        ("async def f(self, req: Req) -> AsyncIterator[Req]:\n    yield req", "@stream"),
    ],
)
def test_bad_endpoint_signatures_fail_at_class_creation(source: str, match: str) -> None:
    namespace: dict = {"Req": Req, "AsyncIterator": AsyncIterator}
    exec(source, namespace)
    with pytest.raises((EndpointDefinitionError, RuntimeError)) as info:
        type("Bad", (), {"f": endpoint(namespace["f"])})
    cause = info.value if isinstance(info.value, EndpointDefinitionError) else info.value.__cause__
    assert match in str(cause)


def test_stream_must_yield_models() -> None:
    async def f(self, req: Req) -> AsyncIterator[int]:
        yield 1

    with pytest.raises((EndpointDefinitionError, RuntimeError)):
        type("Bad", (), {"f": stream(f)})


async def test_local_verbs_match_remote_semantics() -> None:
    class Local:
        @endpoint
        async def double(self, req: Req) -> Req:
            return Req(x=2 * req.x)

        @stream
        async def upto(self, req: Req) -> AsyncIterator[Req]:
            for i in range(req.x):
                yield Req(x=i)

    obj = Local()
    assert (await obj.double.call(Req(x=4))).x == 8
    assert [r.x async for r in obj.upto.stream(Req(x=3))] == [0, 1, 2]
