"""Typed endpoints: how a role declares what it serves, and the three verbs to reach it.

A role is a :class:`~laminar.runtime.service.Service` whose methods are marked::

    class Manager(Service):
        @endpoint
        async def join(self, req: JoinRequest) -> JoinReply: ...

        @stream
        async def watch(self, req: WatchRequest) -> AsyncIterator[MemberEvent]: ...

A method takes no argument or one pydantic model, and returns a pydantic model or ``None``
(``@stream``: yields models). That is checked when the class is created, so a signature the wire
cannot carry fails at import, not at the first call.

A role declares its endpoints once, on a contract class of stubs (``DataApi``), which clients
import without the implementation; the service class inherits the contract and overrides each stub.
:func:`check_contracts` (run for every :class:`~laminar.runtime.service.Service` subclass) makes an
override that disagrees with its contract (kind, request or response model, a missing decorator)
an error when the implementing class is created: otherwise a client built from the contract would
send what the server cannot read, and find out only at the first call.

The verbs, the same whether the service is local or remote (Monarch's small verb set)::

    reply = await manager.join.call(JoinRequest(...))       # request / reply, with a timeout
    manager.heartbeat.notify(Heartbeat(...))                # one-way: no reply, no error back,
                                                            # ordered only among notifies
    async for ev in manager.watch.stream(WatchRequest()):   # server stream
        ...
    await manager.join.options(timeout=2.0).call(req)       # per-call options

``ParamSpec`` carries each method's signature to its verbs, so a type checker rejects
``join.call(Heartbeat(...))``.
"""

from __future__ import annotations

import asyncio
import collections.abc
import inspect
import typing
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Concatenate, Generic, Literal, ParamSpec, Protocol, TypeVar, overload

import structlog
from pydantic import BaseModel

from .errors import EndpointDefinitionError

log = structlog.get_logger("laminar.runtime.rpc.server")

P = ParamSpec("P")
R = TypeVar("R", covariant=True)
T = TypeVar("T", covariant=True)

Kind = Literal["call", "stream"]


@dataclass(frozen=True)
class EndpointSpec:
    """What the RPC layer needs to know about one endpoint."""

    name: str
    kind: Kind
    request: type[BaseModel] | None
    response: type[BaseModel] | None  # the item type for a stream

    def signature(self) -> str:
        """``call take(TakeRequest) -> Assignments``: how error messages show a contract."""
        request = self.request.__name__ if self.request is not None else ""
        response = self.response.__name__ if self.response is not None else "None"
        if self.kind == "stream":
            response = f"AsyncIterator[{response}]"
        return f"{self.kind} {self.name}({request}) -> {response}"

    def agrees(self, other: EndpointSpec) -> bool:
        return (self.kind, self.request, self.response) == (
            other.kind,
            other.request,
            other.response,
        )


class CallRef(Protocol[P, R]):
    """The verbs of a request/reply endpoint."""

    async def call(self, *args: P.args, **kwargs: P.kwargs) -> R: ...

    def notify(self, *args: P.args, **kwargs: P.kwargs) -> None: ...

    def options(self, *, timeout: float) -> CallRef[P, R]: ...


class StreamRef(Protocol[P, T]):
    """The verb of a server-stream endpoint."""

    def stream(self, *args: P.args, **kwargs: P.kwargs) -> AsyncIterator[T]: ...

    def options(self, *, timeout: float) -> StreamRef[P, T]: ...


class _Declared:
    """Shared part of the two descriptors: signature checking and the spec."""

    kind: Kind

    def __init__(self, fn: Callable[..., Any]) -> None:
        if not inspect.iscoroutinefunction(fn) and not inspect.isasyncgenfunction(fn):
            raise EndpointDefinitionError(f"endpoint {fn.__qualname__} must be `async def`")
        self.fn = fn
        self.spec: EndpointSpec | None = None
        self.__doc__ = fn.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.spec = _inspect(self.fn, name, self.kind)

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return LocalRef(self, obj)


class Endpoint(_Declared, Generic[P, R]):
    kind: Kind = "call"

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Endpoint[P, R]: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> CallRef[P, R]: ...
    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return super().__get__(obj, owner)


class StreamEndpoint(_Declared, Generic[P, T]):
    kind: Kind = "stream"

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> StreamEndpoint[P, T]: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> StreamRef[P, T]: ...
    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return super().__get__(obj, owner)


def endpoint(fn: Callable[Concatenate[Any, P], Awaitable[R]]) -> Endpoint[P, R]:
    """Mark a request/reply method (also reachable one-way with ``.notify``)."""
    return Endpoint(fn)


def stream(fn: Callable[Concatenate[Any, P], AsyncIterator[T]]) -> StreamEndpoint[P, T]:
    """Mark a server-stream method (an async generator yielding models)."""
    return StreamEndpoint(fn)


def endpoints_of(cls: type) -> dict[str, tuple[EndpointSpec, Callable[..., Any]]]:
    """Every endpoint a class declares (own and inherited), by name."""
    found: dict[str, tuple[EndpointSpec, Callable[..., Any]]] = {}
    for klass in reversed(cls.__mro__):
        for name, value in vars(klass).items():
            if isinstance(value, _Declared):
                assert value.spec is not None
                found[name] = (value.spec, value.fn)
            elif name in found:
                del found[name]  # overridden by a plain attribute
    return found


