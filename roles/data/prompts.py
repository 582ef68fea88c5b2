"""The prompt set: a dataset's records checked, given ids and tokenized once, for the store.

A record (read by :mod:`.records`: JSONL, JSON, Parquet, a ``datasets`` directory) has an id and
a prompt, at fields the config names (dotted paths reach into nested fields); every other field is
kept and handed to the reward function (the answer, verl's ``reward_model``, ...). The prompt is
a string, tokenized as it is or as one user message (``data.string_prompts``), or a list of chat
messages rendered with the model's chat template (:mod:`.chat`). Users' view: ``docs/data.md``.

Bad input is a :class:`ConfigError` naming the file, the record and the problem, before anything
is stored:

* an id that is missing, empty, not a string or integer, repeated, or that contains ``/`` or ends
  like the epoch suffix ``~e<n>`` (the data role names a prompt's repeat in epoch n
  ``{id}~e{n}``: prompt ``a~e1`` would be the same group as prompt ``a`` in epoch 1). A dataset
  none of whose records has the default id field ``id`` gets row numbers as ids;
* a prompt that is neither a string nor a list of messages, malformed messages, messages without
  a chat template, or a prompt that tokenizes to nothing;
* a field that is not JSON (a Parquet timestamp, decimal or binary column): the record is stored
  and handed to the reward function as JSON.

Prompts are left out, and counted, when longer than ``max_prompt_tokens``, and, with
``max_model_len`` (the rollouts' context length) known, when they leave no room for a response
(``tokens >= max_model_len``: no engine could ever generate them) under the ``skip`` policy; the
``refuse`` policy makes those an error naming the first. A prompt that fits but leaves less than
``max_tokens`` gets a response cut at the context limit (finish reason ``length``), as every
engine does; that is allowed. Leaving out every prompt is an error.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from laminar.engines.checkpoint import eos_token_ids
from laminar.runtime.errors import ConfigError

from .chat import ChatTemplate
from .config import DataConfig
from .records import MISSING, has_field, read_records
from .records import field as record_field

__all__ = [
    "EPOCH_SUFFIX",
    "REASONS",
    "LeftOut",
    "LoadedPrompts",
    "PromptSet",
    "fingerprint",
    "load_prompts",
    "load_tokenizer",
    "prepare_prompts",
    "read_records",
    "resolve_id_key",
]

EPOCH_SUFFIX = re.compile(r"~e\d+$")  # what the store appends to a prompt id after epoch 0
DEFAULT_ID_KEY = "id"

Row = tuple[str, dict[str, Any], list[int]]
Reason = Literal["max_prompt_tokens", "max_model_len"]
REASONS: tuple[Reason, ...] = ("max_prompt_tokens", "max_model_len")  # why a prompt is left out


@dataclass(frozen=True)
class LeftOut:
    """A prompt left out at load, and why."""

    index: int  # the record's position in the dataset
    prompt_id: str
    tokens: int
    reason: Reason


@dataclass
class PromptSet:
    """What a dataset gives the store: ``(id, record, prompt token ids)`` rows, and what was
    left out."""

    rows: list[Row] = field(default_factory=list)
    left_out: list[LeftOut] = field(default_factory=list)
    rendered: int = 0  # prompts rendered with the chat template
    as_text: int = 0  # string prompts tokenized as they are


@dataclass
class LoadedPrompts:
    """The data role's prompts as configured: the set, and what made it."""

    tokenizer: Any
    chat: ChatTemplate | None  # the chat template in use, if any
    prompts: PromptSet
    fingerprint: str  # the store refuses another prompt set (``Store.load_prompts``)
    row_ids: bool  # ids are row numbers (no record has the id field)
    stop_warning: str | None  # the template ends turns with a token the engine does not stop at


