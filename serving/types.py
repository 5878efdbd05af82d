"""Request-level types shared by the engine, the offline API and the HTTP server.

The HTTP layer turns OpenAI request bodies into `SamplingParams` + prompt token ids, calls
`EngineClient.generate`, and turns the `RequestOutput` stream back into OpenAI responses.
"""

from __future__ import annotations

import numbers
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol


def is_integer(v) -> bool:
    """A Python or numpy integer (`numbers.Integral`), not a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


class InvalidRequestError(ValueError):
    """A request the engine refuses, naming the API field at fault (`param`: the 400's `param`,
    e.g. "prompt"); the server maps any ValueError with a `param` to that 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ReasoningTags:
    """The think block's token ids, for a `thinking_token_budget` (the server sets them from the
    tokenizer: GLM's `<think>` and `</think>` are one token each). opened: the prompt ends inside
    an open block (the chat template opened it), so the output starts in it."""

    end_id: int
    start_id: int | None = None
    opened: bool = False


@dataclass
class SamplingParams:
    """Per-request sampling and stopping controls (vLLM names and semantics).

    temperature: 0 means greedy (argmax); otherwise logits / temperature.
    top_p: nucleus sampling mass in (0, 1]; 1 disables it.
    top_k: sample from the k most likely tokens only; 0 or -1 disables it (vLLM's values).
    min_p: drop tokens whose probability is below min_p × the most likely token's, in [0, 1];
        0 disables it. Temperature first, then min_p, top_k, and top_p over what they left
        (vLLM's order, `glm53.sampling.filter_sorted`); none of them changes greedy decoding.
    seed: a request-local seed: every draw is keyed by (seed, output index), so the same seed
        and prompt give the same tokens whatever the batch — except where float rounding that
        depends on how the prompt was computed (a prefix-cache hit chunks it differently, a
        parallel layout sums in another order) moves a draw across a boundary of the
        distribution, and under MTP speculation (docs/spec_decode.md). None draws from the
        engine's own stream.
    max_tokens: number of generated tokens at most (>= 1); None means up to max_model_len.
    min_tokens: tokens generated before the request may stop (vLLM's): until then its EOS ids
        (unless ignore_eos) and `stop_token_ids` are masked out of sampling and stop strings are
        not matched; 0 (default) is no minimum; at most max_tokens.
    stop_token_ids: extra token ids that end the request (in addition to the model's EOS ids,
        which end it unless ignore_eos).
    ignore_eos: keep generating past EOS tokens until max_tokens.
    logprobs: None for no log-probabilities; k >= 0 returns, for every generated token, its
        log-probability under the model's raw distribution (fp32 log-softmax of the logits,
        before temperature and top-p) and the k most likely tokens with theirs.
    prompt_logprobs: None, or k >= 0 (vLLM's): the first output then carries, for every prompt
        token after the first, its log-probability given the tokens before it (the same raw
        distribution), its rank, and the k most likely tokens with theirs
        (`RequestOutput.prompt_logprobs`, `serving.prompt_logprobs`). Such a request computes its
        whole prompt: it reads nothing from the prefix cache (vLLM does the same).
    stop: stop strings, matched by the front end (server, `LLM`) on the detokenized text; the
        output ends before the first match, which is not included (finish reason "stop").
    n: independent samples per prompt (front ends submit n requests; with a seed, sample i
        uses seed + i).
    skip_special_tokens: drop special tokens when detokenizing.
    kv_transfer_params: prefill/decode disaggregation (vLLM's NixlConnector protocol,
        `serving/pd/params.py`): `{"do_remote_decode": true}` on a prefill engine, or a prefill
        response's params on a decode engine. None otherwise.
    data_parallel_rank: the data-parallel replica to run on (vLLM's `X-data-parallel-rank`
        header, sent by routers); None lets the engine choose.
    structured_outputs: a `serving.structured_outputs.StructuredOutputsParams` constraining the
        output (JSON schema, JSON object, regex, choice, grammar, forced tool calls), or None.
        Every sampled token, and every reported logprob, is then over the ids the grammar allows.
    presence_penalty / frequency_penalty: in [-2, 2] (OpenAI's); subtracted from the logit of
        every id in the output so far, once (presence) or once per occurrence (frequency).
        0 (default) is off.
    repetition_penalty: > 0 (vLLM's, from the CTRL paper); the logit of every id in the prompt
        or the output so far is divided by it when positive, multiplied when not. 1 is off.
    logit_bias: {token id: bias} added to those ids' logits before the penalties, or None; ids
        must be in the vocabulary (the engine checks), biases finite (the server clamps them to
        [-100, 100] as vLLM does).
    thinking_token_budget: at most this many output tokens inside the think block (vLLM's
        `thinking_token_budget`; Anthropic's `budget_tokens`): once a request has spent them
        still inside the block, its next token is `reasoning_tags.end_id` (`</think>`) whatever
        the model prefers (`serving/penalties.py`); None is no budget. Needs `reasoning_tags`.
    reasoning_tags: the think block's ids and whether the prompt opened it (`ReasoningTags`).
        All four change which token is drawn (greedy included), not the reported logprobs (those
        of the raw distribution), in vLLM's order and maths (`glm53.sampling.apply_penalties`,
        `serving.penalties`).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    stop: list[str] = field(default_factory=list)
    n: int = 1
    skip_special_tokens: bool = True
    kv_transfer_params: dict | None = None
    data_parallel_rank: int | None = None
    structured_outputs: Any = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    thinking_token_budget: int | None = None
    reasoning_tags: ReasoningTags | None = None

    def validate(self) -> None:
        """Raise ValueError with the offending field name (a wrong type included: `max_tokens`
        "4" or 4.5 is refused, not compared or rounded)."""
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise ValueError(f"{name} must be a number, got {v!r}")  # noqa: TRY004 - a 400, as every refusal
        for name in ("max_tokens", "logprobs", "prompt_logprobs", "seed", "data_parallel_rank", "top_k", "min_tokens"):
            v = getattr(self, name)
            if v is not None and not is_integer(v):
                raise ValueError(f"{name} must be an integer or None, got {v!r}")
        if not is_integer(self.n):
            raise ValueError(f"n must be an integer, got {self.n!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(is_integer(t) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of token ids (integers), got {self.stop_token_ids!r}")
        if not (0.0 <= self.temperature < float("inf")):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 or -1 (disabled) or at least 1, got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty < float("inf"):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a mapping of token ids to numbers, got {self.logit_bias!r}")
            for k, v in self.logit_bias.items():
                if not is_integer(k) or isinstance(v, bool) or not isinstance(v, numbers.Real) \
                        or not abs(float(v)) < float("inf"):
                    raise ValueError(f"logit_bias maps token ids (integers) to finite numbers, got {k!r}: {v!r}")
        if self.thinking_token_budget is not None:
            if not is_integer(self.thinking_token_budget) or self.thinking_token_budget < 0:
                raise InvalidRequestError(f"thinking_token_budget must be an integer >= 0, got "
                                          f"{self.thinking_token_budget!r}", "thinking_token_budget")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if self.structured_outputs is not None:
            from serving.structured_outputs import StructuredOutputsParams

            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError("structured_outputs must be a StructuredOutputsParams")
            self.structured_outputs.kind()


@dataclass
class TokenLogprobs:
    """Log-probabilities of one generated token (natural log, fp32 maths).

    token_id / logprob: the sampled token (or, for prompt logprobs, the prompt token) and its
        log-probability.
    top: the most likely tokens as (token_id, logprob), most likely first (as many as requested).
    rank: prompt logprobs only: 1 + the number of ids more likely than `token_id` (vLLM's count of
        ids at least as likely; 1 is the most likely); None for generated tokens.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None


