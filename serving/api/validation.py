"""Request parsing and validation for the HTTP routes: the bounded body read, the pydantic
models' errors as 400s, the features this build refuses (400 naming the field), `max_tokens`
against `max_model_len`, the `SamplingParams` of each choice, the chat messages handed to the
template, and the `X-data-parallel-rank` header. Every refusal is an `APIError` (errors.py)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from typing import Any

import anyio
from fastapi import Request
from pydantic import BaseModel, ValidationError

from serving.api.errors import APIError, bad_request, validation_error
from serving.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
)
from serving.api.structured import REFUSED_FIELDS
from serving.pd.params import KVTransferParamsError, parse_kv_transfer_params
from serving.types import ReasoningTags, SamplingParams

logger = logging.getLogger(__name__)


_warned_extra_fields: set[str] = {"kv_transfer_params"}  # P/D: read from model_extra


# ------------------------------------------------------------------------------- request parsing


def default_max_body_bytes(max_model_len: int) -> int:
    """The largest request body the server reads: 256 bytes per token of context, at least
    16 MiB (a prompt of `max_model_len` tokens is far smaller, even as JSON `\\uXXXX` escapes or
    a token-id list; a client that sends more is refused before the body fills the memory)."""
    return max(16 << 20, 256 * max_model_len)


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, or 413 as soon as it is known to exceed `max_bytes` (from its
    Content-Length, else while it streams in)."""
    too_large = APIError(413, f"The request body exceeds the limit of {max_bytes} bytes.")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise too_large
    parts, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > max_bytes:
            raise too_large
        parts.append(chunk)
    return b"".join(parts)


async def parse_body(request: Request, model_cls: type[BaseModel], max_bytes: int) -> Any:
    """Read the JSON body (413 beyond `max_bytes`) and validate it into `model_cls`; 400 on any
    other failure."""
    raw = await read_body(request, max_bytes)
    try:
        obj = json.loads(raw)
    except RecursionError:
        raise bad_request("Invalid JSON body: nested too deeply.") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of > 4,300 digits
        raise bad_request(f"Invalid JSON body: {e}") from None
    if not isinstance(obj, dict):
        raise bad_request("The request body must be a JSON object.")
    try:
        body = model_cls.model_validate(obj)
    except ValidationError as e:
        raise validation_error(e) from None
    # (The removed guided_* fields are refused with a 400 by the structured-outputs check.)
    new_extra = set(body.model_extra or ()) - _warned_extra_fields - set(REFUSED_FIELDS)
    if new_extra:
        _warned_extra_fields.update(new_extra)
        logger.warning("Ignoring unsupported request fields: %s", sorted(new_extra))
    return body


