"""Fixtures for the serving tests: a small real byte-level BPE tokenizer with a GLM-style template.

`TinyChatTokenizer` exposes what the HTTP server uses from the project tokenizer: `encode`,
`decode`, `apply_chat_template` (with `reasoning_effort`). It is trained in memory on a few
sentences, so characters outside that text (CJK, emoji) are split into byte tokens, which exercises
the partial-UTF-8 handling of streamed responses.
"""

from __future__ import annotations

from typing import Any

import jinja2
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "[gMASK]",
    "<sop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<think>",
    "</think>",
]

_CORPUS = [
    "Hello there! How are you today? I am fine, thank you.",
    "The quick brown fox jumps over the lazy dog.",
    "Reasoning Effort: Max. Reasoning Effort: High. Reasoning Effort: Low.",
    "Say something nice about tokens, servers and streaming responses.",
    "one two three four five six seven eight nine ten",
]

_TEMPLATE = (
    "[gMASK]<sop><|system|>Reasoning Effort: {{ effort }}"
    "{%- if tools %}<|system|>Tools: {{ tools | tojson }}{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|observation|>{{ m.content }}"
    "{%- elif m.role in ('system', 'user', 'assistant') %}<|{{ m.role }}|>{{ m.content }}"
    "{%- else %}{{ raise_exception('unknown role ' ~ m.role) }}{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|><think>{% endif %}"
)


class TinyChatTokenizer:
    """A `tokenizers.Tokenizer`-backed stand-in for the project tokenizer."""

    def __init__(self) -> None:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=420,
            special_tokens=SPECIAL_TOKENS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(_CORPUS, trainer)
        self._tok = tok
        self.eos_token_id: int = tok.token_to_id("<|endoftext|>")
        env = jinja2.Environment(autoescape=False)

        def raise_exception(msg: str) -> None:
            raise jinja2.TemplateError(msg)

        env.globals["raise_exception"] = raise_exception
        self._template = env.from_string(_TEMPLATE)

    def __len__(self) -> int:
        """Token ids the tokenizer knows (as glm53.tokenizer's)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (special-token text maps to the special ids; none are added)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render the GLM-style prompt (`reasoning_effort` low/high, else Max)."""
        effort = {"low": "Low", "high": "High"}.get(str(kwargs.get("reasoning_effort")), "Max")
        return self._template.render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            effort=effort,
        )


@pytest.fixture(scope="session")
def tiny_tokenizer() -> TinyChatTokenizer:
    """A small real byte-level BPE tokenizer with a GLM-style chat template."""
    return TinyChatTokenizer()
