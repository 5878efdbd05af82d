"""Tokenizer and chat-template glue for GLM-5.x checkpoints.

`GlmTokenizer` wraps an HF `tokenizers.Tokenizer` loaded from a checkpoint directory's
`tokenizer.json`, plus `tokenizer_config.json` (eos/pad token names, a fallback chat template) and
`chat_template.jinja` when present. Special-token ids are always looked up by name from the
tokenizer (`tok.token_to_id("<|user|>")`); none are hard-coded.

Chat templates render in the same jinja2 environment HF transformers uses (sandboxed, immutable,
`trim_blocks` and `lstrip_blocks`, the `tojson` filter, `raise_exception` and `strftime_now`
globals, the loop-controls extension and a pass-through `{% generation %}` tag), so a checkpoint's
own template renders here exactly as it does under `transformers`.
"""

from __future__ import annotations

import copy
import datetime
import functools
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

REPLACEMENT_CHAR = "\ufffd"

# ---------------------------------------------------------------------- jinja environment


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (HF assistant-mask markers): renders the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the HF-compatible sandboxed environment (cached by source).

    Raises jinja2.TemplateSyntaxError for a malformed template.
    """
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _normalize_tool_calls(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Deep-copied messages with JSON-string tool-call arguments parsed into dicts."""
    out = [dict(m) if isinstance(m, Mapping) else m for m in copy.deepcopy(list(messages))]
    for i, m in enumerate(out):
        if not isinstance(m, dict) or not m.get("tool_calls"):
            continue
        for j, tc in enumerate(m["tool_calls"]):
            fn = tc.get("function", tc) if isinstance(tc, Mapping) else None
            if not isinstance(fn, dict):
                continue
            args = fn.get("arguments")
            if isinstance(args, str):
                try:
                    parsed = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError as e:
                    raise ValueError(f"messages[{i}].tool_calls[{j}]: arguments are not valid JSON: {e}") from None
                if not isinstance(parsed, dict):
                    raise ValueError(
                        f"messages[{i}].tool_calls[{j}]: arguments must be a JSON object, got {type(parsed).__name__}"
                    )
                fn["arguments"] = parsed
    return out


# ---------------------------------------------------------------------- eos ids


