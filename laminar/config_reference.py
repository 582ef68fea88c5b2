"""The configuration reference (``docs/configuration.md``), generated from the pydantic models.

Why generated: the models are what ``load_config`` and each role's ``config_model`` enforce, so a
page written by hand would drift from them the first time someone adds a field. This module walks
the same models (``cluster``, ``run``, and every built-in role's ``config_model`` found through
:mod:`laminar.roles_registry`) and renders one table per section: dotted key, type, default,
constraints and the field's description. A nested model is flattened into its parent's table; a
union of models (an engine's ``backend``, a length distribution's ``kind``) gets one table per
variant, because each variant has its own keys.

``python -m laminar.config_reference > docs/configuration.md`` regenerates the page;
``--check docs/configuration.md`` exits 1 when the file is stale (the unit tests check it too).
Role modules are imported only when :func:`render` runs: some pull in torch.
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import json
import sys
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types as at
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

REGENERATE = "python -m laminar.config_reference > docs/configuration.md"


@dataclass
class Row:
    key: str
    type: str
    default: str
    constraints: str
    description: str


@dataclass
class Table:
    """One model's keys under ``prefix``; ``variant`` names the union member it describes."""

    prefix: str
    title: str
    doc: str
    rows: list[Row] = field(default_factory=list)
    variant: str = ""


# -- annotations -----------------------------------------------------------------------------


def _is_union(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType)


def _strip(tp: Any) -> tuple[Any, list[Any]]:
    """``tp`` without ``Annotated`` layers, and the metadata those layers carried."""
    meta: list[Any] = []
    while get_origin(tp) is Annotated:
        tp, *extra = get_args(tp)
        meta.extend(extra)
    return tp, meta


def _members(tp: Any) -> tuple[list[Any], bool, list[Any]]:
    """A union's non-null members (unwrapped), whether null is allowed, and their metadata."""
    tp, meta = _strip(tp)
    if not _is_union(tp):
        return [tp], False, meta
    out, nullable = [], False
    for arg in get_args(tp):
        arg, inner = _strip(arg)
        if arg is type(None):
            nullable = True
        else:
            out.append(arg)
            meta.extend(inner)
    return out, nullable, meta


def _is_model(tp: Any) -> bool:
    return inspect.isclass(tp) and issubclass(tp, BaseModel)


def _type_name(tp: Any) -> str:
    tp, _ = _strip(tp)
    if tp is type(None):
        return "null"
    if _is_union(tp):
        return " or ".join(_type_name(a) for a in get_args(tp))
    origin = get_origin(tp)
    if origin is Literal:
        return "str" if all(isinstance(a, str) for a in get_args(tp)) else "literal"
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        args = get_args(tp)
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            return f"tuple[{_type_name(args[0])}, ...]"
        return f"{name}[{', '.join(_type_name(a) for a in args)}]"
    if tp is Any or tp is object:
        return "any"
    return getattr(tp, "__name__", str(tp))


_BOUNDS = ((at.Ge, "ge", ">="), (at.Gt, "gt", ">"), (at.Le, "le", "<="), (at.Lt, "lt", "<"))


def _constraint_text(meta: list[Any]) -> list[str]:
    out: list[str] = []
    for item in meta:
        if isinstance(item, FieldInfo):
            out.extend(_constraint_text(item.metadata))
            continue
        for cls, attr, sym in _BOUNDS:
            if isinstance(item, cls):
                out.append(f"{sym} {getattr(item, attr)}")
        if isinstance(item, at.MinLen):
            out.append(f"length >= {item.min_length}")
        if isinstance(item, at.MaxLen):
            out.append(f"length <= {item.max_length}")
    return out


def _constraints(info: FieldInfo) -> str:
    members, _, meta = _members(info.annotation)
    parts = _constraint_text(list(info.metadata) + meta)
    for m in members:
        if get_origin(m) is Literal:
            parts.append("one of " + ", ".join(f"`{a}`" for a in get_args(m)))
        elif get_origin(m) in (list, tuple, dict):
            inner = [_strip(a)[1] for a in get_args(m)]
            bounds = [_constraint_text(x) for x in inner]
            if any(bounds):
                names = ("key", "value") if get_origin(m) is dict else ("item",) * len(bounds)
                if get_origin(m) is tuple and len(bounds) > 1:
                    names = tuple(f"item {i}" for i in range(len(bounds)))
                parts.extend(
                    f"{n} {' and '.join(b)}" for n, b in zip(names, bounds, strict=False) if b
                )
    return "; ".join(dict.fromkeys(parts))


# -- values ----------------------------------------------------------------------------------