@dataclass
class RequestOutput:
    """One increment of a request's output.

    new_token_ids: tokens generated since the previous increment (may be empty on the final one).
    finished: True on the last increment; finish_reason is then "stop" (EOS or a stop token),
        "length" (max_tokens or max_model_len), "abort", or "error" (the step that ran it failed;
        `error` then says why).
    num_prompt_tokens / num_cached_tokens: prompt length and how many prompt tokens were served
        from the prefix cache (0 without prefix caching).
    num_output_tokens: total generated so far.
    new_logprobs: one `TokenLogprobs` per new token when the request asked for logprobs.
    error: with finish_reason "error", the engine's message (the server turns it into a 500).
    kv_transfer_params: on the final output of a prefill engine's `do_remote_decode` request, the
        params its decode engine needs (`serving/pd/params.py`); None otherwise.
    prompt_logprobs: for a request with `SamplingParams.prompt_logprobs`, on its first output with
        a token: one entry per prompt token, None for the first (nothing precedes it), then a
        `TokenLogprobs` with the prompt token, its rank and the top alternatives. None otherwise.
    """

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    new_logprobs: list[TokenLogprobs] | None = None
    error: str | None = None
    kv_transfer_params: dict | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class EngineClient(Protocol):
    """What the HTTP server needs from an engine."""

    model_name: str
    max_model_len: int

    def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request and stream its outputs. Raises ValueError (a client error, HTTP 400)
        when the request cannot be served (e.g. prompt + max_tokens beyond max_model_len).
        Cancelling the iterator (client disconnect) aborts the request and frees its pages."""
        ...

    async def abort(self, request_id: str, finished_reason: str = "abort") -> None:
        """Abort a request and free its pages; finished_reason "stop" when the front end ended
        it at a stop string (counted as a stop, not an abort, in the metrics)."""
        ...

    def is_healthy(self) -> bool: ...
