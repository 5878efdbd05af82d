"""Request and response bodies of the OpenAI-compatible API (OpenAI field names and shapes).

Requests accept unknown fields (clients send many optional ones); the server logs their names and
otherwise ignores them. Fields whose non-default values this build cannot honour are declared here
so that the server can reject them with a 400 instead of silently ignoring them (see
`serving.api.validation.reject_unsupported`). vLLM extensions (`ignore_eos`, `stop_token_ids`,
`skip_special_tokens`, `chat_template_kwargs`, `top_k`, `min_p`, `repetition_penalty`,
`structured_outputs`) keep vLLM's names.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

# Seeds must fit a signed 64-bit integer (the engine folds them into a PRNG key).
_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1

TokenId = Annotated[int, Field(ge=0)]


class _Request(BaseModel):
    """Base of request bodies: unknown fields are kept in `model_extra` (and then ignored)."""

    model_config = ConfigDict(extra="allow")


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --------------------------------------------------------------------------------------- errors


class ErrorInfo(_Response):
    """The `error` object of an OpenAI error body."""

    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(_Response):
    """`{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorInfo


# --------------------------------------------------------------------------------------- shared


class StreamOptions(_Request):
    """`stream_options`: `include_usage` adds a final chunk with empty `choices` and the usage."""

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries its choice's usage so far


class PromptTokensDetails(_Response):
    """`usage.prompt_tokens_details`: prompt tokens served from the prefix cache."""

    cached_tokens: int = 0


class CompletionTokensDetails(_Response):
    """`usage.completion_tokens_details`: completion tokens spent reasoning (inside the think
    block; set only when the server runs a reasoning parser, as vLLM does)."""

    reasoning_tokens: int = 0


class UsageInfo(_Response):
    """Token counts of one request."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


# -------------------------------------------------------------------------------------- logprobs


class ChatTokenLogprob(_Response):
    """One alternative of `top_logprobs`: the token's text, its log-probability and its UTF-8
    bytes."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprobContent(ChatTokenLogprob):
    """One generated token in `choices[i].logprobs.content` with its `top_logprobs`."""

    top_logprobs: list[ChatTokenLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(_Response):
    """`choices[i].logprobs` of a chat completion (or of one stream chunk)."""

    content: list[ChatTokenLogprobContent] | None = None


class CompletionLogprobs(_Response):
    """`choices[i].logprobs` of a (legacy) completion: parallel lists, one entry per token;
    `text_offset` is each token's character offset in the choice's text."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(_Response):
    """One entry of vLLM's `prompt_logprobs` (a prompt position's dict, keyed by token id): the
    token's log-probability given the prompt before it, its rank (1: the most likely) and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's `prompt_logprobs` body: one entry per prompt token, None for the first, else {token id:
# PromptLogprob} holding the prompt token and its top alternatives.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


# ------------------------------------------------------------------------------ chat completions


class TextContentPart(_Request):
    """A `{"type": "text", "text": ...}` content part."""

    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    """One entry of `messages`.

    `role` "developer" is treated as "system". `content` is a string, a list of content parts
    (only text parts are accepted; the server joins them with newlines) or null (an assistant turn
    that only calls tools). Other keys (`name`, `tool_calls`, `tool_call_id`,
    `reasoning_content`, ...) are passed to the chat template unchanged (the project tokenizer
    parses `tool_calls[].function.arguments` JSON strings into objects, as HF templates expect).
    """

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Request):
    """Body of `POST /v1/chat/completions`."""

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: Annotated[int, Field(ge=_INT64_MIN, le=_INT64_MAX)] | None = None
    n: int | None = 1
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    reasoning_effort: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    presence_penalty: float | None = 0.0  # [-2, 2]; serving.penalties
    frequency_penalty: float | None = 0.0  # [-2, 2]
    logit_bias: dict[str, float] | None = None  # {"token id": bias}, clamped to [-100, 100]
    response_format: dict[str, Any] | None = None
    # vLLM extensions.
    add_generation_prompt: bool = True  # the template's assistant-turn opener after the messages
    continue_final_message: bool = False  # continue the last (assistant) message instead
    min_tokens: int | None = 0  # tokens before EOS / stop ids / stop strings may end the output
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    thinking_token_budget: int | None = None  # vLLM's: tokens inside the think block at most
    echo: bool | None = False  # vLLM's chat field (prepend the last message): refused when set
    best_of: int | None = None  # refused unless 1
    prompt_logprobs: int | None = None  # vLLM's: the prompt tokens' logprobs (not with stream)
    structured_outputs: dict[str, Any] | None = None  # serving/api/structured.py


class ChatCompletionMessage(_Response):
    """`choices[i].message` of a non-streaming chat completion."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatCompletionChoice(_Response):
    """One choice of a non-streaming chat completion."""

    index: int = 0
    message: ChatCompletionMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM: the stop string or stop token id that ended it


class ChatCompletionResponse(_Response):
    """Body returned by a non-streaming `POST /v1/chat/completions`."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    kv_transfer_params: dict[str, Any] | None = None  # P/D: a prefill engine's answer (serving/pd/params.py)
    # vLLM's (`prompt_logprobs` requested): the rendered prompt's; left out of the body otherwise.
    prompt_logprobs: PromptLogprobs | None = Field(default=None, exclude_if=lambda v: v is None)


class DeltaMessage(_Response):
    """`choices[i].delta` of a stream chunk; keys that are None are left out of the JSON."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionStreamChoice(_Response):
    """One choice of a `chat.completion.chunk`."""

    index: int = 0
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(_Response):
    """One SSE `chat.completion.chunk`; `usage` is only present on the usage chunk."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


# ----------------------------------------------------------------------------------- completions


class CompletionRequest(_Request):
    """Body of `POST /v1/completions`.

    `prompt` is a string or a list of token ids, or a batch: a list of strings or of token-id
    lists, each prompt served as its own `n` choices (choice `p · n + j`: prompt p's j-th).
    `max_tokens` defaults to 16, as in the OpenAI and vLLM completions APIs.
    """

    model: str | None = None
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    seed: Annotated[int, Field(ge=_INT64_MIN, le=_INT64_MAX)] | None = None
    n: int | None = 1
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    echo: bool | None = False  # the prompt's text (and with logprobs its tokens') before the output
    logprobs: int | None = None
    presence_penalty: float | None = 0.0  # [-2, 2]; serving.penalties
    frequency_penalty: float | None = 0.0  # [-2, 2]
    logit_bias: dict[str, float] | None = None  # {"token id": bias}, clamped to [-100, 100]
    # Declared so that unsupported values can be refused rather than dropped.
    best_of: int | None = None
    suffix: str | None = None
    # vLLM extensions.
    max_completion_tokens: int | None = None  # as on chat: takes precedence over max_tokens
    min_tokens: int | None = 0  # tokens before EOS / stop ids / stop strings may end the output
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    top_k: int | None = None
    min_p: float | None = None
    return_token_ids: bool = False  # vLLM: each choice also carries prompt_token_ids and token_ids
    repetition_penalty: float | None = None
    thinking_token_budget: int | None = None  # vLLM's: tokens inside the think block at most
    prompt_logprobs: int | None = None  # the prompt tokens' logprobs (not with stream)
    structured_outputs: dict[str, Any] | None = None  # serving/api/structured.py
    response_format: dict[str, Any] | None = None  # vLLM applies it on completions too


class CompletionChoice(_Response):
    """One choice of a completion (also the shape of a streamed completion choice)."""

    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM: the stop string or stop token id that ended it
    # vLLM's `return_token_ids`: the prompt (non-streaming, and a stream's first chunk) and the
    # output token ids (a stream: the chunk's new ones). Left out of the body unless requested.
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=lambda v: v is None)
    token_ids: list[int] | None = Field(default=None, exclude_if=lambda v: v is None)
    # vLLM's `prompt_logprobs` (requested): left out of the body otherwise.
    prompt_logprobs: PromptLogprobs | None = Field(default=None, exclude_if=lambda v: v is None)


class CompletionResponse(_Response):
    """Body of a non-streaming completion and of each streamed `text_completion` chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None  # P/D: a prefill engine's answer (serving/pd/params.py)


class TokenizeRequest(_Request):
    """Body of `POST /tokenize` (vLLM's): a prompt string or chat messages; `return_token_strs`
    adds each token's text."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True  # messages: as on chat completions
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    """Body of `POST /detokenize` (vLLM's): token ids → `{"prompt": text}`."""

    model: str | None = None
    tokens: list[int]


# ---------------------------------------------------------------------------------------- models


class ModelCard(_Response):
    """One entry of `GET /v1/models` (`root` is the checkpoint path or preset name)."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "glm53-jax"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(_Response):
    """Body of `GET /v1/models`."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
