"""Chat prompts: messages rendered with the model's chat template, and an environment's
observation rendered as the template's next turn. Users' view: ``docs/data.md``.

The template is the model's (``chat_template`` in ``tokenizer_config.json``, or
``chat_template.jinja`` beside it) or a file the config names. Rendering is transformers'
``apply_chat_template`` (its Jinja sandbox and helpers, so a template behaves as it does
everywhere else) on a tokenizer loaded from the local directory; transformers is imported only
when a template is in use. The rendered text is then encoded by the data role's own tokenizer
*without* adding special tokens: a template that writes the BOS token itself would otherwise get
a second one from the tokenizer's post-processor.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from laminar.runtime.errors import ConfigError

#: roles a prompt's message may have (the template decides how each is written)
ROLES = ("system", "user", "assistant", "tool")
#: stand-ins for a conversation's contents when only the template's own text around them is
#: wanted (an observation's turn): plain words, so no template trims or escapes them
_USER = "LaminarUserTurnMarker"
_ASSISTANT = "LaminarAssistantTurnMarker"
_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


class ChatTemplate:
    """The model's chat template with the data role's settings (system prompt, template
    variables), and the tokenizer its renderings are encoded with."""

    def __init__(
        self,
        renderer: Any,
        tokenizer: Any,
        *,
        source: str,
        system_prompt: str | None = None,
        variables: dict[str, Any] | None = None,
    ) -> None:
        self._renderer = renderer  # a transformers tokenizer: renders, never encodes
        self.tokenizer = tokenizer
        self.source = source  # where the template came from, for messages
        self.system_prompt = system_prompt
        self.variables = dict(variables or {})

    @classmethod
    def load(
        cls,
        tokenizer_path: str | Path,
        setting: str,
        tokenizer: Any,
        *,
        system_prompt: str | None = None,
        variables: dict[str, Any] | None = None,
    ) -> ChatTemplate | None:
        """The template ``setting`` names (``auto``, ``none`` or a file) for the model whose
        tokenizer is at ``tokenizer_path``; None when there is none to use."""
        path = Path(tokenizer_path)
        model_dir = path if path.is_dir() else path.parent
        if setting == "none":
            return None
        if setting == "auto":
            if not _has_template(model_dir):
                return None
            text, source = None, f"the chat template of {model_dir}"
        else:
            file = Path(setting)
            if not file.is_file():
                raise ConfigError(f"data.chat_template: no template file at {file}")
            text, source = file.read_text(), str(file)
        renderer = _renderer(model_dir, path)
        jinja = model_dir / _TEMPLATE_FILES[0]
        if text is None and not renderer.chat_template and jinja.is_file():
            text = jinja.read_text()  # a transformers that predates the separate file
        if text is not None:
            renderer.chat_template = text
        if not renderer.chat_template:
            return None
        return cls(
            renderer, tokenizer, source=source, system_prompt=system_prompt, variables=variables
        )

    @property
    def text(self) -> str:
        """The template itself (named templates as JSON), for the dataset's fingerprint."""
        template = self._renderer.chat_template
        return template if isinstance(template, str) else json.dumps(template, sort_keys=True)

    # -- prompts -----------------------------------------------------------------------------

    def messages(self, value: Any, where: str) -> list[dict[str, Any]]:
        """``value`` checked as a prompt's list of messages (``where`` names the record), with
        the system prompt first if it has none. Fields that are None (a Parquet column other
        rows fill) are dropped, as absent."""
        if not isinstance(value, list) or not value:
            raise ConfigError(f"{where}: a chat prompt must be a non-empty list of messages")
        out = []
        for i, message in enumerate(value):
            if not isinstance(message, dict):
                raise ConfigError(
                    f"{where}: message {i} must be an object with 'role' and 'content', got "
                    f"{type(message).__name__} {message!r:.60}"
                )
            role, content = message.get("role"), message.get("content")
            if role not in ROLES:
                raise ConfigError(
                    f"{where}: message {i} has role {role!r}; expected one of {', '.join(ROLES)}"
                )
            if not isinstance(content, str):
                raise ConfigError(
                    f"{where}: message {i} ({role}) must have a string 'content', got "
                    f"{type(content).__name__} {content!r:.60}"
                )
            out.append({k: v for k, v in message.items() if v is not None})
        if out[-1]["role"] == "assistant":
            raise ConfigError(
                f"{where}: the last message is the assistant's; a prompt ends with the turn the "
                "model answers (a user's or a tool's message)"
            )
        if self.system_prompt is not None and out[0]["role"] != "system":
            out.insert(0, {"role": "system", "content": self.system_prompt})
        return out

    def render(self, messages: list[dict[str, Any]], where: str) -> str:
        """The prompt's text: ``messages`` (checked, see :meth:`messages`) and the template's
        generation prompt."""
        try:
            return self._render(self.messages(messages, where))
        except ConfigError:
            raise
        except Exception as exc:  # the template's own error (raise_exception, a bad variable)
            raise ConfigError(
                f"{where}: {self.source} could not render the messages: {type(exc).__name__}: {exc}"
            ) from None

    def encode(self, messages: list[dict[str, Any]], where: str) -> list[int]:
        """The prompt's token ids: rendered, then encoded without adding special tokens."""
        text = self.render(messages, where)
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    # -- an environment's turn ---------------------------------------------------------------

    def observation_ids(self, observation: str, role: str, after: int | None) -> list[int]:
        """The tokens that follow a model turn ending with token ``after``: the rest of the
        assistant's turn as the template closes it, ``observation`` as a ``role`` message, and
        the generation prompt of the next assistant turn.

        Found as the template's text after an assistant message's content in a conversation
        that goes on with the observation (the same conversation rendered with and without the
        new message, compared after the assistant's content). A token the model wrote itself
        (``after``, its end-of-turn token) is not repeated; a turn that ended elsewhere (a tool
        call's stop string) is closed as the template closes it."""
        ids = self._after_assistant(observation, role)
        if ids and ids[0] == after:
            ids = ids[1:]
        return ids

    def end_of_turn_id(self) -> int | None:
        """The special token the template ends an assistant's turn with (``<|im_end|>``), or
        None if it ends turns with plain text."""
        ids = self._after_assistant("x", "user")
        if not ids:
            return None
        special = self.tokenizer.get_added_tokens_decoder().get(ids[0])
        return ids[0] if special is not None and special.special else None

    def _after_assistant(self, observation: str, role: str) -> list[int]:
        conversation = [
            {"role": "user", "content": _USER},
            {"role": "assistant", "content": _ASSISTANT},
            {"role": role, "content": observation},
        ]
        if self.system_prompt is not None:
            conversation.insert(0, {"role": "system", "content": self.system_prompt})
        text = self._render(conversation)
        at = text.find(_ASSISTANT)
        if at < 0:
            raise ConfigError(
                f"{self.source} does not write an assistant message's content as it is: an "
                "environment's observations cannot be placed after a model turn"
            )
        rest = text[at + len(_ASSISTANT) :]
        return list(self.tokenizer.encode(rest, add_special_tokens=False).ids)

    def _render(self, messages: list[dict[str, Any]]) -> str:
        return str(
            self._renderer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **self.variables
            )
        )