def check_unicode(text: str, param: str) -> None:
    """400 naming `param` when `text` is not valid Unicode (a lone UTF-16 surrogate, which JSON
    `\\ud800` escapes can carry)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad_request(f"The text is not valid Unicode: {e.reason} at index {e.start}.", param) from None


async def encode_text(tokenizer: Any, text: str, param: str) -> list[int]:
    """Tokenise request text in a worker thread (a prompt of many megabytes takes seconds to
    tokenise, and the event loop must keep serving the other requests meanwhile); text that is not
    valid Unicode (a lone UTF-16 surrogate) is a 400."""
    check_unicode(text, param)
    return list(await anyio.to_thread.run_sync(tokenizer.encode, text))


def _is_set(value: Any, default: Any) -> bool:
    return value is not None and value != default


MAX_N = 128  # most choices one request may ask for
MAX_STOPS = 1024  # most stop strings, and most stop token ids, one request may give

# Arguments of `apply_chat_template` that `chat_template_kwargs` must not carry: the server's own,
# and `chat_template`, which would let a client render a template of its choosing.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "continue_final_message",
                                      "chat_template"})


def reject_unsupported(body: ChatCompletionRequest | CompletionRequest) -> None:
    """Refuse parameters whose non-default values this build cannot honour (never drop them),
    and check `n`, `stop`, `logprobs` and `stream_options`."""
    if body.n is not None and not 1 <= body.n <= MAX_N:
        raise bad_request(f"n must be in [1, {MAX_N}], got {body.n}.", "n")
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if any(not s for s in stops):
        raise bad_request("stop strings must be non-empty.", "stop")
    # Every stop string is searched for after every token, and every stop token id checked, so
    # their number is bounded (100,000 stop strings stalled the server's event loop for seconds).
    for name, values in (("stop", stops), ("stop_token_ids", body.stop_token_ids or [])):
        if len(values) > MAX_STOPS:
            raise bad_request(f"{name} accepts at most {MAX_STOPS} entries, got {len(values)}.", name)
    for s in stops:
        check_unicode(s, "stop")
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options can only be set when stream=true.", "stream_options")
    checks: list[tuple[str, bool]] = []
    if body.response_format is not None:
        fmt = body.response_format.get("type")
        if fmt not in ("text", "json_object", "json_schema"):
            raise bad_request(f'response_format type must be "text", "json_object" or "json_schema", got {fmt!r}.',
                              "response_format")
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs is not None:
            if body.top_logprobs < 0:
                raise bad_request(f"top_logprobs must be >= 0, got {body.top_logprobs}.", "top_logprobs")
            if body.top_logprobs > 0 and not body.logprobs:
                raise bad_request("top_logprobs requires logprobs=true.", "top_logprobs")
    else:
        if body.logprobs is not None and body.logprobs < 0:
            raise bad_request(f"logprobs must be >= 0, got {body.logprobs}.", "logprobs")
        checks += [("suffix", bool(body.suffix))]
    if body.prompt_logprobs is not None:
        if body.prompt_logprobs < 0:
            raise bad_request(f"prompt_logprobs must be >= 0 (-1, the whole vocabulary, is not supported), got "
                              f"{body.prompt_logprobs}.", "prompt_logprobs")
        if body.stream and body.prompt_logprobs > 0:
            raise bad_request("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
    checks += [
        ("best_of", body.best_of not in (None, 1)),
    ]
    for name, bad in checks:
        if bad:
            raise bad_request(f"{name} is not supported yet in this build.", name)


def completion_prompts(prompt, n: int) -> list:
    """The prompts of a completions request's `prompt`: a string, a list of token ids, or a batch
    (a list of strings or of token-id lists; OpenAI's and vLLM's batched prompts), each entry then
    served as its own `n` choices. Raises a 400 naming `prompt` for an empty batch, or for more
    choices in all than `MAX_N` (send smaller batches)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        batch = list(prompt)
    elif isinstance(prompt, list) and not prompt:
        raise bad_request("The prompt must not be empty.", "prompt")
    else:
        batch = [prompt]
    if len(batch) * n > MAX_N:
        raise bad_request(f"{len(batch)} prompts x n={n} ask for {len(batch) * n} choices; at most {MAX_N} per "
                          "request (send smaller batches).", "prompt")
    return batch


def requested_max_tokens(body: ChatCompletionRequest | CompletionRequest) -> tuple[int | None, str]:
    """(the completion length asked for, the field that asked): `max_completion_tokens` wins over
    `max_tokens` on both endpoints."""
    if body.max_completion_tokens is not None:
        return body.max_completion_tokens, "max_completion_tokens"
    return body.max_tokens, "max_tokens"


def resolve_max_tokens(
    requested: int | None, param: str, prompt_len: int, max_model_len: int, prompt_param: str, note: str = "",
    default: int | None = None,
) -> int:
    """Check the prompt and completion lengths against `max_model_len` (the engine's effective
    one: less than --max-model-len when its KV cache bounds one request); 400 naming the lengths,
    with `note` (the engine's sentence on that bound, or "") appended.

    Returns the number of tokens to generate: `requested`, or when None all the room left, at
    most `default` (the generation config's `max_new_tokens`, `serving.generation_defaults`)."""
    if requested is not None and requested < 1:
        raise bad_request(f"{param} must be at least 1, got {requested}.", param)
    if prompt_len >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt has {prompt_len} tokens, which leaves no room for a completion. Please "
            "reduce the length of the prompt." + note,
            prompt_param,
        )
    if requested is None:
        room = max_model_len - prompt_len
        return room if default is None else min(room, default)
    if prompt_len + requested > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} "
            f"in the completion). Please reduce the length of the prompt or of {param}." + note,
            param,
        )
    return requested


