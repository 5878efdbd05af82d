"""Offline batch API over the same engine as the server (after vLLM's `LLM`).

    from serving.llm import LLM
    from serving.types import SamplingParams
    llm = LLM(max_model_len=1024, enable_prefix_caching=True)      # the tiny checkpoint
    outs = llm.generate(["Hello", [11, 12, 13]], SamplingParams(temperature=0, max_tokens=8))
    print(outs[0].outputs[0].text)
    outs = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=8))

`generate` submits every prompt (times `n`) to one `LLMEngine` and steps it until all finish, so
the prompts are batched exactly as concurrent server requests are; outputs come back in prompt
order. Stop strings, logprobs and detokenization use the server's code
(`serving.output_processor`).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
from tqdm import tqdm

from serving.engine import EngineArgs
from serving.engine_factory import build_engine
from serving.output_processor import RequestTextState
from serving.types import SamplingParams, TokenLogprobs, is_integer


@dataclass
class CompletionOutput:
    """One sample of a prompt.

    index: the sample's index among the prompt's `n`. text: the detokenized output (stop string
    excluded). token_ids: generated ids (up to the one that completed a stop string).
    logprobs: per token, when requested. finish_reason: "stop", "length" or "abort".
    stop_reason: the stop string or `stop_token_ids` entry that ended the sample (None for EOS,
    the length limit or an abort), as vLLM's.
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None
    stop_reason: int | str | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        """Sum of the sampled tokens' log-probabilities (None without logprobs)."""
        return None if self.logprobs is None else float(sum(lp.logprob for lp in self.logprobs))