@functools.lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of the byte-level BPE alphabet (GPT-2's bytes_to_unicode): printable Latin-1
    bytes stand for themselves, the other 68 bytes for code points 256, 257, … in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, n = {}, 0
    for b in range(256):
        if b in keep:
            table[chr(b)] = b
        else:
            table[chr(256 + n)] = b
            n += 1
    return table


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def eos_token_ids(config: Any = None, model_dir: str | os.PathLike | None = None) -> tuple[int, ...]:
    """Stop-token ids: the union of config.json's and generation_config.json's `eos_token_id`.

    `config` is a `GlmConfig`, a parsed config.json dict, or None (then `<model_dir>/config.json`
    is read when it exists). `<model_dir>/generation_config.json` is read when `model_dir` is given
    and the file exists. Order: config ids first, then new ids from the generation config;
    duplicates removed. Returns an empty tuple when neither names any.
    """
    ids: list[int] = []
    if config is None and model_dir is not None:
        p = os.path.join(os.fspath(model_dir), "config.json")
        if os.path.exists(p):
            with open(p) as f:
                config = json.load(f)
    if config is not None:
        raw = config.get("eos_token_id") if isinstance(config, Mapping) else getattr(config, "eos_token_id", None)
        ids.extend(_as_id_list(raw))
    if model_dir is not None:
        p = os.path.join(os.fspath(model_dir), "generation_config.json")
        if os.path.exists(p):
            with open(p) as f:
                ids.extend(_as_id_list(json.load(f).get("eos_token_id")))
    return tuple(dict.fromkeys(ids))


# ---------------------------------------------------------------------- tokenizer


def tokenizer_vocab_size(model_dir: str | os.PathLike | None) -> int | None:
    """Number of ids `<model_dir>/tokenizer.json` knows (regular + added), or None without one.

    The ids a model can emit with text: the checkpoint's `vocab_size` may be larger (padding).
    """
    if model_dir is None:
        return None
    tj = os.path.join(os.fspath(model_dir), "tokenizer.json")
    if not os.path.isfile(tj):
        return None
    return Tokenizer.from_file(tj).get_vocab_size(with_added_tokens=True)


class GlmTokenizer:
    """A GLM byte-level BPE tokenizer with its chat template.

    Build with `GlmTokenizer.from_pretrained(model_dir)`. Token ids are Python ints;
    `vocab_size` counts regular plus added tokens (the model's embedding may be larger, padded).
    `encode` never adds special tokens by itself; special tokens written in the text (as a rendered
    chat template does) are recognised as single ids.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        tokenizer_config: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
        model_dir: str | os.PathLike | None = None,
    ) -> None:
        """Wrap a loaded `tokenizers.Tokenizer`.

        `tokenizer_config` is the parsed tokenizer_config.json (eos/pad token names);
        `chat_template` the jinja source used by `apply_chat_template` (default: the config's
        `chat_template` when it is a string); `model_dir` is remembered for generation_config.json.
        """
        self._tok = tokenizer
        self.tokenizer_config: dict[str, Any] = dict(tokenizer_config or {})
        if chat_template is None:
            ct = self.tokenizer_config.get("chat_template")
            if isinstance(ct, list):  # HF's named-template list form
                named = {t.get("name"): t.get("template") for t in ct if isinstance(t, Mapping)}
                ct = named.get("default")
            chat_template = ct if isinstance(ct, str) else None
        self.chat_template: str | None = chat_template
        self.model_dir: str | None = os.fspath(model_dir) if model_dir is not None else None
        self._added = {t.content: (i, t.special) for i, t in self._tok.get_added_tokens_decoder().items()}

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> "GlmTokenizer":
        """Load `<model_dir>/tokenizer.json`, plus `tokenizer_config.json` and `chat_template.jinja`
        when present (`chat_template.jinja` wins over the config's `chat_template`).

        Raises FileNotFoundError naming the missing tokenizer.json path, ValueError naming a
        tokenizer.json or tokenizer_config.json that cannot be read.
        """
        d = os.fspath(model_dir)
        tj = os.path.join(d, "tokenizer.json")
        if not os.path.isfile(tj):
            raise FileNotFoundError(f"no tokenizer.json at {tj}")
        try:
            tok = Tokenizer.from_file(tj)
        except Exception as e:  # noqa: BLE001 - the tokenizers library raises a bare Exception for a malformed file
            raise ValueError(f"{tj} is not a tokenizer the HF tokenizers library can read: {e}") from None
        cfg: dict[str, Any] = {}
        tc = os.path.join(d, "tokenizer_config.json")
        if os.path.isfile(tc):
            try:
                with open(tc, encoding="utf-8") as f:
                    cfg = json.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{tc} is not valid JSON: {e}") from None
            if not isinstance(cfg, dict):
                raise ValueError(f"{tc} must be a JSON object, got {type(cfg).__name__}")
        template = None
        jp = os.path.join(d, "chat_template.jinja")
        if os.path.isfile(jp):
            with open(jp, encoding="utf-8") as f:
                template = f.read()
        return cls(tok, tokenizer_config=cfg, chat_template=template, model_dir=d)

    @property
    def backend(self) -> Tokenizer:
        """The wrapped `tokenizers.Tokenizer`."""
        return self._tok

    # ------------------------------------------------------------------ vocabulary
    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows (regular + added)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def token_to_id(self, token: str) -> int:
        """The id of `token` (e.g. "<|user|>"). Raises KeyError when the vocabulary lacks it."""
        i = self._tok.token_to_id(token)
        if i is None:
            raise KeyError(f"token {token!r} is not in the tokenizer's vocabulary")
        return int(i)

    def maybe_token_id(self, token: str) -> int | None:
        """The id of `token`, or None when absent."""
        i = self._tok.token_to_id(token)
        return None if i is None else int(i)

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary string of `token_id` (byte-level form for regular tokens).

        Raises KeyError for an id outside the vocabulary.
        """
        t = self._tok.id_to_token(int(token_id))
        if t is None:
            raise KeyError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        return t

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes token `token_id` stands for: the UTF-8 of an added token's content, else
        its byte-level vocabulary string mapped back through the GPT-2 byte↔unicode table (so a
        token holding part of a UTF-8 character gives that part, not U+FFFD).

        A padding id (one the model's embedding has but the tokenizer lacks, ids >= `vocab_size`:
        GLM-5.3 pads 154,856 ids to 154,880) stands for no bytes and gives b"", as `decode` gives
        "" for it (vLLM's detokenizer does the same).

        Raises KeyError for a negative id.
        """
        if int(token_id) < 0:
            raise KeyError(f"token id {token_id} is negative")
        if int(token_id) >= self.vocab_size:
            return b""
        piece = self.id_to_token(token_id)
        if piece in self._added:
            return piece.encode("utf-8")
        table = _unicode_to_byte()
        try:
            return bytes(table[c] for c in piece)
        except KeyError:  # not a byte-level piece: fall back to its text
            return piece.encode("utf-8")

    def is_padding_id(self, token_id: int) -> bool:
        """True for an id past the tokenizer's vocabulary (a padding row of the model's embedding)."""
        return int(token_id) >= self.vocab_size

    @property
    def added_tokens(self) -> dict[str, int]:
        """All added tokens (special or not) by content -> id."""
        return {c: i for c, (i, _) in self._added.items()}

    @property
    def special_tokens(self) -> dict[str, int]:
        """Added tokens flagged special (dropped by `decode(skip_special_tokens=True)`) -> id."""
        return {c: i for c, (i, s) in self._added.items() if s}

    @property
    def all_special_ids(self) -> frozenset[int]:
        """Ids of the special added tokens."""
        return frozenset(self.special_tokens.values())

    def _config_token(self, key: str) -> str | None:
        v = self.tokenizer_config.get(key)
        if isinstance(v, Mapping):
            v = v.get("content")
        return v if isinstance(v, str) else None

    @property
    def eos_token(self) -> str | None:
        """tokenizer_config.json's `eos_token` (a string), or None."""
        return self._config_token("eos_token")

    @property
    def pad_token(self) -> str | None:
        """tokenizer_config.json's `pad_token` (a string), or None."""
        return self._config_token("pad_token")

    @property
    def eos_token_id(self) -> int | None:
        """Id of `eos_token`, or None."""
        t = self.eos_token
        return None if t is None else self.maybe_token_id(t)

    @property
    def pad_token_id(self) -> int | None:
        """Id of `pad_token`, or None."""
        t = self.pad_token
        return None if t is None else self.maybe_token_id(t)

    def eos_token_ids(self, config: Any = None) -> tuple[int, ...]:
        """Stop ids for generation: `eos_token_ids(config, self.model_dir)`, falling back to the
        tokenizer's own `eos_token` when neither config names any."""
        ids = eos_token_ids(config, self.model_dir)
        if not ids and self.eos_token_id is not None:
            ids = (self.eos_token_id,)
        return ids

    # ------------------------------------------------------------------ encode / decode
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; no special tokens are added (those written in the text are kept).

        Goes through the backend's batch call, which releases the GIL while it tokenises (its
        single-text `encode` holds it), so a long prompt tokenised in a worker thread does not
        stall the server's event loop; the ids are the same."""
        return list(self._tok.encode_batch([text], add_special_tokens=False)[0].ids)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` for many texts (parallel in the Rust backend)."""
        return [list(e.ids) for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`. Incomplete UTF-8 byte sequences decode to U+FFFD.

        `skip_special_tokens` drops the special added tokens (role markers, [gMASK], ...); the
        non-special added tokens (<think>, <tool_call>, <arg_key>, ...) are always kept.
        """
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def decode_delta(self, ids: Sequence[int], prev_text: str, skip_special_tokens: bool = False) -> str:
        """New text to stream given all output `ids` so far and the text already emitted.

        Decodes all of `ids` (O(len(ids)); use `IncrementalDetokenizer` for long streams) and
        returns what follows `prev_text`, holding back a trailing U+FFFD (an incomplete UTF-8
        sequence) until later ids complete it. Returns "" when nothing new can be emitted.
        """
        text = self.decode(ids, skip_special_tokens=skip_special_tokens)
        if text.endswith(REPLACEMENT_CHAR):
            text = text.rstrip(REPLACEMENT_CHAR)
        if len(text) <= len(prev_text):
            return ""
        if not text.startswith(prev_text):
            # Should not happen for byte-level BPE; emit from the first differing character.
            k = 0
            for a, b in zip(text, prev_text):
                if a != b:
                    break
                k += 1
            return text[k:]
        return text[len(prev_text):]

    def incremental_detokenizer(self, skip_special_tokens: bool = False) -> "IncrementalDetokenizer":
        """A fresh `IncrementalDetokenizer` bound to this tokenizer."""
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ chat
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render `messages` (OpenAI-style dicts: role, content, reasoning_content, tool_calls, ...)
        with the checkpoint's chat template and return the prompt text.

        `tools` are OpenAI tool dicts; `kwargs` reach the template as variables (e.g.
        `reasoning_effort="low"`, `enable_thinking=False`). Tool-call `arguments` given as a JSON
        string are parsed into a dict first. The tokenizer's special-token names (`eos_token`,
        `pad_token`, ...) are available to the template as in HF transformers.

        Raises ValueError when no chat template is available or tool-call arguments are not a JSON
        object, and jinja2.TemplateError when the template rejects the input (`raise_exception`).
        """
        source = chat_template if chat_template is not None else self.chat_template
        if source is None:
            where = self.model_dir or "this tokenizer"
            raise ValueError(f"no chat template: {where} has neither chat_template.jinja nor a chat_template entry")
        context: dict[str, Any] = {}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            v = self._config_token(key)
            if v is not None:
                context[key] = v
        context.update(kwargs)
        return compile_chat_template(source).render(
            messages=_normalize_tool_calls(messages),
            tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
            **context,
        )

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> list[int]:
        """`encode(apply_chat_template(...))`: the prompt token ids for a chat request."""
        return self.encode(self.apply_chat_template(messages, tools, add_generation_prompt, **kwargs))


class IncrementalDetokenizer:
    """Streaming detokenizer: feed output ids as they are sampled, get text deltas.

    Keeps two offsets into the id list (the start of the current decode window and the end of the
    text already emitted), so each step decodes only a few ids. A delta is held back while the
    window decodes to a trailing U+FFFD (a multi-byte character split across tokens). The
    concatenation of all deltas plus `flush()` equals `tokenizer.decode(ids)`.
    """

    def __init__(self, tokenizer: GlmTokenizer, skip_special_tokens: bool = False) -> None:
        """Bind to `tokenizer`; `skip_special_tokens` as in `GlmTokenizer.decode`."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # start of the decode window
        self._read = 0  # ids[:_read] are fully emitted

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: Iterable[int]) -> str:
        """Append `new_ids` (one or more sampled ids); return the newly decodable text ("" if none)."""
        self.ids.extend(int(i) for i in new_ids)
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        full = self._decode(self.ids[self._prefix:])
        if len(full) > len(prefix_text) and not full.endswith(REPLACEMENT_CHAR):
            delta = full[len(prefix_text):]
            self._prefix = self._read
            self._read = len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end of the stream: emit whatever is held back (an incomplete sequence as U+FFFD)."""
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        full = self._decode(self.ids[self._prefix:])
        self._prefix = self._read = len(self.ids)
        delta = full[len(prefix_text):] if len(full) > len(prefix_text) else ""
        self.text += delta
        return delta
