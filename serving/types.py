"""Request-level types shared by the engine, the offline API and the HTTP server.

The HTTP layer turns OpenAI request bodies into `SamplingParams` + prompt token ids, calls
`EngineClient.generate`, and turns the `RequestOutput` stream back into OpenAI responses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol


@dataclass
class SamplingParams:
    """Per-request sampling and stopping controls (vLLM names and semantics).

    temperature: 0 means greedy (argmax); otherwise logits / temperature.
    top_p: nucleus sampling mass in (0, 1]; 1 disables it.
    seed: a request-local seed; the same seed, prompt and batch-independent sampling give the
        same tokens. None draws from the engine's own stream.
    max_tokens: number of generated tokens at most (>= 1); None means up to max_model_len.
    stop_token_ids: extra token ids that end the request (in addition to the model's EOS ids,
        which end it unless ignore_eos).
    ignore_eos: keep generating past EOS tokens until max_tokens.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def validate(self) -> None:
        """Raise ValueError with the offending field name."""
        if not (0.0 <= self.temperature < float("inf")):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError("top_p must be in (0, 1]")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")


@dataclass
class RequestOutput:
    """One increment of a request's output.

    new_token_ids: tokens generated since the previous increment (may be empty on the final one).
    finished: True on the last increment; finish_reason is then "stop" (EOS or a stop token),
        "length" (max_tokens or max_model_len) or "abort".
    num_prompt_tokens / num_cached_tokens: prompt length and how many prompt tokens were served
        from the prefix cache (0 without prefix caching).
    num_output_tokens: total generated so far.
    """

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int


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

    async def abort(self, request_id: str) -> None: ...

    def is_healthy(self) -> bool: ...
