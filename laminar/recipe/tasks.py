"""Load a task module by path or name, and check it offers what the recipe needs.

A *task* is a plain Python module (see ``examples/arith/task.py``) with:

* ``ALPHABET: str`` — every character a prompt or response may contain (builds the tokenizer);
* ``generate(n, seed[, split])`` — ``n`` records, dicts with at least ``id``, ``prompt``,
  ``answer`` (and, for per-bucket reports, ``steps``), or a chat task's rows in verl's layout
  (``steps`` in ``extra_info``); deterministic in its arguments;
* ``demonstration(record) -> str`` — the target response for supervised warm start (its length
  also sizes an evaluation's token budget);
* optionally ``sft_demonstration(record) -> str`` — the warm start's target instead, when the
  task teaches it more than one way to answer (``examples/chat``: some answers skip the working);
* ``reward(record, response) -> float`` — the verifier;
* optionally ``CHAT_TEMPLATE = "chatml"`` — a chat task: each record's ``prompt`` is a list of
  messages, rendered with that template (:mod:`.chat`), and responses end with its end of turn.

Why a module and not a class: the reward runs in other processes (the data role), which import it
by ``module:function`` or ``file.py:function``; a module-level function is importable and picklable
there with no state to rebuild.

Held-out records: when ``generate`` takes a ``split`` argument, the task owns the separation
(``split="test"``); otherwise the recipe draws test records from a far-away seed
(:data:`TEST_SEED_OFFSET`) and drops training records whose prompt is among the first
:data:`HELD_OUT` test records of seed 0.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from types import ModuleType
from typing import Any

from laminar.runtime.errors import ConfigError

from .chat import ChatFormat, chat_format, check_messages, render_prompt
from .tokenizer import EOS

Record = dict[str, Any]
TEST_SEED_OFFSET = 1_000_003
#: without task-side splits: how many test records (from seed 0) are kept out of training
HELD_OUT = 5000
REQUIRED = ("ALPHABET", "generate", "demonstration", "reward")


def _load_file(path: Path) -> ModuleType:
    path = path.resolve()
    name = f"laminar_task_{path.parent.name}_{path.stem}".replace("-", "_")
    module = sys.modules.get(name)
    if module is not None and getattr(module, "__file__", None) == str(path):
        return module
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"task {path}: cannot load it as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise ConfigError(f"task {path}: importing it raised {type(exc).__name__}: {exc}") from exc
    return module


def load_task_module(spec: str) -> ModuleType:
    """``path/to/task.py``, a directory holding ``task.py``, or a dotted module name."""
    path = Path(spec)
    if path.is_dir():
        path = path / "task.py"
        if not path.is_file():
            raise ConfigError(f"task {spec!r}: directory has no task.py")
        return _load_file(path)
    if spec.endswith(".py"):
        if not path.is_file():
            raise ConfigError(f"task {spec!r}: file does not exist")
        return _load_file(path)
    try:
        return importlib.import_module(spec)
    except ImportError as exc:
        raise ConfigError(
            f"task {spec!r}: not a file, a directory with task.py, or an importable module ({exc})"
        ) from exc


@dataclass(frozen=True)
class Task:
    """A loaded task module plus the recipe's uniform view of its splits."""

    spec: str
    module: ModuleType

    @property
    def alphabet(self) -> str:
        return str(self.module.ALPHABET)

    @property
    def reward(self) -> Callable[[Record, str], float]:
        return self.module.reward

    def demonstration(self, record: Record) -> str:
        return str(self.module.demonstration(record))

    def sft_target(self, record: Record) -> str:
        """What SFT trains on for ``record``: the task's ``sft_demonstration`` if it has one,
        else its :meth:`demonstration`."""
        own = getattr(self.module, "sft_demonstration", None)
        return self.demonstration(record) if own is None else str(own(record))

    @cached_property
    def chat(self) -> ChatFormat | None:
        """The chat format of a chat task (its ``CHAT_TEMPLATE``), None for a text task."""
        name = getattr(self.module, "CHAT_TEMPLATE", None)
        return None if name is None else chat_format(name, f"task {self.spec!r}")

    @property
    def end_token(self) -> str:
        """The token a response ends with: the chat format's end of turn, else ``<eos>``."""
        return EOS if self.chat is None else self.chat.end_of_turn

    def prompt_text(self, record: Record) -> str:
        """The text the model is given for ``record``: its prompt, or for a chat task its
        messages rendered with the template and its generation prompt."""
        prompt = record["prompt"]
        if self.chat is None:
            return str(prompt)
        index = record.get("extra_info", {}).get("index") if "id" not in record else None
        where = f"task {self.spec!r}, record {record.get('id', index)!r}"
        return render_prompt(self.chat, check_messages(prompt, where))

    @property
    def environment(self) -> Any:
        """The task's ``ENVIRONMENT`` (a ``laminar.tools.env.Environment`` subclass: a
        multi-turn task, evaluated by :mod:`.episodes`), or None (single-turn)."""
        return getattr(self.module, "ENVIRONMENT", None)

    @property
    def max_turns(self) -> int:
        return int(getattr(self.module, "MAX_TURNS", 8))

    @property
    def sft_curriculum(self) -> list[tuple[int, dict[str, Any]]]:
        """The task's ``SFT_CURRICULUM``: ``(until_step, generate knobs)`` stages, in order; after
        the last, training draws from the task's own distribution. Empty if it has none."""
        stages = getattr(self.module, "SFT_CURRICULUM", None) or []
        out = []
        for stage in stages:
            well_formed = isinstance(stage, tuple | list) and len(stage) == 2
            if not (well_formed and isinstance(stage[1], dict)):
                raise ConfigError(f"task {self.spec!r}: SFT_CURRICULUM entries are "
                                  f"(until_step, {{generate knobs}}), not {stage!r}")  # fmt: skip
            out.append((int(stage[0]), dict(stage[1])))
        return out

    @cached_property
    def has_splits(self) -> bool:
        """Whether the task's ``generate`` takes ``split`` (and so keeps test problems apart)."""
        try:
            return "split" in inspect.signature(self.module.generate).parameters
        except (TypeError, ValueError):  # pragma: no cover - builtins without signatures
            return False

    @cached_property
    def _held_out_prompts(self) -> frozenset[str]:
        return frozenset(_prompt_key(r) for r in self.test_records(HELD_OUT))

    def test_records(self, n: int, seed: int = 0) -> list[Record]:
        """``n`` held-out records (never produced by :meth:`train_records`)."""
        if self.has_splits:
            return list(self.module.generate(n, seed, split="test"))
        return list(self.module.generate(n, seed + TEST_SEED_OFFSET))

    def train_records(self, n: int, seed: int, **knobs: Any) -> list[Record]:
        """``n`` training records, none with the prompt of a held-out record. ``knobs`` go to the
        task's ``generate`` (a curriculum stage's settings, see :attr:`sft_curriculum`)."""
        if self.has_splits:
            return list(self.module.generate(n, seed, split="train", **knobs))
        exclude = self._held_out_prompts
        want = n
        while want <= 64 * n:
            records = self.module.generate(want, seed, **knobs)
            out = [r for r in records if _prompt_key(r) not in exclude]
            if len(out) >= n:
                return out[:n]
            want *= 2
        raise ConfigError(f"task {self.spec!r}: almost every generated prompt is a test prompt")


