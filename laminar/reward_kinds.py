"""Which convention a reward function follows: Laminar's, verl's or TRL's, from its parameters.

The data role asks when it loads the function (:class:`laminar.roles.data.rewards.RewardPool`),
before any worker starts, so a function no convention fits is a clear error at start naming it
and ``data.reward_kind``; the worker is then told the kind and never guesses. How each kind is
called is :mod:`laminar.reward_calls`; the user's guide is ``docs/rewards.md``.

``auto`` reads the parameter names: verl's ``data_source`` / ``solution_str`` / ``ground_truth``
or TRL's ``completions`` (both call with keywords, so the names are the contract); a function
naming neither that takes two positional arguments is Laminar's ``(record, response)``. Names of
both, or only ``*args``/``**kwargs``, are ambiguous: the kind must then be set. A kind that is set
is checked against the parameters all the same. Standard library only (the worker imports
:func:`accepted` too).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from .runtime.errors import ConfigError

AUTO = "auto"
KINDS = ("laminar", "verl", "trl")
#: Parameters whose names give a convention away (verl and TRL call with keywords).
VERL_NAMES = ("data_source", "solution_str", "ground_truth")
TRL_NAMES = ("completions",)

_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def is_async(fn: Callable[..., Any]) -> bool:
    """``async def`` (or an object whose ``__call__`` is)."""
    call = None if inspect.isroutine(fn) else type(fn).__dict__.get("__call__")
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call)


def signature(fn: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins and extension callables
        return None


def accepted(sig: inspect.Signature | None, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of ``kwargs`` that a function of signature ``sig`` declares (all of
    them if it takes ``**kwargs`` or its signature is unknown)."""
    if sig is None or any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return dict(kwargs)
    names = {p.name for p in sig.parameters.values() if p.kind in _NAMED}
    return {k: v for k, v in kwargs.items() if k in names}


def detect_kind(
    fn: Callable[..., Any],
    name: str,
    kind: str = AUTO,
    kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The convention ``fn`` is called by: ``kind`` if given (checked against its parameters),
    else the one its parameters name. ``name`` (its ``module:function``) names it in errors;
    ``kwargs`` are the configured ``reward_kwargs`` it will get too."""
    how = f"set data.reward_kind (or the function's `kind`) to one of {', '.join(KINDS)}"
    sig = signature(fn)
    if sig is None:
        if kind != AUTO:
            return kind
        raise ConfigError(
            f"reward {name}: its parameters cannot be inspected, so which convention it follows "
            f"is unknown; {how}"
        )
    if kind == AUTO:
        kind = _guess(sig, name, how)
    elif kind not in KINDS:
        raise ConfigError(f"reward {name}: unknown kind {kind!r}; expected {AUTO} or {KINDS}")
    problem = _mismatch(sig, kind, kwargs or {})
    if problem is not None:
        raise ConfigError(
            f"reward {name}{_shown(sig)} cannot be called as a {kind} reward: {problem}"
        )
    return kind


def _guess(sig: inspect.Signature, name: str, how: str) -> str:
    params = sig.parameters.values()
    names = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    said = [k for k, marks in (("verl", VERL_NAMES), ("trl", TRL_NAMES)) if names & set(marks)]
    if len(said) > 1:
        raise ConfigError(
            f"reward {name}{_shown(sig)} is ambiguous: its parameters name verl's arguments "
            f"({', '.join(VERL_NAMES)}) and TRL's ({', '.join(TRL_NAMES)}); {how}"
        )
    if said:
        return said[0]
    if not names:
        raise ConfigError(
            f"reward {name}{_shown(sig)} is ambiguous: it takes only *args/**kwargs, which fits "
            f"every convention; {how}"
        )
    if _binds(sig, (None, None), {}):
        return "laminar"
    raise ConfigError(
        f"reward {name}{_shown(sig)} takes none of the reward conventions' arguments: Laminar's "
        f"(record, response), verl's (data_source, solution_str, ground_truth, extra_info=None) "
        f"or TRL's (completions, **kwargs); fix its parameters or {how}"
    )


def _shown(sig: inspect.Signature) -> str:
    """``sig`` as errors show it: the parameters without their annotations."""
    bare = [p.replace(annotation=p.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=bare, return_annotation=sig.empty))


def _binds(sig: inspect.Signature, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    try:
        sig.bind(*args, **kwargs)
    except TypeError:
        return False
    return True


def _mismatch(sig: inspect.Signature, kind: str, kwargs: Mapping[str, Any]) -> str | None:
    """Why a function of signature ``sig`` cannot be called as ``kind`` (None: it can)."""
    if kind == "laminar":
        try:
            sig.bind(None, None, **accepted(sig, kwargs))
        except TypeError as exc:
            return f"it must take (record, response): {exc}"
        return None
    if kind == "verl":
        passed = dict.fromkeys((*VERL_NAMES, "extra_info")) | dict(kwargs)
        try:
            sig.bind(**accepted(sig, passed))
        except TypeError as exc:
            return f"verl passes data_source, solution_str, ground_truth, extra_info by name: {exc}"
        return None
    if "completions" not in accepted(sig, {"completions": None}):
        return "TRL passes completions=[...] (and the record's fields) by name"
    only = [p.name for p in sig.parameters.values() if p.kind is p.POSITIONAL_ONLY]
    if only:
        return f"TRL passes every argument by name, but {', '.join(only)} is positional-only"
    return None
