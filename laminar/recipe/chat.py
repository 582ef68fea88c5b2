"""Chat models in the recipe: the ChatML format a task may ask for, and its prompts rendered.

A task module that sets ``CHAT_TEMPLATE = "chatml"`` is a chat task: its records' ``prompt`` is a
list of messages (verl's layout), ``laminar model init`` gives its tokenizer ChatML's special
tokens and writes the template into ``tokenizer_config.json``, and ``laminar sft`` and
``laminar eval`` (and the trainer's held-out evaluation) render each prompt with that template
and its generation prompt, as the data role renders it from the model directory
(``docs/data.md``, *Chat prompts*). The assistant's turn ends with ``<|im_end|>``: SFT appends it
to each demonstration, evaluation stops there, and the model's ``generation_config.json`` lists it
first among the ids the rollouts' engine stops at.

Rendering is transformers' Jinja renderer (the one ``apply_chat_template`` uses), imported on
first use. Role names are written as text, so a character tokenizer spells them out, as a real
model's tokenizer writes them with ordinary tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from laminar.runtime.errors import ConfigError

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

#: ChatML, as Qwen's instruct models write it without tools: each message in its own turn, and
#: the assistant's turn opened for the model to write
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
#: roles a chat task's prompt messages may have (the template writes each the same way)
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ChatFormat:
    """A chat template and what a tokenizer needs to write it."""

    name: str
    template: str
    special_tokens: tuple[str, ...]  # added to the tokenizer as special tokens
    end_of_turn: str  # ends the assistant's turn: SFT's last target token, where decoding stops
    text: str  # the characters the template writes around the messages (role names, newlines)


FORMATS = {
    "chatml": ChatFormat(
        name="chatml",
        template=CHATML_TEMPLATE,
        special_tokens=(IM_START, IM_END),
        end_of_turn=IM_END,
        text="".join(ROLES) + "\n",
    )
}


def chat_format(name: str, where: str) -> ChatFormat:
    """The format ``name`` (``where`` names who asked, for the error)."""
    fmt = FORMATS.get(str(name).lower())
    if fmt is None:
        raise ConfigError(
            f"{where}: CHAT_TEMPLATE {name!r} is not one the recipe builds; known: "
            f"{', '.join(FORMATS)}"
        )
    return fmt


def check_messages(value: Any, where: str) -> list[dict[str, str]]:
    """A record's prompt checked as chat messages: a non-empty list of ``{"role", "content"}``
    with known roles and string contents, ending with a turn the model answers."""
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where}: a chat prompt must be a non-empty list of messages")
    out = []
    for i, message in enumerate(value):
        role = message.get("role") if isinstance(message, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        if role not in ROLES or not isinstance(content, str):
            raise ConfigError(
                f"{where}: message {i} must be an object with a role among {', '.join(ROLES)} "
                f"and a string content, not {message!r:.80}"
            )
        out.append({"role": role, "content": content})
    if out[-1]["role"] == "assistant":
        raise ConfigError(f"{where}: the last message is the assistant's; the model answers it")
    return out


def render_prompt(fmt: ChatFormat, messages: list[dict[str, str]]) -> str:
    """The prompt's text: ``messages`` in the template, then its generation prompt."""
    from transformers.utils.chat_template_utils import render_jinja_template

    # annotated as returning a str; it returns (the renderings, their generation indices)
    out: Any = render_jinja_template(
        conversations=[messages], chat_template=fmt.template, add_generation_prompt=True
    )
    return str(out[0][0])