def _prompt_key(record: Record) -> str:
    """A record's prompt as a string to compare (a chat prompt's messages as JSON)."""
    prompt = record["prompt"]
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


def load_task(spec: str) -> Task:
    """Load and validate a task; raises :class:`ConfigError` naming what is missing."""
    module = load_task_module(spec)
    missing = [name for name in REQUIRED if not hasattr(module, name)]
    if missing:
        raise ConfigError(f"task {spec!r} lacks {', '.join(missing)} (see laminar.recipe.tasks)")
    return Task(spec=spec, module=module)


def read_jsonl(path: str | Path) -> list[Record]:
    """Records from a JSON-lines file (blank lines skipped)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no such file: {path}")
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{lineno}: not JSON ({exc.msg})") from exc
    return rows


def check_chat_model(model_dir: Path, task: Task) -> None:
    """Refuse a model directory whose chat template is not the task's: the recipe would train or
    evaluate on prompts the data role renders differently. A text task takes any model."""
    fmt = task.chat
    if fmt is None:
        return
    config = model_dir / "tokenizer_config.json"
    try:
        template = json.loads(config.read_text()).get("chat_template")
    except (OSError, json.JSONDecodeError, AttributeError):
        template = None
    if template != fmt.template:
        found = "no chat template" if not template else "another chat template"
        raise ConfigError(
            f"task {task.spec!r} is a chat task ({fmt.name}) but {config} has {found}: build the "
            f"model with `laminar model init --task {task.spec}`"
        )
