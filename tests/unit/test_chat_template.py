"""Chat prompts (``roles/data/chat.py``): messages rendered with the model's template, one BOS,
the system prompt, plain strings, malformed messages, an environment's observation as the
template's next turn, and where the engine stops."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from laminar.roles.data.chat import ChatTemplate
from laminar.roles.data.config import DataConfig, EnvConfig
from laminar.roles.data.episodes import Episodes
from laminar.roles.data.prompts import load_prompts, load_tokenizer, prepare_prompts
from laminar.runtime.clock import RealClock
from laminar.runtime.errors import ConfigError
from laminar.tools.env import Environment, Step

from ..support.chat_model import CHATML, NO_TOOLS, SPECIALS, write_chat_tokenizer
from ..support.task import write_tokenizer

PROMPT = "<s><|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"


def chat_of(model: Path, setting: str = "auto", **kw: Any) -> tuple[ChatTemplate, Any]:
    tok = load_tokenizer(model)
    chat = ChatTemplate.load(model, setting, tok, **kw)
    assert chat is not None
    return chat, tok


def prepare(records: list[dict[str, Any]], tok: Any, chat: ChatTemplate | None, **kw: Any):
    return prepare_prompts(
        records, tok, id_key="id", prompt_key="prompt", source="p.jsonl", chat=chat, **kw
    )


def test_messages_render_with_the_template_and_one_bos(tmp_path: Path) -> None:
    chat, tok = chat_of(write_chat_tokenizer(tmp_path / "m"))
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert chat.render(messages, "r") == PROMPT
    ids = prepare([{"id": "a", "prompt": messages}], tok, chat).rows[0][2]
    bos = tok.token_to_id("<s>")
    assert ids.count(bos) == 1 and ids[0] == bos
    assert tok.decode(ids, skip_special_tokens=False) == PROMPT
    # what it guards against: the template writes <s>, and the tokenizer adds one of its own
    assert tok.encode(PROMPT).ids[:2] == [bos, bos]


def test_the_system_prompt_is_added_only_where_there_is_none(tmp_path: Path) -> None:
    chat, tok = chat_of(write_chat_tokenizer(tmp_path / "m"), system_prompt="Be brief.")
    records = [
        {"id": "a", "prompt": [{"role": "user", "content": "Hi"}]},
        {"id": "b", "prompt": [{"role": "system", "content": "Own."}, {"role": "user", "content": "Hi"}]},
    ]  # fmt: skip
    texts = [
        tok.decode(ids, skip_special_tokens=False) for _, _, ids in prepare(records, tok, chat).rows
    ]
    assert (
        texts[0]
        == "<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert (
        texts[1]
        == "<s><|im_start|>system\nOwn.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    # a plain-text prompt cannot take a system prompt: refused rather than silently dropped
    with pytest.raises(ConfigError, match=r"record 0 \(prompt id 'c'\).*system_prompt"):
        prepare([{"id": "c", "prompt": "Hi"}], tok, chat)
    # as one user message it can
    user = prepare([{"id": "c", "prompt": "Hi"}], tok, chat, string_prompts="user")
    assert tok.decode(user.rows[0][2], skip_special_tokens=False) == texts[0]
    assert user.rendered == 1 and user.as_text == 0


def test_plain_strings_are_text_or_one_user_message(tmp_path: Path) -> None:
    chat, tok = chat_of(write_chat_tokenizer(tmp_path / "m"))
    records = [{"id": "a", "prompt": "What is 2+2?"}]
    text = prepare(records, tok, chat)  # as it is, with the tokenizer's own BOS
    assert text.rows[0][2] == tok.encode("What is 2+2?").ids and text.as_text == 1
    user = prepare(records, tok, chat, string_prompts="user")
    assert tok.decode(user.rows[0][2], skip_special_tokens=False) == PROMPT


def test_where_the_template_comes_from(tmp_path: Path) -> None:
    beside = write_chat_tokenizer(tmp_path / "beside", in_config=False)  # chat_template.jinja
    chat, _ = chat_of(beside)
    assert chat.render([{"role": "user", "content": "What is 2+2?"}], "r") == PROMPT
    bare = write_tokenizer(tmp_path / "bare")  # tokenizer.json only: no template, strings work
    tok = load_tokenizer(bare)
    assert ChatTemplate.load(bare, "auto", tok) is None
    assert prepare([{"id": "a", "prompt": "1+1="}], tok, None).rows[0][2] == tok.encode("1+1=").ids
    with pytest.raises(ConfigError, match=r"record 0 \(prompt id 'a'\): .*no chat template"):
        prepare([{"id": "a", "prompt": [{"role": "user", "content": "1+1="}]}], tok, None)
    # a template file the config names, for a bare tokenizer.json
    file = tmp_path / "t.jinja"
    file.write_text(CHATML.replace("{{ bos_token }}", ""))
    named = ChatTemplate.load(bare, str(file), tok)
    assert named is not None
    assert named.render([{"role": "user", "content": "1"}], "r") == (
        "<|im_start|>user\n1<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ChatTemplate.load(write_chat_tokenizer(tmp_path / "off"), "none", tok) is None
    with pytest.raises(ConfigError, match="no template file"):
        ChatTemplate.load(bare, str(tmp_path / "missing.jinja"), tok)


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ([], "a chat prompt must be a non-empty list of messages"),
        (["hi"], "message 0 must be an object with 'role' and 'content'"),
        ([{"role": "robot", "content": "hi"}], "message 0 has role 'robot'"),
        ([{"role": "user"}], r"message 0 \(user\) must have a string 'content', got NoneType"),
        ([{"role": "user", "content": ["a"]}], r"message 0 \(user\) must have a string 'content', got list"),
        ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
         "the last message is the assistant's"),
        (7, "'prompt' must be a string or a list of chat messages, got int"),
    ],
)  # fmt: skip
def test_malformed_messages_name_the_record(tmp_path: Path, prompt: Any, match: str) -> None:
    chat, tok = chat_of(write_chat_tokenizer(tmp_path / "m"))
    records = [
        {"id": "ok", "prompt": [{"role": "user", "content": "x"}]},
        {"id": "bad", "prompt": prompt},
    ]
    with pytest.raises(ConfigError, match=r"p\.jsonl: record 1 \(prompt id 'bad'\): " + match):
        prepare(records, tok, chat)


def test_a_template_that_raises_names_the_record(tmp_path: Path) -> None:
    chat, tok = chat_of(write_chat_tokenizer(tmp_path / "m", template=NO_TOOLS))
    with pytest.raises(ConfigError, match=r"record 0 \(prompt id 'a'\): .*unknown role tool"):
        prepare([{"id": "a", "prompt": [{"role": "tool", "content": "x"}]}], tok, chat)


def test_chat_settings_without_a_template_are_refused(tmp_path: Path) -> None:
    base = {"prompts": "p.jsonl", "tokenizer": "m", "reward": "m:f"}
    with pytest.raises(ValidationError, match="need a chat template"):
        DataConfig(**base, chat_template="none", system_prompt="Be brief.")
    bare = write_tokenizer(tmp_path / "bare")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "1+1="}\n')
    config = DataConfig(
        prompts=str(prompts), tokenizer=str(bare), reward="m:f", string_prompts="user"
    )
    with pytest.raises(ConfigError, match=r"has none .*data\.chat_template"):
        load_prompts(config)


# -- an environment's observation --------------------------------------------------------------


class TurnEnv(Environment):
    """Every assistant message is a turn (ended by ``<|im_end|>``); answers ``=k``."""

    stop = ("<|im_end|>",)

    async def reset(self, record: dict[str, Any]) -> None:
        self.calls = 0

    async def step(self, action: str) -> Step:
        self.calls += 1
        return Step(observation=f"={self.calls}", reward=1.0, done=self.calls > 2)


class CallEnv(TurnEnv):
    """A turn ends at a tool call's stop string inside the assistant's message."""

    stop = ("?",)


def episodes(model: Path, env: str, role: str | None = "user", **chat: Any) -> tuple[Episodes, Any]:
    tok = load_tokenizer(model)
    template = ChatTemplate.load(model, "auto", tok, **chat)
    cfg = EnvConfig(spec=f"tests.unit.test_chat_template:{env}", observation_role=role)
    return Episodes(cfg, tok, CollectorRegistry(), RealClock(), chat=template), tok


async def test_an_observation_is_the_templates_next_turn(tmp_path: Path) -> None:
    model = write_chat_tokenizer(tmp_path / "m")
    host, tok = episodes(model, "TurnEnv")
    chat = host.chat
    assert chat is not None
    end = tok.token_to_id("<|im_end|>")
    messages = [{"role": "user", "content": "Add."}]
    prompt = chat.encode(messages, "r")
    response = [*tok.encode("12", add_special_tokens=False).ids, end]
    answer = await host.step("p/0", {"id": "p"}, response, [])
    assert tok.decode(answer.observation_token_ids, skip_special_tokens=False) == (
        "\n<|im_start|>user\n=1<|im_end|>\n<|im_start|>assistant\n"
    )
    # the whole context is exactly the template's rendering of the conversation so far
    conversation = [
        *messages,
        {"role": "assistant", "content": "12"},
        {"role": "user", "content": "=1"},
    ]
    assert prompt + response + answer.observation_token_ids == chat.encode(conversation, "r")


@pytest.fixture(scope="module")
def shared_chat(tmp_path_factory: pytest.TempPathFactory) -> tuple[ChatTemplate, Any]:
    return chat_of(write_chat_tokenizer(tmp_path_factory.mktemp("shared")))


@settings(max_examples=60, deadline=None)
@given(observation=st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40))
def test_any_observation_tokenizes_as_in_the_whole_conversation(
    shared_chat: tuple[ChatTemplate, Any], observation: str
) -> None:
    chat, tok = shared_chat
    assume(not any(t in observation for t in SPECIALS))
    messages = [{"role": "user", "content": "Add."}]
    response = [*tok.encode("12", add_special_tokens=False).ids, tok.token_to_id("<|im_end|>")]
    ids = chat.observation_ids(observation, "user", response[-1])
    conversation = [
        *messages,
        {"role": "assistant", "content": "12"},
        {"role": "user", "content": observation},
    ]
    assert chat.encode(messages, "r") + response + ids == chat.encode(conversation, "r")


async def test_a_tool_call_turn_is_closed_by_the_template(tmp_path: Path) -> None:
    host, tok = episodes(write_chat_tokenizer(tmp_path / "m"), "CallEnv", role="tool")
    response = tok.encode("7+8?", add_special_tokens=False).ids
    answer = await host.step("p/0", {"id": "p"}, response, [])
    assert tok.decode(answer.observation_token_ids, skip_special_tokens=False) == (
        "<|im_end|>\n<|im_start|>tool\n=1<|im_end|>\n<|im_start|>assistant\n"
    )


async def test_without_a_role_or_a_template_the_observation_is_plain_text(tmp_path: Path) -> None:
    host, tok = episodes(write_chat_tokenizer(tmp_path / "m"), "CallEnv", role=None)
    assert host.chat is None
    answer = await host.step(
        "p/0", {"id": "p"}, tok.encode("7+8?", add_special_tokens=False).ids, []
    )
    assert answer.observation_token_ids == tok.encode("=1", add_special_tokens=False).ids


def test_a_template_that_cannot_write_the_role_fails_at_start(tmp_path: Path) -> None:
    model = write_chat_tokenizer(tmp_path / "m", template=NO_TOOLS)
    with pytest.raises(ConfigError, match=r"cannot render an observation as a 'tool' message"):
        episodes(model, "TurnEnv", role="tool")
    host, _ = episodes(model, "TurnEnv", role="user")
    assert host.chat is not None


# -- where generation stops, and what the reward reads -----------------------------------------


def test_a_turn_end_the_engine_would_not_stop_at_is_warned_about(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": [{"role": "user", "content": "Hi"}]}\n')

    def loaded(model: Path):
        return load_prompts(DataConfig(prompts=str(prompts), tokenizer=str(model), reward="m:f"))

    assert loaded(write_chat_tokenizer(tmp_path / "good")).stop_warning is None
    bad = loaded(write_chat_tokenizer(tmp_path / "bad", eos=("</s>",))).stop_warning
    assert bad is not None and "'<|im_end|>'" in bad and "does not list" in bad


def test_the_reward_reads_the_response_without_special_tokens(tmp_path: Path) -> None:
    tok = load_tokenizer(write_chat_tokenizer(tmp_path / "m"))
    end = tok.token_to_id("<|im_end|>")
    response = [*tok.encode("The answer is 4.", add_special_tokens=False).ids, end]
    # as roles/data/sampling.py decodes a response for the reward function
    assert tok.decode(response, skip_special_tokens=True) == "The answer is 4."
