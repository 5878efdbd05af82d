"""Long-context run of the tiny model on the reference kernels: prefill 32K and 128K tokens, decode.

    PYTHONPATH=. nice python scripts/long_context.py --out /tmp/long_context
    PYTHONPATH=. python scripts/long_context.py --out DIR --lengths 8192 --kv-cache-dtype fp8

For each length (each in a fresh subprocess, so peak RSS is per length): one prefill step over
the whole prompt (random token ids) on a paged cache, then `--decode-tokens` greedy decode
steps. Records compile time, prefill time and tokens/s, decode tokens/s (compile excluded) and
the peak RSS (`resource.getrusage(RUSAGE_SELF).ru_maxrss`) to DIR/long_context.json and prints
them. It also prints the indexer reference's compiled temporary memory for a 32K × 32K prefill
(from XLA's `memory_analysis()`), at the GLM-5.3 indexer shapes (32 heads × 128, top-k 2048)
and at the tiny model's, for the fp8 and bf16 key formats. Runs on the default JAX backend.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time


def indexer_temporaries(T: int, S: int, heads: int, dim: int, topk: int, row_dtype: str) -> dict:
    """Compiled memory of `indexer_topk_reference` for a T-query prefill over S keys (one request)."""
    import jax
    import jax.numpy as jnp

    from kernels.indexer_topk.reference import indexer_topk_reference
    from kernels.paged import CacheComponent, GroupLayout

    tpp = 64
    lay = GroupLayout("indexer", tpp, (CacheComponent("indexer", 1, dim, row_dtype),))
    P = math.ceil(S / tpp)
    sds = jax.ShapeDtypeStruct
    args = (sds((T, heads, dim), jnp.bfloat16), sds((T, heads), jnp.float32),
            sds((P + 1, lay.words_per_page), jnp.uint32), sds((1, P), jnp.int32), sds((T,), jnp.int32),
            sds((T,), jnp.int32), 0)
    fn = jax.jit(lambda *a: indexer_topk_reference(*a, layout=lay, topk=topk))
    m = fn.lower(*args).compile().memory_analysis()
    return {"T": T, "S": S, "heads": heads, "dim": dim, "topk": topk, "row_dtype": row_dtype,
            "temp_bytes": int(m.temp_size_in_bytes), "argument_bytes": int(m.argument_size_in_bytes),
            "output_bytes": int(m.output_size_in_bytes)}


def run_one(n: int, decode_tokens: int, cache_dtype: str, seed: int) -> dict:
    """Prefill n random tokens with the tiny model, then greedy-decode; returns the measurements."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from glm53 import api
    from glm53.batch import single_sequence_batch

    lm = api.load(cache_dtype=cache_dtype)
    cfg = lm.config
    prompt = [int(t) for t in np.random.default_rng(seed).integers(5, cfg.vocab_size, n)]
    pages, nblocks = api._pages(lm, n + decode_tokens)
    arena = lm.layout.empty_arena(nblocks)
    graphdef, state = nnx.split(lm.model)
    step = api._compiled(graphdef, lm.layout)

    def batch_for(tokens, start):
        return jax.tree.map(jnp.asarray, single_sequence_batch(lm.layout, tokens, start, pages, logits_all=False))

    b = batch_for(prompt, 0)
    t0 = time.perf_counter()
    prefill = step.lower(state, b, arena).compile()
    compile_prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    logits, _, arena = prefill(state, b, arena)
    logits.block_until_ready()
    prefill_s = time.perf_counter() - t0

    tokens = [int(np.argmax(np.asarray(logits[-1])))]
    b = batch_for(tokens[-1:], n)
    t0 = time.perf_counter()
    decode = step.lower(state, b, arena).compile()
    compile_decode = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(decode_tokens):
        logits, _, arena = decode(state, batch_for(tokens[-1:], n + i), arena)
        tokens.append(int(np.argmax(np.asarray(logits[-1]))))
    decode_s = time.perf_counter() - t0
    last = np.asarray(logits[-1])
    return {
        "prompt_tokens": n, "kv_cache_dtype": cache_dtype, "decode_tokens": decode_tokens,
        "backend": jax.default_backend(), "kv_arena_bytes": int(arena.nbytes),
        "compile_prefill_s": round(compile_prefill, 2), "prefill_s": round(prefill_s, 2),
        "prefill_tok_per_s": round(n / prefill_s, 1), "compile_decode_s": round(compile_decode, 2),
        "decode_s": round(decode_s, 3), "decode_tok_per_s": round(decode_tokens / decode_s, 2),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "generated": tokens, "last_logits_finite": bool(np.isfinite(last).all()),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="Directory for long_context.json.")
    p.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--decode-tokens", type=int, default=8)
    p.add_argument("--kv-cache-dtype", default="bfloat16", type=lambda v: {"bf16": "bfloat16", "fp32": "float32"}.get(v, v),
                   choices=["float32", "bfloat16", "fp8"], help="float32, bfloat16 (default) or fp8; bf16 / fp32 too")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-memory-analysis", action="store_true")
    p.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # child mode: one length
    args = p.parse_args(argv)

    if args.one is not None:
        print(json.dumps(run_one(args.one, args.decode_tokens, args.kv_cache_dtype, args.seed)))
        return 0

    os.makedirs(args.out, exist_ok=True)
    result = {"runs": [], "indexer_memory": []}
    if not args.skip_memory_analysis:
        for heads, dim, topk, name in ((32, 128, 2048, "glm-5.3"), (4, 32, 64, "tiny")):
            for rd in ("fp8_per_token_hadamard", "bfloat16"):
                m = indexer_temporaries(32768, 32768, heads, dim, topk, rd)
                m["shapes"] = name
                result["indexer_memory"].append(m)
                print(f"indexer reference 32K x 32K prefill ({name}: {heads} heads x {dim}, top-k {topk}, {rd}): "
                      f"temporaries {m['temp_bytes'] / 2**20:.1f} MiB (arguments {m['argument_bytes'] / 2**20:.1f} MiB, "
                      f"output {m['output_bytes'] / 2**20:.1f} MiB)", flush=True)
    for n in args.lengths:
        cmd = [sys.executable, __file__, "--out", args.out, "--one", str(n), "--decode-tokens",
               str(args.decode_tokens), "--kv-cache-dtype", args.kv_cache_dtype, "--seed", str(args.seed)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr)
            raise SystemExit(f"length {n} failed (exit {proc.returncode})")
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        r["wall_s"] = round(time.perf_counter() - t0, 1)
        result["runs"].append(r)
        print(f"{n:>7} tokens ({r['kv_cache_dtype']} cache, {r['backend']}): prefill {r['prefill_s']:.1f} s "
              f"({r['prefill_tok_per_s']:.0f} tok/s, compile {r['compile_prefill_s']:.1f} s), decode "
              f"{r['decode_tok_per_s']:.2f} tok/s over {r['decode_tokens']} tokens, peak RSS {r['peak_rss_mib']:.0f} MiB, "
              f"KV arena {r['kv_arena_bytes'] / 2**20:.0f} MiB", flush=True)
        with open(os.path.join(args.out, "long_context.json"), "w") as f:
            json.dump(result, f, indent=2)
    with open(os.path.join(args.out, "long_context.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {os.path.join(args.out, 'long_context.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
