"""An implementation must serve exactly the endpoints its contract declares: checked at class
creation, so a client built from the contract never sends what the server cannot read."""

from __future__ import annotations

import importlib
from collections.abc import AsyncIterator

import pytest
from pydantic import BaseModel

from laminar.roles_registry import builtin_roles
from laminar.runtime.endpoint import endpoint, endpoints_of, stream
from laminar.runtime.errors import EndpointDefinitionError
from laminar.runtime.service import Service


class Ask(BaseModel):
    q: str


class Answer(BaseModel):
    a: str


class Other(BaseModel):
    x: int


class QuizApi:
    @endpoint
    async def ask(self, req: Ask) -> Answer:
        raise NotImplementedError

    @stream
    async def feed(self, req: Ask) -> AsyncIterator[Answer]:
        raise NotImplementedError
        yield  # pragma: no cover

    @endpoint
    async def ping(self) -> None:
        raise NotImplementedError


def test_a_matching_implementation_is_accepted() -> None:
    class Quiz(Service, QuizApi):
        @endpoint
        async def ask(self, req: Ask) -> Answer:
            return Answer(a=req.q)

        @stream
        async def feed(self, req: Ask) -> AsyncIterator[Answer]:
            yield Answer(a=req.q)

    assert endpoints_of(Quiz)["ask"][1] is vars(Quiz)["ask"].fn


BAD = {
    "kind": (
        "@endpoint\nasync def feed(self, req: Ask) -> Answer: ...",
        "feed",
        "`call feed(Ask) -> Answer`",
        "`stream feed(Ask) -> AsyncIterator[Answer]`",
    ),
    "request": (
        "@endpoint\nasync def ask(self, req: Other) -> Answer: ...",
        "ask",
        "`call ask(Other) -> Answer`",
        "`call ask(Ask) -> Answer`",
    ),
    "no request": (
        "@endpoint\nasync def ask(self) -> Answer: ...",
        "ask",
        "`call ask() -> Answer`",
        "`call ask(Ask) -> Answer`",
    ),
    "response": (
        "@endpoint\nasync def ask(self, req: Ask) -> Other: ...",
        "ask",
        "`call ask(Ask) -> Other`",
        "`call ask(Ask) -> Answer`",
    ),
    "stream item": (
        "@stream\nasync def feed(self, req: Ask) -> AsyncIterator[Other]:\n    yield Other(x=1)",
        "feed",
        "`stream feed(Ask) -> AsyncIterator[Other]`",
        "`stream feed(Ask) -> AsyncIterator[Answer]`",
    ),
    "extra request": (
        "@endpoint\nasync def ping(self, req: Ask) -> None: ...",
        "ping",
        "`call ping(Ask) -> None`",
        "`call ping() -> None`",
    ),
    "missing decorator": (
        "async def ask(self, req: Ask) -> Answer: ...",
        "ask",
        "without @endpoint",
        "`call ask(Ask) -> Answer`",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_mismatch_fails_at_class_creation_naming_both_signatures(case: str) -> None:
    source, method, got, wanted = BAD[case]
    namespace: dict = {
        "Ask": Ask,
        "Answer": Answer,
        "Other": Other,
        "AsyncIterator": AsyncIterator,
        "endpoint": endpoint,
        "stream": stream,
    }
    exec(source, namespace)
    with pytest.raises(EndpointDefinitionError) as info:
        type("Quiz", (Service, QuizApi), {method: namespace[method]})
    message = str(info.value)
    assert f"Quiz.{method}" in message and f"QuizApi.{method}" in message
    assert got in message and wanted in message


def test_an_extra_parameter_fails_at_class_creation() -> None:
    # Python 3.11 wraps an error raised by __set_name__ in a RuntimeError
    with pytest.raises((EndpointDefinitionError, RuntimeError)) as info:

        class Quiz(Service, QuizApi):
            @endpoint
            async def ask(self, req: Ask, verbose: bool = False) -> Answer: ...

    cause = info.value if isinstance(info.value, EndpointDefinitionError) else info.value.__cause__
    assert isinstance(cause, EndpointDefinitionError) and "at most one" in str(cause)


def test_two_contracts_that_disagree_cannot_both_be_inherited() -> None:
    class OtherApi:
        @endpoint
        async def ask(self, req: Ask) -> Other:
            raise NotImplementedError

    with pytest.raises(EndpointDefinitionError, match=r"OtherApi\.ask"):

        class Both(Service, QuizApi, OtherApi):
            pass


def test_a_subclass_of_an_implementation_is_checked_too() -> None:
    class Quiz(Service, QuizApi):
        @endpoint
        async def ask(self, req: Ask) -> Answer:
            return Answer(a=req.q)

    with pytest.raises(EndpointDefinitionError, match=r"Louder.ask is `call ask\(Ask\) -> Other`"):

        class Louder(Quiz):
            @endpoint
            async def ask(self, req: Ask) -> Other: ...


@pytest.mark.parametrize("role", sorted(builtin_roles()))
def test_every_builtin_role_implements_its_contracts(role: str) -> None:
    """Importing a role creates its class, which runs the check; no role may break one."""
    module, _, name = builtin_roles()[role].partition(":")
    cls = getattr(importlib.import_module(module), name)
    contracts = {n for base in cls.__mro__[1:] for n in endpoints_of(base) if base is not Service}
    assert contracts <= set(endpoints_of(cls))
