"""What logprobs and temperature sampling cost per step: decode steps of the tiny checkpoint with
and without `logprobs`, and the step's sampling head alone (`sample_with_logprobs`) at GLM-5.3's
vocabulary on this machine's default device.

    PYTHONPATH=. python scripts/bench_logprobs_cost.py [--batch 8] [--tokens 48] [--repeats 3] [--out DIR]

Prints the median device time per decode step (the jitted step, from dispatch to the sampled
tokens on the host) for greedy decoding without logprobs and with `logprobs=5` on every request,
and the time of the jitted sampling head on random logits `[rows, 154880]` for all-greedy and
all-temperature-1 rows, with and without logprobs (work no row needs is skipped by `lax.cond`),
and temperature 1 with the top-k and min-p filters on.
With `--out` writes `DIR/bench_logprobs_cost.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from serving.llm import LLM  # noqa: E402
from serving.sampling import sample_with_logprobs  # noqa: E402
from serving.types import SamplingParams  # noqa: E402

GLM53_VOCAB = 154880


def decode_step_ms(llm: LLM, batch: int, tokens: int, logprobs: int | None) -> float:
    """Median device ms of the decode steps of one batch of greedy requests."""
    engine = llm.engine
    times: list[float] = []
    step = engine.step

    def timed():
        outs = step()
        if engine.runner.last.num_tokens == batch:  # decode steps only
            times.append(engine.runner.last.device_s)
        return outs

    engine.step = timed
    try:
        prompts = [[10 + i, 20 + i, 30 + i] for i in range(batch)]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=logprobs))
    finally:
        engine.step = step
    return 1e3 * statistics.median(times)


def head_ms(rows: int, k: int, repeats: int = 5) -> dict[str, float]:
    """ms of one compiled sampling head on random logits [rows, GLM53_VOCAB], per configuration
    (top_k 50 and min_p 0.05 on every row in the "filtered" one; off — 0 — in the others)."""
    logits = jax.random.normal(jax.random.PRNGKey(0), (rows, GLM53_VOCAB), jnp.float32)
    o, s, st = jnp.ones(rows, jnp.float32), jnp.zeros(rows, jnp.uint32), jnp.zeros(rows, jnp.int32)
    head = jax.jit(lambda x, t, tk, mp, lp: sample_with_logprobs(x, t, o, tk, mp, s, st, lp, k))
    off = (jnp.zeros(rows, jnp.int32), jnp.zeros(rows, jnp.float32))
    on = (jnp.full(rows, 50, jnp.int32), jnp.full(rows, 0.05, jnp.float32))
    out = {}
    for name, temp, filters, lp in (("greedy", 0.0, off, False), ("greedy + logprobs", 0.0, off, True),
                                    ("temperature 1", 1.0, off, False), ("temperature 1 + logprobs", 1.0, off, True),
                                    ("temperature 1, top_k 50, min_p 0.05", 1.0, on, False)):
        args = (logits, jnp.full(rows, temp, jnp.float32), *filters, jnp.bool_(lp))
        jax.block_until_ready(head(*args))
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(head(*args))
            ts.append(time.perf_counter() - t0)
        out[name] = 1e3 * statistics.median(ts)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--head-rows", type=int, default=65)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    llm = LLM(max_model_len=256, max_num_seqs=a.batch, max_num_batched_tokens=64)
    llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2, logprobs=5))  # warm-up
    rows = []
    for r in range(a.repeats):
        for lp in (None, 5):
            ms = decode_step_ms(llm, a.batch, a.tokens, lp)
            rows.append(dict(repeat=r, logprobs=lp, decode_step_ms=ms))
            print(f"tiny model, batch {a.batch}, logprobs={lp}: {ms:.2f} ms per decode step")
    off = statistics.median(x["decode_step_ms"] for x in rows if x["logprobs"] is None)
    on = statistics.median(x["decode_step_ms"] for x in rows if x["logprobs"] is not None)
    head = head_ms(a.head_rows, llm.engine.args.max_logprobs)
    print(f"median decode step: {off:.2f} ms without logprobs, {on:.2f} ms with ({on - off:+.2f} ms)")
    print(f"sampling head on [{a.head_rows}, {GLM53_VOCAB}] logits ({jax.default_backend()}): "
          + ", ".join(f"{name} {ms:.2f} ms" for name, ms in head.items()))
    summary = dict(batch=a.batch, decode_step_ms_without=off, decode_step_ms_with=on, head_rows=a.head_rows,
                   head_ms=head, backend=jax.default_backend(), rows=rows)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "bench_logprobs_cost.json"), "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
