"""An oracle for greedy streams under presence / frequency / repetition penalties and `logit_bias`
(tests/serving/test_penalties.py, tests/sharding/test_engine_dp.py), independent of the engine's
paged step and its sparse lists: one full forward of the prompt and the output (`glm53.api.forward`,
a fresh cache) and, at each output position, vLLM's definitions transcribed densely in NumPy over
the whole vocabulary — the logit bias, then the repetition penalty on ids in the prompt or the
output so far (x / r when x > 0, else x · r), then x −= frequency · count + presence · (count > 0)
over the output so far (vLLM's v1 sampler; `vllm.model_executor.layers.utils.apply_penalties`)."""

from __future__ import annotations

import numpy as np

from glm53 import api

NEAR_TIE = 1e-3  # the engine's and the oracle's summation orders differ: a closer pair may swap


def vllm_adjusted(raw_V: np.ndarray, prompt, output, logit_bias: dict | None, presence: float, frequency: float,
                  repetition: float) -> np.ndarray:
    """vLLM's adjustments of one row's logits `[V]` (fp32), densely over the vocabulary: the logit
    bias, then the repetition penalty on ids in `prompt` or `output` (token lists), then the
    frequency and presence penalties on `output`'s counts."""
    x = raw_V.astype(np.float32).copy()
    V = x.shape[-1]
    for t, v in (logit_bias or {}).items():
        x[t] += np.float32(v)
    in_prompt = np.zeros(V, bool)
    in_prompt[list(prompt)] = True
    counts = np.bincount(np.asarray(output, np.int64), minlength=V).astype(np.float32)
    rep = np.float32(repetition)
    x = np.where(in_prompt | (counts > 0), np.where(x > 0, x / rep, x * rep), x)
    return x - np.float32(frequency) * counts - np.float32(presence) * (counts > 0)


def check_greedy_stream(lm, prompt: list[int], out: list[int], adjust: dict, reachable: int, lps=None) -> None:
    """Assert each token of `out` (the engine's greedy stream for `prompt` with the `SamplingParams`
    fields `adjust`) is the oracle's argmax, or within NEAR_TIE of its adjusted logit (then the rest
    follows another history and is not compared). lps: the engine's `TokenLogprobs` per token,
    checked against the raw distribution's log-softmax (to 2e-4), or None."""
    logits = api.forward(lm, prompt + out[:-1]).astype(np.float32)
    P = len(prompt)
    for j, tok in enumerate(out):
        raw = logits[P - 1 + j].copy()
        raw[reachable:] = -np.inf
        if lps:
            ref = raw.astype(np.float64) - np.log(np.exp(raw[:reachable].astype(np.float64)).sum())
            assert lps[j].token_id == tok and abs(lps[j].logprob - ref[tok]) < 2e-4, (j, lps[j], ref[tok])
        x = vllm_adjusted(raw, prompt, out[:j], adjust.get("logit_bias"), adjust.get("presence_penalty", 0.0),
                          adjust.get("frequency_penalty", 0.0), adjust.get("repetition_penalty", 1.0))
        want = int(np.argmax(x))
        if tok != want:
            assert x[want] - x[tok] < NEAR_TIE, f"token {j}: engine {tok}, oracle {want} ({x[want]} vs {x[tok]})"
            return
