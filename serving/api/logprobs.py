"""OpenAI `logprobs` bodies from the engine's `TokenLogprobs` (chat and legacy completions shapes).

Token strings are the tokenizer's text for the single token (special tokens kept); a byte-level
token that is only part of a UTF-8 character decodes to U+FFFD, so chat entries also carry the
token's raw `bytes` (`GlmTokenizer.token_bytes`), as OpenAI's do: joined in order they give the
UTF-8 of the text.
"""

from __future__ import annotations

from typing import Any

from serving.api.protocol import (
    ChatChoiceLogprobs,
    ChatTokenLogprob,
    ChatTokenLogprobContent,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
)
from serving.types import TokenLogprobs


def token_text(tokenizer: Any, token_id: int) -> str:
    """The text of one token id (special tokens included)."""
    return tokenizer.decode([int(token_id)], skip_special_tokens=False)


def chat_logprobs(tokenizer: Any, lps: list[TokenLogprobs], top_n: int) -> ChatChoiceLogprobs:
    """`choices[i].logprobs` of a chat completion: one `content` entry per token, each with its
    `top_n` most likely alternatives."""

    raw = getattr(tokenizer, "token_bytes", None)

    def entry(tid: int, lp: float) -> ChatTokenLogprob:
        text = token_text(tokenizer, tid)
        data = raw(tid) if raw is not None else text.encode("utf-8")
        return ChatTokenLogprob(token=text, logprob=lp, bytes=list(data))

    content = []
    for t in lps:
        e = entry(t.token_id, t.logprob)
        content.append(ChatTokenLogprobContent(
            token=e.token, logprob=e.logprob, bytes=e.bytes,
            top_logprobs=[entry(i, lp) for i, lp in t.top[:top_n]]))
    return ChatChoiceLogprobs(content=content)


def completion_logprobs(
    tokenizer: Any, lps: list[TokenLogprobs], top_n: int, offset: int = 0,
    echo: tuple[list[int], list[TokenLogprobs | None]] | None = None,
) -> CompletionLogprobs:
    """`choices[i].logprobs` of a completion: parallel lists per token. `top_logprobs[k]` maps
    the `top_n` most likely tokens (and the sampled one) to their log-probabilities;
    `text_offset` counts characters from `offset` (the text already sent for this choice).
    echo: (the prompt's token ids, their prompt logprobs) to lead the lists (completions' `echo`,
    as vLLM gives them: an entry None — the first token's — has null for its logprob and its
    `top_logprobs`), the offsets running on from the prompt into the output."""
    out = CompletionLogprobs()
    entries = list(zip(*echo)) if echo is not None else []
    for tid, t in entries + [(t.token_id, t) for t in lps]:
        text = token_text(tokenizer, tid)
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        if t is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(t.logprob)
        top = {token_text(tokenizer, i): lp for i, lp in t.top[:top_n]}
        top.setdefault(text, t.logprob)
        out.top_logprobs.append(top)
    return out


def prompt_logprobs_body(tokenizer: Any, entries: list[TokenLogprobs | None] | None) -> PromptLogprobs | None:
    """vLLM's `prompt_logprobs` from the engine's (`RequestOutput.prompt_logprobs`): per prompt
    token None (the first) or {token id: {logprob, rank, decoded_token}} holding the prompt token
    (with its rank) and its top alternatives (their ranks: 1, 2, ...)."""
    if entries is None:
        return None
    out: PromptLogprobs = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        d = {str(i): PromptLogprob(logprob=lp, rank=r + 1, decoded_token=token_text(tokenizer, i))
             for r, (i, lp) in enumerate(e.top)}
        d[str(e.token_id)] = PromptLogprob(logprob=e.logprob, rank=e.rank, decoded_token=token_text(tokenizer, e.token_id))
        out.append(d)
    return out