@dataclass
class GenerationOutput:
    """All samples of one prompt: `prompt` (the text, or None for a token prompt),
    `prompt_token_ids`, `outputs` (n of them, by index), `num_cached_tokens` (prompt tokens
    served from the prefix cache for the first sample) and `prompt_logprobs` (with
    `SamplingParams.prompt_logprobs`, as vLLM's: one entry per prompt token, None for the first,
    else the prompt token's `TokenLogprobs` with its rank and top alternatives; None otherwise)."""

    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class LLM:
    """Load a checkpoint and generate offline.

    Args:
      model: checkpoint directory (None: the embedded tiny checkpoint).
      tokenizer: optional tokenizer: a directory with a tokenizer.json (vLLM's `tokenizer=`) or an
        object with `encode`, `decode` and `apply_chat_template`; default: the checkpoint's.
      generation_config: where `get_default_sampling_params` (what `generate` and `chat` use when
        given no `SamplingParams`) comes from: "auto" (default) the checkpoint's
        generation_config.json, "vllm" `SamplingParams()`, or a directory holding one (vLLM's
        argument; `serving.generation_defaults`).
      **engine_args: any `EngineArgs` field (max_model_len, max_num_seqs, max_num_batched_tokens,
        enable_prefix_caching, gpu_memory_utilization, num_gpu_blocks_override, seed,
        speculative_config, ...). `compile_progress` defaults to True: start-up shows a progress
        bar over the step buckets it compiles. Compiled steps go to the persistent compilation
        cache the server uses (`glm53.compile_cache`), so a second `LLM(...)` with the same
        settings starts in seconds.

    Raises:
      TypeError: an unknown engine argument, or a tokenizer that is neither. ValueError: as
        `serving.engine_factory.build_engine`, or a generation config that cannot be read or is out
        of range (`GenerationConfigError`); FileNotFoundError: no tokenizer.json.
    """

    def __init__(self, model: str | None = None, tokenizer: Any = None, generation_config: str = "auto",
                 **engine_args: Any):
        names = {f.name for f in dataclasses.fields(EngineArgs)}
        unknown = sorted(set(engine_args) - names)
        if unknown:
            raise TypeError(f"unknown engine arguments {unknown}; known: {sorted(names)}")
        from glm53.compile_cache import enable_compilation_cache
        from glm53.tokenizer import GlmTokenizer

        if isinstance(tokenizer, (str, os.PathLike)):  # a directory, as vLLM's `tokenizer=` takes
            tokenizer = GlmTokenizer.from_pretrained(tokenizer)
        elif tokenizer is not None and not all(hasattr(tokenizer, a) for a in ("encode", "decode")):
            raise TypeError(f"tokenizer must be a directory or an object with encode and decode, got "
                            f"{type(tokenizer).__name__}")
        enable_compilation_cache()
        engine_args.setdefault("compile_progress", True)
        engine_args.setdefault("disable_log_stats", True)
        self.engine = build_engine(EngineArgs(model=model, **engine_args))
        self.engine.start_structured_precompile(default=False)  # only when structured_outputs_config asks
        if tokenizer is None:
            tokenizer = GlmTokenizer.from_pretrained(self.engine.model_path)
        self.tokenizer = tokenizer
        from serving.generation_defaults import load_generation_defaults

        self._generation_defaults = load_generation_defaults(generation_config, self.engine.model_path)
        self._ids = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """`SamplingParams()` with the generation config's temperature, top_p, top_k, min_p,
        repetition_penalty and max_new_tokens (as max_tokens) where it gives them (vLLM's method)."""
        return SamplingParams(**self._generation_defaults)

    # ------------------------------------------------------------------ generate
    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int] | Mapping[str, Any]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[GenerationOutput]:
        """Generate for every prompt; outputs in prompt order.

        prompts: one prompt or a list. A prompt is a string, a list of token ids, or a dict with
            `prompt_token_ids` (vLLM's TokensPrompt) or `prompt`. A flat list of ints is one
            token prompt.
        sampling_params: one for all prompts, or one per prompt (default
            `get_default_sampling_params()`).

        Raises:
          ValueError: a bad prompt or params (nothing is left queued in the engine).
        """
        items = self._normalise(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(items)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(items):
                raise ValueError(f"{len(params_list)} sampling params for {len(items)} prompts")
        return self._run(items, params_list, use_tqdm)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        use_tqdm: bool = False,
    ) -> list[GenerationOutput]:
        """Render one conversation (a list of messages) or several with the checkpoint's chat
        template (generation prompt added) and generate for each; outputs in order."""
        convs = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        prompts = [
            self.tokenizer.apply_chat_template(
                [dict(m) for m in conv], tools=tools, add_generation_prompt=True, **dict(chat_template_kwargs or {}))
            for conv in convs
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    # ------------------------------------------------------------------ internals
    def _normalise(self, prompts: Any) -> list[tuple[str | None, list[int]]]:
        """One prompt or a list of them (str, token ids as a list or a 1-D numpy array, or a
        `{"prompt": str}` / `{"prompt_token_ids": ids}` dict; a 2-D array is a batch) → (text or
        None, token ids) per prompt. Raises ValueError for anything else."""
        if isinstance(prompts, np.ndarray):
            prompts = [prompts] if prompts.ndim == 1 else list(prompts)
        elif isinstance(prompts, (str, Mapping)) or (
            isinstance(prompts, Sequence) and prompts and all(is_integer(t) for t in prompts)
        ):
            prompts = [prompts]
        items = []
        for p in prompts:
            if isinstance(p, Mapping):
                if "prompt_token_ids" in p:
                    p = p["prompt_token_ids"]
                elif "prompt" in p:
                    p = p["prompt"]
                else:
                    raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(p)}")
            if isinstance(p, str):
                items.append((p, list(self.tokenizer.encode(p))))
                continue
            if isinstance(p, np.ndarray) and p.ndim != 1:
                raise ValueError(f"a token-id prompt must be 1-D, got an array of shape {p.shape}")
            if not isinstance(p, (Sequence, np.ndarray)) or not all(is_integer(t) for t in p):
                raise ValueError(f"a prompt must be a string or a sequence of token ids (integers), got {p!r:.200}")
            items.append((None, [int(t) for t in p]))
        return items

    def _run(self, items, params_list, use_tqdm: bool) -> list[GenerationOutput]:
        engine = self.engine
        results = [GenerationOutput(text, ids) for text, ids in items]
        states: dict[str, tuple[int, int, RequestTextState]] = {}
        try:
            for i, ((_, ids), params) in enumerate(zip(items, params_list)):
                params.validate()
                for j in range(params.n):
                    child = dataclasses.replace(params, n=1, stop=list(params.stop), stop_token_ids=list(
                        params.stop_token_ids), seed=None if params.seed is None else params.seed + j)
                    rid = f"llm-{next(self._ids)}"
                    engine.add_request(rid, ids, child)
                    states[rid] = (i, j, RequestTextState(self.tokenizer, child, len(ids)))
        except BaseException:
            for rid in states:
                engine.abort(rid)
            raise
        bar = tqdm(total=len(states), desc="generating", disable=not use_tqdm, unit="req")
        pending = set(states)
        try:
            while pending:
                outs = engine.step() if engine.has_unfinished_requests() else []
                if not outs and not engine.has_unfinished_requests():
                    for rid in pending:  # cannot happen with a sound engine; do not hang
                        states[rid][2].finish("abort")
                    break
                for out in outs:
                    if out.request_id not in pending:
                        continue
                    st = states[out.request_id][2]
                    st.add(out)
                    if st.stopped and not out.finished:
                        engine.abort(out.request_id, "stop")
                    if st.finished:
                        pending.discard(out.request_id)
                        bar.update(1)
        finally:
            bar.close()
            for rid in pending:
                engine.abort(rid)
        for rid, (i, j, st) in states.items():
            res = results[i]
            if j == 0:
                res.num_cached_tokens = st.num_cached_tokens
                res.prompt_logprobs = st.prompt_logprobs
            res.outputs.append(CompletionOutput(
                j, st.text, st.token_ids, st.logprobs if st.params.logprobs is not None else None, st.finish_reason,
                st.stop_reason))
        for res in results:
            res.outputs.sort(key=lambda o: o.index)
        return results