def _has_template(model_dir: Path) -> bool:
    """Whether the model directory carries a chat template (read without transformers)."""
    if any((model_dir / name).is_file() for name in _TEMPLATE_FILES):
        return True
    if (model_dir / "additional_chat_templates").is_dir():
        return True
    config = model_dir / "tokenizer_config.json"
    if not config.is_file():
        return False
    try:
        return bool(json.loads(config.read_text()).get("chat_template"))
    except (json.JSONDecodeError, AttributeError) as exc:
        raise ConfigError(f"{config} is not a JSON object ({exc})") from None


def _renderer(model_dir: Path, tokenizer_path: Path) -> Any:
    """A transformers tokenizer over the same tokenizer file, with the directory's
    tokenizer_config.json (special tokens the template refers to, its template) if any."""
    from transformers import PreTrainedTokenizerFast

    file = tokenizer_path if tokenizer_path.is_file() else model_dir / "tokenizer.json"
    try:
        if file.name == "tokenizer.json" and (model_dir / "tokenizer_config.json").is_file():
            return PreTrainedTokenizerFast.from_pretrained(str(model_dir), local_files_only=True)
        return PreTrainedTokenizerFast(tokenizer_file=str(file))
    except Exception as exc:  # transformers' loading errors have no common base
        raise ConfigError(
            f"could not load the tokenizer at {model_dir} for its chat template: "
            f"{type(exc).__name__}: {exc}"
        ) from None
