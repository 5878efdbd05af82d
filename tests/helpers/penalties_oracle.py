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


def check_greedy_stream(lm, prompt: list[int], out: list[int], adjust: dict, reachable: int, lps=None) -> None:
    """Assert each token of `out` (the engine's greedy stream for `prompt` with the `SamplingParams`
    fields `adjust`) is the oracle's argmax, or within NEAR_TIE of its adjusted logit (then the rest
    follows another history and is not compared). lps: the engine's `TokenLogprobs` per token,
    checked against the raw distribution's log-softmax (to 2e-4), or None."""
    logits = api.forward(lm, prompt + out[:-1]).astype(np.float32)
    V = logits.shape[-1]
    P = len(prompt)
    rep = np.float32(adjust.get("repetition_penalty", 1.0))
    freq = np.float32(adjust.get("frequency_penalty", 0.0))
    pres = np.float32(adjust.get("presence_penalty", 0.0))
    bias = np.zeros(V, np.float32)
    for t, v in (adjust.get("logit_bias") or {}).items():
        bias[t] = v
    in_prompt = np.zeros(V, bool)
    in_prompt[prompt] = True
    for j, tok in enumerate(out):
        raw = logits[P - 1 + j].copy()
        raw[reachable:] = -np.inf
        if lps:
            ref = raw.astype(np.float64) - np.log(np.exp(raw[:reachable].astype(np.float64)).sum())
            assert lps[j].token_id == tok and abs(lps[j].logprob - ref[tok]) < 2e-4, (j, lps[j], ref[tok])
        x = raw + bias
        counts = np.bincount(np.asarray(out[:j], np.int64), minlength=V).astype(np.float32)
        x = np.where(in_prompt | (counts > 0), np.where(x > 0, x / rep, x * rep), x)
        x = x - freq * counts - pres * (counts > 0)
        want = int(np.argmax(x))
        if tok != want:
            assert x[want] - x[tok] < NEAR_TIE, f"token {j}: engine {tok}, oracle {want} ({x[want]} vs {x[tok]})"
            return
