"""A chat model's tokenizer directory for the data role's tests, built with ``tokenizers``.

A byte-level BPE (any text encodes) with the special tokens ``<s>`` (BOS, which the tokenizer's
post-processor adds to encoded text), ``</s>``, ``<|im_start|>`` and ``<|im_end|>``; a
``tokenizer_config.json`` carrying a ChatML template that writes the BOS token itself (so encoding
its text with special tokens added would double it), and a ``generation_config.json`` naming the
end-of-sequence ids the engine would stop at.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ("<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")

CHATML = (
    "{{ bos_token }}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

#: a template that knows only system, user and assistant messages (as some do)
NO_TOOLS = (
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "You are a helpful assistant.",
    "What is 2+2? The answer is 4.",
    "user assistant system tool",
    "Compute 7+8 step by step.",
]


def write_chat_tokenizer(
    directory: Path,
    *,
    template: str | None = CHATML,
    in_config: bool = True,
    eos: tuple[str, ...] = ("<|im_end|>", "</s>"),
) -> Path:
    """The model directory: ``template`` in tokenizer_config.json (``in_config``) or in
    chat_template.jinja beside it; None: no template at all."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 10, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config: dict[str, object] = {
        "bos_token": "<s>",
        "eos_token": "<|im_end|>",
        "pad_token": "<pad>",
    }
    if template is not None and in_config:
        config["chat_template"] = template
    elif template is not None:
        (directory / "chat_template.jinja").write_text(template)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    eos_ids = [tok.token_to_id(t) for t in eos]
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))
    return directory


def verl_rows(n: int) -> list[dict[str, object]]:
    """Records in verl's parquet layout (as its gsm8k preprocessing writes them)."""
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"What is {i}+{i}?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
            "extra_info": {"split": "train", "index": 100 + i, "answer": f"#### {2 * i}"},
        }
        for i in range(n)
    ]