def load_prompts(c: DataConfig) -> LoadedPrompts:
    """Read, check and tokenize the dataset ``c`` names, with its chat template if one is in
    use (``data.chat_template``, ``string_prompts``, ``system_prompt``)."""
    tokenizer = load_tokenizer(c.tokenizer)
    chat = ChatTemplate.load(
        c.tokenizer,
        c.chat_template,
        tokenizer,
        system_prompt=c.system_prompt,
        variables=c.chat_template_kwargs,
    )
    if chat is None and (c.system_prompt is not None or c.string_prompts == "user"):
        raise ConfigError(
            f"data.system_prompt and data.string_prompts: user need a chat template, and the "
            f"model at {c.tokenizer} has none (no chat_template in tokenizer_config.json, no "
            "chat_template.jinja): name a template file in data.chat_template"
        )
    records = read_records(c.prompts, split=c.split)
    id_key = resolve_id_key(records, c.id_key)
    prompts = prepare_prompts(
        records,
        tokenizer,
        id_key=id_key,
        prompt_key=c.prompt_key,
        source=c.prompts,
        max_prompt_tokens=c.max_prompt_tokens,
        max_model_len=c.max_model_len,
        overlong=c.overlong_prompts,
        chat=chat,
        string_prompts=c.string_prompts,
    )
    extra = f"{c.samples_per_prompt}/{c.seed}"
    if c.max_prompt_tokens is not None:  # another prompt set: another dataset
        extra += f"/{c.max_prompt_tokens}"
    # settings that change the prompt set, named only when they do (a store made before they
    # existed keeps its fingerprint)
    settings: dict[str, Any] = {}
    if id_key != DEFAULT_ID_KEY or c.prompt_key != "prompt":
        settings["keys"] = [id_key, c.prompt_key]
    if c.split is not None:
        settings["split"] = c.split
    if prompts.rendered and chat is not None:
        settings["chat"] = [chat.text, c.system_prompt, c.string_prompts, c.chat_template_kwargs]
    if any(x.reason == "max_model_len" for x in prompts.left_out):
        settings["fit"] = c.max_model_len
    if settings:
        extra += "/" + json.dumps(settings, sort_keys=True)
    return LoadedPrompts(
        tokenizer=tokenizer,
        chat=chat,
        prompts=prompts,
        fingerprint=fingerprint(c.prompts, c.tokenizer, extra=extra),
        row_ids=id_key is None,
        stop_warning=_stop_warning(chat, c.tokenizer) if prompts.rendered else None,
    )


def _stop_warning(chat: ChatTemplate | None, tokenizer_path: str) -> str | None:
    """Why rollouts would run past the end of an assistant's turn, if they would: the template
    ends it with a token the model's eos_token_id does not list (the engine stops only there)."""
    if chat is None or (end := chat.end_of_turn_id()) is None:
        return None
    path = Path(tokenizer_path)
    model_dir = path if path.is_dir() else path.parent
    eos = eos_token_ids(model_dir)
    if not eos or end in eos:
        return None
    return (
        f"{chat.source} ends an assistant's turn with {chat.tokenizer.id_to_token(end)!r} (id "
        f"{end}), which the model's eos_token_id {eos} (generation_config.json) does not list: "
        "generation will not stop at the end of a turn; add it there"
    )


def load_tokenizer(path: str | Path) -> Any:
    """A ``tokenizers.Tokenizer`` from ``tokenizer.json`` or a model directory holding one."""
    from tokenizers import Tokenizer

    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise ConfigError(f"no tokenizer at {p}")
    return Tokenizer.from_file(str(p))


def resolve_id_key(records: list[dict[str, Any]], id_key: str | None) -> str | None:
    """The field ids come from, or None for row numbers: ``id_key`` if set, else ``id``, unless
    no record has one (verl's layout has no id column)."""
    if id_key is not None:
        return id_key
    return DEFAULT_ID_KEY if any(has_field(r, DEFAULT_ID_KEY) for r in records) else None


def prepare_prompts(
    records: list[dict[str, Any]],
    tokenizer: Any,
    *,
    id_key: str | None,
    prompt_key: str,
    source: str,
    max_prompt_tokens: int | None = None,
    max_model_len: int | None = None,
    overlong: Literal["skip", "refuse"] = "refuse",
    chat: ChatTemplate | None = None,
    string_prompts: Literal["text", "user"] = "text",
) -> PromptSet:
    """Every record checked, given its id (``id_key``, or its row number when None) and
    tokenized, as the module docstring says."""
    out = PromptSet()
    seen: set[str] = set()
    too_long: list[LeftOut] = []
    for i, record in enumerate(records):
        raw_id = str(i) if id_key is None else record_field(record, id_key)
        prompt = record_field(record, prompt_key)
        for key, value in ((id_key, raw_id), (prompt_key, prompt)):
            if value is MISSING:
                raise ConfigError(f"{source}: record {i} lacks the field {key!r}")
        pid = _prompt_id(raw_id, source, i)
        if pid in seen:
            raise ConfigError(f"{source}: duplicate prompt id {pid!r} (record {i})")
        seen.add(pid)
        where = f"{source}: record {i} (prompt id {pid!r})"
        _check_json(record, where)
        ids = _prompt_tokens(prompt, tokenizer, chat, string_prompts, prompt_key, where, out)
        if not ids:
            raise ConfigError(f"{source}: prompt {pid!r} tokenizes to nothing")
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            out.left_out.append(LeftOut(i, pid, len(ids), "max_prompt_tokens"))
            continue
        if max_model_len is not None and len(ids) >= max_model_len:
            too_long.append(LeftOut(i, pid, len(ids), "max_model_len"))
            if overlong == "skip":
                out.left_out.append(too_long[-1])
                continue
        out.rows.append((pid, record, ids))
    if too_long and overlong == "refuse":
        first = too_long[0]
        assert max_model_len is not None
        raise ConfigError(
            f"{source}: {len(too_long)} prompt(s) leave no room for a response within the "
            f"rollouts' max_model_len {max_model_len}; the first: record {first.index} (prompt id "
            f"{first.prompt_id!r}, {first.tokens} tokens). Shorten them, raise max_model_len, or "
            f"leave them out (counted) with data.overlong_prompts: skip (or "
            f"data.max_prompt_tokens: {max_model_len - 1})"
        )
    if not out.rows:
        limits = [max_prompt_tokens] if max_prompt_tokens is not None else []
        if max_model_len is not None and overlong == "skip":
            limits.append(max_model_len - 1)
        longer = f" of at most {min(limits)} tokens" if limits and records else ""
        raise ConfigError(f"{source}: no prompts{longer} (of {len(records)} records)")
    return out