def build_sampling_params(
    body: ChatCompletionRequest | CompletionRequest, max_tokens: int, max_logprobs: int | None = None,
    defaults: dict[str, Any] | None = None,
) -> SamplingParams:
    """The engine's `SamplingParams` of a request body (choice 0; see `params_per_choice`).

    defaults: the server's values for `temperature`, `top_p`, `top_k`, `min_p` where the body
    leaves them out (`serving.generation_defaults`: the checkpoint's generation config);
    else the OpenAI defaults (1, 1, off, off).

    max_logprobs: the engine's `--max-logprobs` when it exposes one; more alternatives than that
    is a 400 naming the request's own field (`top_logprobs` for chat, `logprobs` for completions).
    """
    if body.temperature is not None and not 0 <= body.temperature < math.inf:  # NaN fails too
        raise bad_request(f"temperature must be a finite number >= 0, got {body.temperature}.", "temperature")
    if body.top_p is not None and not 0.0 < body.top_p <= 1.0:
        raise bad_request(f"top_p must be in (0, 1], got {body.top_p}.", "top_p")
    if body.top_k is not None and body.top_k < -1:
        raise bad_request(f"top_k must be 0 or -1 (disabled) or at least 1, got {body.top_k}.", "top_k")
    if body.min_p is not None and not 0.0 <= body.min_p <= 1.0:  # NaN fails too
        raise bad_request(f"min_p must be in [0, 1], got {body.min_p}.", "min_p")
    if body.thinking_token_budget is not None and body.thinking_token_budget < 0:
        raise bad_request(f"thinking_token_budget must be >= 0, got {body.thinking_token_budget}.",
                          "thinking_token_budget")
    min_tokens = body.min_tokens or 0
    if min_tokens < 0:
        raise bad_request(f"min_tokens must be >= 0, got {min_tokens}.", "min_tokens")
    if min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({min_tokens}) must be at most the completion's length ({max_tokens}).",
                          "min_tokens")
    if isinstance(body, ChatCompletionRequest):
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        logprobs = body.logprobs
    if max_logprobs is not None and logprobs is not None and logprobs > max_logprobs:
        name = "top_logprobs" if isinstance(body, ChatCompletionRequest) else "logprobs"
        raise bad_request(f"{name} must be at most {max_logprobs} (--max-logprobs), got {logprobs}.", name)
    prompt_logprobs = body.prompt_logprobs
    if prompt_logprobs is not None and max_logprobs is not None and prompt_logprobs > max_logprobs:
        raise bad_request(f"prompt_logprobs must be at most {max_logprobs} (--max-logprobs), got {prompt_logprobs}.",
                          "prompt_logprobs")
    if prompt_logprobs is None and not isinstance(body, ChatCompletionRequest) and body.echo:
        prompt_logprobs = logprobs  # vLLM's: an echoed prompt's tokens carry logprobs as the output's
    kv_params = (body.model_extra or {}).get("kv_transfer_params")
    if kv_params is not None:
        try:
            remote_decode, _ = parse_kv_transfer_params(kv_params)
        except KVTransferParamsError as e:
            raise bad_request(str(e), e.param) from None
        if (body.n or 1) > 1:
            raise bad_request("kv_transfer_params cannot be combined with n > 1.", "n")
        if remote_decode and body.stream:
            # the decode engine's parameters come back in the response body; a stream has none, and
            # the KV kept for them would wait for abort_request_timeout
            raise bad_request("kv_transfer_params.do_remote_decode needs stream=false: the response body carries "
                              "the kv_transfer_params a decode engine pulls with (vllm-router sends it so).",
                              "stream")
    defaults = defaults or {}

    def value(name: str, fallback: float) -> float:
        v = getattr(body, name)
        return defaults.get(name, fallback) if v is None else v

    penalties = {name: float(value(name, neutral)) for name, neutral in
                 (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0))}
    params = SamplingParams(
        **penalties,
        logit_bias=parse_logit_bias(body.logit_bias),
        kv_transfer_params=kv_params or None,
        temperature=float(value("temperature", 1.0)),
        top_p=float(value("top_p", 1.0)),
        top_k=int(value("top_k", 0)),
        min_p=float(value("min_p", 0.0)),
        seed=body.seed,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
        n=body.n or 1,
        skip_special_tokens=body.skip_special_tokens,
        thinking_token_budget=body.thinking_token_budget,
    )
    for name in penalties:  # the penalties' ranges, as a 400 naming the field
        try:
            dataclasses.replace(SamplingParams(), **{name: penalties[name]}).validate()
        except ValueError as e:
            raise bad_request(f"{e}.", name) from None
    try:
        params.validate()
    except ValueError as e:
        raise bad_request(str(e)) from None
    return params