def check_contracts(cls: type) -> None:
    """Raise :class:`EndpointDefinitionError` where ``cls`` breaks an endpoint contract it inherits.

    Every endpoint declared anywhere in the MRO must resolve, on ``cls``, to an endpoint of the
    same kind, request model and response model. This also catches two bases that declare one
    name differently, and an override that forgot its ``@endpoint`` (which would silently take
    the endpoint off the wire).
    """
    for name in {n for k in cls.__mro__ for n, v in vars(k).items() if isinstance(v, _Declared)}:
        owner = next(k for k in cls.__mro__ if name in vars(k))
        impl = vars(owner)[name]
        for base in cls.__mro__:
            contract = vars(base).get(name)
            if base is owner or not isinstance(contract, _Declared):
                continue
            assert contract.spec is not None
            wanted = f"{base.__qualname__}.{name}: `{contract.spec.signature()}`"
            if not isinstance(impl, _Declared):
                raise EndpointDefinitionError(
                    f"{cls.__qualname__}: {owner.__qualname__}.{name} overrides the endpoint "
                    f"{wanted} without @{'stream' if contract.kind == 'stream' else 'endpoint'}"
                )
            assert impl.spec is not None
            if not impl.spec.agrees(contract.spec):
                raise EndpointDefinitionError(
                    f"{cls.__qualname__}: {owner.__qualname__}.{name} is "
                    f"`{impl.spec.signature()}`, but its contract {wanted}"
                )


class LocalNotifies:
    """The one-way calls in flight on one local object: owned by it, cancelled with it.

    ``notify`` on a local object cannot await its call, so something must hold the task (the
    event loop keeps only weak references) and end it: the object, as a connection owns the
    handlers of its one-way calls. A :class:`~laminar.runtime.service.ServiceHost` closes its
    service's
    at stop; other objects close theirs with ``local_notifies(obj).close()``. A failure is logged,
    never raised, as on the wire.
    """

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def start(self, coro: Coroutine[Any, Any, Any], method: str) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda t: _log_failure(t, method))

    async def close(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


def local_notifies(obj: Any) -> LocalNotifies:
    """The owner of ``obj``'s local one-way calls (created on first use)."""
    owned: LocalNotifies | None = vars(obj).get(_NOTIFIES_ATTR)
    if owned is None:
        owned = LocalNotifies()
        setattr(obj, _NOTIFIES_ATTR, owned)
    return owned


_NOTIFIES_ATTR = "_laminar_local_notifies"


def _log_failure(task: asyncio.Task[Any], method: str) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("one-way call failed", method=method, exc_info=task.exception())


class LocalRef:
    """Verbs on a service object in this process: no wire, same semantics."""

    def __init__(self, declared: _Declared, obj: Any) -> None:
        self._declared = declared
        self._obj = obj

    def __call__(self, *args: Any) -> Any:
        return self._declared.fn(self._obj, *args)

    async def call(self, *args: Any) -> Any:
        return await self._declared.fn(self._obj, *args)

    def notify(self, *args: Any) -> None:
        local_notifies(self._obj).start(
            self._declared.fn(self._obj, *args), self._declared.fn.__name__
        )

    def stream(self, *args: Any) -> AsyncIterator[Any]:
        items: AsyncIterator[Any] = self._declared.fn(self._obj, *args)
        return items

    def options(self, *, timeout: float) -> LocalRef:
        return self


# ----------------------------------------------------------------------------------------------


def _model_or_none(hint: Any, where: str) -> type[BaseModel] | None:
    if hint is None or hint is type(None):
        return None
    if isinstance(hint, type) and issubclass(hint, BaseModel):
        return hint
    raise EndpointDefinitionError(f"{where} must be a pydantic model or None, not {hint!r}")


def _inspect(fn: Callable[..., Any], name: str, kind: Kind) -> EndpointSpec:
    where = f"endpoint {fn.__qualname__}"
    try:
        hints = typing.get_type_hints(fn)
    except NameError as exc:
        raise EndpointDefinitionError(f"{where}: cannot resolve an annotation ({exc})") from exc
    params = list(inspect.signature(fn).parameters.values())[1:]  # drop self
    if len(params) > 1 or any(p.kind not in (p.POSITIONAL_OR_KEYWORD,) for p in params):
        raise EndpointDefinitionError(f"{where} must take at most one request model argument")
    request = None
    if params:
        if params[0].name not in hints:
            raise EndpointDefinitionError(f"{where}: annotate the request argument")
        request = _model_or_none(hints[params[0].name], f"{where}'s request")
    if "return" not in hints:
        raise EndpointDefinitionError(f"{where}: annotate the return type")
    ret = hints["return"]
    if kind == "stream":
        if typing.get_origin(ret) not in (
            collections.abc.AsyncIterator,
            collections.abc.AsyncGenerator,
            collections.abc.AsyncIterable,
        ):
            raise EndpointDefinitionError(f"{where} must return AsyncIterator[Model]")
        if not inspect.isasyncgenfunction(fn):
            raise EndpointDefinitionError(f"{where} must be an async generator (use yield)")
        response = _model_or_none(typing.get_args(ret)[0], f"{where}'s item type")
        if response is None:
            raise EndpointDefinitionError(f"{where} must yield pydantic models")
    else:
        if inspect.isasyncgenfunction(fn):
            raise EndpointDefinitionError(f"{where} yields: declare it with @stream")
        response = _model_or_none(ret, f"{where}'s return type")
    return EndpointSpec(name=name, kind=kind, request=request, response=response)