def _prompt_tokens(
    prompt: Any,
    tokenizer: Any,
    chat: ChatTemplate | None,
    string_prompts: Literal["text", "user"],
    prompt_key: str,
    where: str,
    out: PromptSet,
) -> list[int]:
    if isinstance(prompt, str) and string_prompts == "text":
        if chat is not None and chat.system_prompt is not None:
            raise ConfigError(
                f"{where}: the prompt is plain text, taken as it is (data.string_prompts: text), "
                "so data.system_prompt cannot be added to it; set data.string_prompts: user to "
                "render it as a user message with the chat template, or remove system_prompt"
            )
        out.as_text += 1
        return list(tokenizer.encode(prompt).ids)
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    elif not isinstance(prompt, list):
        raise ConfigError(
            f"{where}: {prompt_key!r} must be a string or a list of chat messages, got "
            f"{type(prompt).__name__} {prompt!r:.60}"
        )
    if chat is None:
        raise ConfigError(
            f"{where}: the prompt is a list of chat messages, but no chat template is in use (the "
            "model directory has none, or data.chat_template is none): name a template file in "
            "data.chat_template"
        )
    out.rendered += 1
    return chat.encode(prompt, where)


def _prompt_id(value: Any, source: str, i: int) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ConfigError(
            f"{source}: record {i}: the prompt id must be a string or an integer, "
            f"got {type(value).__name__} {value!r:.60}"
        )
    pid = str(value)
    if not pid:
        raise ConfigError(f"{source}: record {i}: the prompt id is empty")
    if "/" in pid:
        raise ConfigError(f"{source}: record {i}: prompt id {pid!r} must not contain '/'")
    if EPOCH_SUFFIX.search(pid):
        raise ConfigError(
            f"{source}: record {i}: prompt id {pid!r} ends like the epoch suffix ~e<n> that the "
            f"data role appends to a prompt's id after the first epoch (it would collide with "
            f"prompt {EPOCH_SUFFIX.sub('', pid)!r} in a later epoch); rename it"
        )
    return pid


def _check_json(record: dict[str, Any], where: str) -> None:
    """The record is stored and handed to the reward function as JSON: every field must be."""
    try:
        json.dumps(record)
    except (TypeError, ValueError):
        pass
    else:
        return
    for key, value in record.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"{where}: field {key!r} holds {type(value).__name__} {value!r:.60}, which is "
                f"not JSON ({exc}); convert it (e.g. to a string or a number) when writing the "
                "dataset"
            ) from None
    raise ConfigError(f"{where} is not JSON-serializable")


def fingerprint(dataset: str | Path, tokenizer: str | Path, extra: str = "") -> str:
    """What identifies a prompt set: the dataset's bytes (every file of a directory, by relative
    path), the tokenizer's, and ``extra`` (the settings that choose and tokenize the prompts)."""
    digest = hashlib.sha256(extra.encode())
    d = Path(dataset)
    if d.is_dir():
        for f in sorted(x for x in d.rglob("*") if x.is_file()):
            digest.update(str(f.relative_to(d)).encode() + b"\0")
            digest.update(f.read_bytes())
    else:
        digest.update(d.read_bytes())
    t = Path(tokenizer)
    if t.is_dir():
        t = t / "tokenizer.json"
    digest.update(t.read_bytes())
    return digest.hexdigest()[:16]