def _jsonable(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        # ignored below: pydantic types it as maybe taking the validated data; ours take none
        value = info.default_factory()  # type: ignore[call-arg]
    elif info.default is PydanticUndefined:
        return "**required**"
    else:
        value = info.default
    return f"`{json.dumps(_jsonable(value))}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _doc(model: type[BaseModel]) -> str:
    doc = model.__dict__.get("__doc__")
    if not doc:
        return ""
    return " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())


# -- the walk --------------------------------------------------------------------------------


def _variant_tag(model: type[BaseModel], discriminator: str | None) -> str:
    for name, info in model.model_fields.items():
        if discriminator is not None and name != discriminator:
            continue
        tp, _ = _strip(info.annotation)
        if get_origin(tp) is Literal and len(get_args(tp)) == 1:
            return f"{name}: {get_args(tp)[0]}"
    return model.__name__


def _discriminator(info: FieldInfo) -> str | None:
    if isinstance(info.discriminator, str):
        return info.discriminator
    _, _, meta = _members(info.annotation)
    for item in meta:
        if isinstance(item, FieldInfo) and isinstance(item.discriminator, str):
            return item.discriminator
    return None


def walk(model: type[BaseModel], prefix: str, title: str | None = None) -> list[Table]:
    """The tables of ``model`` at dotted ``prefix``: its own first, then one per union variant."""
    table = Table(prefix, title or f"`{prefix}`", _doc(model))
    tables = [table]
    _fill(model, prefix, table, tables)
    return tables


def _fill(
    model: type[BaseModel], prefix: str, table: Table, tables: list[Table], within: str = ""
) -> None:
    """Rows of ``model`` into ``table``; ``within`` names the enclosing variant, if any."""
    for name, info in model.model_fields.items():
        if info.exclude:
            continue
        key = f"{prefix}.{name}" if prefix else name
        members, nullable, _ = _members(info.annotation)
        models = [m for m in members if _is_model(m)]
        if len(members) == 1 and models:  # a nested section: flatten it into this table
            if nullable:  # an optional section: say so, since its keys alone cannot
                table.rows.append(
                    Row(key, f"{models[0].__name__} or null", _default(info), "",
                        info.description or "")
                )  # fmt: skip
            _fill(models[0], key, table, tables, within)
            continue
        if models and len(models) == len(members):  # a union of models: a table per variant
            disc = _discriminator(info)
            table.rows.append(
                Row(
                    key,
                    " or ".join(m.__name__ for m in models) + (" or null" if nullable else ""),
                    _default(info),
                    f"chosen by `{disc}`" if disc else "",
                    (info.description or "") + " One table per variant below.",
                )
            )
            for m in models:
                variant = _variant_tag(m, disc)
                where = f"; in {within}" if within else ""
                sub = Table(key, f"`{key}` ({variant}{where})", _doc(m), variant=variant)
                tables.append(sub)
                _fill(m, key, sub, tables, f"`{key}` {variant}")
            continue
        type_name = " or ".join(_type_name(m) for m in members) + (" or null" if nullable else "")
        item = _list_item_model(members)
        if item is not None:  # a list of sections (run.roles), or one among types: key[].x
            table.rows.append(
                Row(key, type_name, _default(info), _constraints(info), info.description or "")
            )
            _fill(item, f"{key}[]", table, tables, within)
            continue
        table.rows.append(
            Row(key, type_name, _default(info), _constraints(info), info.description or "")
        )


def _list_item_model(members: list[Any]) -> type[BaseModel] | None:
    """The model of the one list of models among ``members`` (a ``str | list[Model]`` field
    too), if there is one."""
    lists = [m for m in members if get_origin(m) is list]
    if len(lists) == 1:
        (arg,) = get_args(lists[0])
        arg, _ = _strip(arg)
        if _is_model(arg):
            return typing.cast(type[BaseModel], arg)
    return None


def sections() -> list[tuple[str, type[BaseModel], str]]:
    """(section, model, where it comes from) for ``cluster``, ``run`` and every built-in role."""
    from .roles_registry import builtin_roles, load_role_config
    from .runtime.config import ClusterConfig, RunConfig

    out: list[tuple[str, type[BaseModel], str]] = [
        ("cluster", ClusterConfig, "`laminar.runtime.config.ClusterConfig`: read by every process"),
        ("run", RunConfig, "`laminar.runtime.config.RunConfig`: read by `laminar run` only"),
    ]
    for name in builtin_roles():
        _, model = load_role_config(name)
        out.append((name, model, f"`{model.__module__}.{model.__name__}`: the {name} role"))
    return out


def all_tables() -> list[Table]:
    tables: list[Table] = []
    for name, model, _ in sections():
        tables.extend(walk(model, name))
    return tables


def leaf_keys(tables: list[Table] | None = None) -> list[str]:
    return [row.key for t in tables or all_tables() for row in t.rows]


def missing_descriptions(tables: list[Table] | None = None) -> list[str]:
    """Dotted keys (with their variant) whose field has no ``description``."""
    out = []
    for t in tables or all_tables():
        for row in t.rows:
            if not row.description.strip():
                out.append(f"{row.key} ({t.variant})" if t.variant else row.key)
    return out


def iter_models(model: type[BaseModel]) -> Iterator[type[BaseModel]]:
    """``model`` and every model reachable through its fields (for completeness checks)."""
    seen: set[type[BaseModel]] = set()
    todo = [model]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        yield m
        for info in m.model_fields.values():
            todo.extend(_reachable(info.annotation))


def _reachable(tp: Any) -> list[type[BaseModel]]:
    tp, _ = _strip(tp)
    if _is_model(tp):
        return [tp]
    return [m for a in get_args(tp) for m in _reachable(a)]


# -- rendering -------------------------------------------------------------------------------

PREAMBLE = """\
# Configuration reference

<!-- Generated from the pydantic models by `{regen}`.
     Do not edit by hand: tests/unit/test_config_reference.py fails when this file is stale. -->

One YAML file describes a cluster. `laminar run CONFIG` starts every role it lists on this
machine; `laminar serve --role R --config CONFIG` starts one role, which reads `cluster` and its
own section (`--section` picks another, e.g. two rollout pools with different engines).

| YAML section | read by | validated by |
|---|---|---|
{section_rows}

Conventions:

* **Overrides.** `--set a.b=c` (repeatable, on `laminar run`, `serve`, `status` and `repack`)
  sets one key before validation; the value is parsed as YAML, so `--set trainer.optim.lr=1e-5`
  is a float, `--set data.epochs=null` is null and `--set 'manager.repack={{enabled: false}}'` is a
  mapping. Numeric path parts index lists: `--set run.roles.4.count=8`.
* **Unknown keys are errors.** Every model forbids extra keys, so a typo fails at startup instead
  of being ignored. Role sections are validated when the role starts (and by `laminar run`
  before it starts anything). Errors name the dotted key, the value found and what was expected:

  ```text
  invalid configuration in /path/config.yaml:
    trainer.optim.lr = -1: Input should be greater than 0
    trainer.batch.prompt: unknown key (value 8)
    data.prompts: required, but missing
  ```

* **Secrets are not configuration.** The cluster token comes from the environment variable named
  by `cluster.token_env` (default `LAMINAR_TOKEN`, at least 16 random characters; placeholders
  and patterns are refused), never from the file.
* **Per-role service keys.** Every role section has `bind`, `metrics` and `instance` (from
  `ServiceConfig`); `laminar serve --bind` overrides `bind`.
* **Tables.** Keys are dotted paths from the top of the file; `key[].x` is a key of each item of
  a list. A key whose value is one of several models (an engine's `backend`, a length
  distribution's `kind`) has one table per variant: pick the variant with its tag, then use that
  table's keys. Constraints: `>=`/`>`/`<=`/`<` bounds and `one of` the allowed values.
"""


def render() -> str:
    secs = sections()
    section_rows = "\n".join(
        f"| [`{name}`](#{name}) | {where.split(': ', 1)[1]} | {where.split(': ', 1)[0]} |"
        for name, _, where in secs
    )
    parts = [PREAMBLE.format(regen=REGENERATE, section_rows=section_rows)]
    for name, model, _ in secs:
        parts.append(f"## {name}\n")
        for table in walk(model, name):
            if table.variant:
                parts.append(f"### {table.title}\n")
            if table.doc:
                parts.append(f"{table.doc}\n")
            parts.append(_render_rows(table.rows))
    return "\n".join(parts).rstrip() + "\n"


def _render_rows(rows: list[Row]) -> str:
    lines = ["| key | type | default | constraints | description |", "|---|---|---|---|---|"]
    for r in rows:
        cells = [f"`{r.key}`", r.type, r.default, r.constraints, r.description]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def check(path: Path, expected: str, regenerate: str) -> int:
    """0 when ``path`` holds ``expected``; else 1, with the start of a diff and the fix."""
    actual = path.read_text() if path.is_file() else ""
    if actual == expected:
        return 0
    diff = difflib.unified_diff(
        actual.splitlines(), expected.splitlines(), str(path), "generated", lineterm="", n=1
    )
    shown = list(diff)[:40]
    print("\n".join(shown), file=sys.stderr)
    print(f"\n{path} is stale: regenerate it with `{regenerate}`", file=sys.stderr)
    return 1


def generator_main(
    doc: str | None, render_doc: Callable[[], str], regenerate: str, argv: list[str] | None
) -> int:
    """The command line of a generated page: print it, or ``--check FILE`` against it."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    parser.add_argument("--check", metavar="FILE", help="exit 1 if FILE is not up to date")
    args = parser.parse_args(argv)
    text = render_doc()
    if args.check:
        return check(Path(args.check), text, regenerate)
    sys.stdout.write(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    return generator_main(__doc__, render, REGENERATE, argv)


if __name__ == "__main__":
    raise SystemExit(main())