MAX_LOGIT_BIAS = 100.0  # OpenAI's range; vLLM clamps to it


def parse_logit_bias(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's `logit_bias` ({"token id as a string": bias}) → {token id: bias clamped to
    [-100, 100]} (vLLM's handling), or None when empty. A key that is not a decimal token id or a
    value that is not a finite number is a 400 naming `logit_bias`; ids outside the vocabulary are
    refused by the engine (also a 400)."""
    if not logit_bias:
        return None
    out = {}
    for k, v in logit_bias.items():
        if re.fullmatch(r"[0-9]+", str(k)) is None:
            raise bad_request(f"logit_bias keys must be token ids (decimal integers), got {k!r}.", "logit_bias")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise bad_request(f"logit_bias values must be finite numbers, got {v!r} for token {k}.", "logit_bias")
        out[int(k)] = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, float(v)))
    return out


def budget_tags(start_id: int | None, end_id: int | None, opened: bool) -> ReasoningTags:
    """The think block's token ids for a `thinking_token_budget` (`opened`: the prompt ends inside
    the block). A 400 naming the field when the tokenizer has no single `</think>` token (`end_id` None)."""
    if end_id is None:
        raise bad_request("thinking_token_budget needs a model whose tokenizer has </think> as one token.",
                          "thinking_token_budget")
    return ReasoningTags(end_id=end_id, start_id=start_id, opened=opened)


def header_data_parallel_rank(request: Request) -> int | None:
    """vLLM's `X-data-parallel-rank` header (a router pinning the request to a data-parallel
    replica), or None. A value that is not a decimal integer (digits, an optional leading minus)
    is a 400; the engine refuses one that is not one of its ranks (a 400 naming the header too)."""
    value = request.headers.get("x-data-parallel-rank")
    if value is None:
        return None
    if re.fullmatch(r"-?[0-9]+", value) is None:  # int() would also take "+1", " 1 " and "1_0"
        raise bad_request(f"X-data-parallel-rank must be an integer, got {value!r}.", "X-data-parallel-rank")
    return int(value)


def params_per_choice(params: SamplingParams) -> list[SamplingParams]:
    """One engine request per choice: n = 1 each; with a seed, choice i samples with seed + i
    (so choices are independent samples, and reproducible)."""
    return [
        dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i,
                            stop=list(params.stop), stop_token_ids=list(params.stop_token_ids))
        for i in range(params.n)
    ]


def flatten_content(content: str | list[dict[str, Any]] | None, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_request(
                f"messages[{index}].content[{j}]: only text content parts "
                '({"type": "text", "text": ...}) are supported.',
                "messages",
            )
        texts.append(part["text"])
    return "\n".join(texts)


def continue_final_message(prompt: str, content: str) -> str:
    """`prompt` (rendered without a generation prompt) cut right after the final message's
    content, so the model continues that message (vLLM's and HF's `continue_final_message`: the
    template's end-of-turn after it is dropped). 400 naming `continue_final_message` when the
    content is empty or cannot be found in the rendered text."""
    text = (content or "").strip()
    at = prompt.rfind(text) if text else -1
    if at < 0:
        raise bad_request("continue_final_message: the final message's content is empty or the chat template "
                          "does not render it verbatim.", "continue_final_message")
    return prompt[:at + len(text)]


def template_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as plain dicts for the chat template (content flattened to text; other keys such
    as `tool_calls`, `tool_call_id`, `reasoning_content` unchanged)."""
    out = []
    for i, msg in enumerate(body.messages):
        d: dict[str, Any] = dict(msg.model_extra or {})
        calls = d.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
            raise bad_request(f"messages[{i}].tool_calls must be a list of tool call objects.",
                              f"messages.{i}.tool_calls")
        d["role"] = "system" if msg.role == "developer" else msg.role
        d["content"] = flatten_content(msg.content, i)
        out.append(d)
    return out


# ------------------------------------------------------------------------------ engine plumbing
