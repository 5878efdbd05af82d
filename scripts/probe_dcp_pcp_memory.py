"""Per-GPU temporary memory of one sparse-MLA layer under DCP over PCP at the reference's sizes.

    PYTHONPATH=. .venv/bin/python scripts/probe_dcp_pcp_memory.py --out DIR

The reference's prefill engine runs PCP8 x DCP8: every rank holds an eighth of each request's
latent rows, and a rank's queries select rows that other ranks hold. This probe compiles (does not
run) one layer's `glm53.attention.sparse_attention` for GLM-5.3's real shapes (64 heads, the
576-wide absorbed query, kv_lora_rank 512, FP8 rows of 656 B, index_topk 2,048) and its indexer's
`select_topk` (32 index heads of 128) on 8 simulated CPU
devices, for a prefill chunk (`--max-num-batched-tokens` 8,192) and a decode step (256 requests),
at several `--max-num-seqs` / `--max-model-len`, and prints XLA's temporary allocation per device
(`compiled.memory_analysis().temp_size_in_bytes`: what the layer needs beside its arguments and
outputs). Compile-time figures of XLA:CPU's buffer assignment, not a GPU measurement; they show
which sizes each way of reading the sharded cache depends on. Writes DIR/dcp_pcp_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

# (step, tokens in the step, --max-num-seqs, --max-model-len)
CASES = [("prefill", 8192, 16, 131072), ("prefill", 8192, 256, 131072), ("prefill", 8192, 16, 1048576),
         ("decode", 256, 256, 131072), ("decode", 256, 256, 1048576)]


def temp_bytes(kind: str, tokens: int, max_num_seqs: int, max_model_len: int) -> tuple[int, int]:
    """(sparse MLA's, the indexer's) temporary bytes per device for one layer."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from glm53.attention import select_topk, sparse_attention
    from glm53.config import GLM53_HF_CONFIG, GlmConfig
    from glm53.kv_layout import build_kv_layout
    from glm53.parallel_batch import replica_batch, shard_batch, stack_replicas
    from sharding.mesh import ATTN_HEADS, KV_CONTEXT, KV_REPLICA, TOKENS, ParallelConfig, ParallelLayout

    cfg = GlmConfig.from_hf_config(GLM53_HF_CONFIG)
    layout = build_kv_layout(cfg, "fp8")
    par = ParallelLayout.create(ParallelConfig(prefill_context_parallel_size=8, decode_context_parallel_size=8))
    dcp = par.dcp
    pages = {g.name: -(-max_model_len // (g.tokens_per_page * dcp)) for g in layout.groups}
    # The batch: a prefill chunk of one request at the end of a max_model_len context, or one token
    # for each of `tokens` requests; block tables of max_num_seqs + 1 rows, each max_model_len wide.
    if kind == "prefill":
        reqs = [(np.zeros(tokens, np.int32), max_model_len - tokens, {n: list(range(1, p + 1)) for n, p in pages.items()})]
    else:
        reqs = [(np.zeros(1, np.int32), max_model_len - 1, {n: list(range(1, p + 1)) for n, p in pages.items()})
                for _ in range(tokens)]
    batch = shard_batch(stack_replicas([replica_batch(layout, reqs, tokens, max_num_seqs + 1, dcp)], par.pcp), par)
    heads, width = cfg.num_attention_heads, cfg.kv_lora_rank + cfg.qk_rope_head_dim
    sds = lambda shape, dtype, spec: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(par.mesh, spec))  # noqa: E731
    q = sds((tokens, heads, width), jnp.bfloat16, par.spec(TOKENS, ATTN_HEADS, None))
    topk = sds((tokens, cfg.index_topk), jnp.int32, par.spec(TOKENS, None))
    arena = sds((dcp * 1024, layout.page_words), jnp.uint32, par.spec((KV_REPLICA, KV_CONTEXT), None))
    fn = jax.jit(lambda q, a, t, b: sparse_attention(q, a, t, b, layout, "mla", 0, kv_lora_rank=cfg.kv_lora_rank,
                                                     scale=1.0, parallel=par))
    mla = int(fn.lower(q, arena, topk, batch).compile().memory_analysis().temp_size_in_bytes)
    iq = sds((tokens, cfg.index_n_heads, cfg.index_head_dim), jnp.bfloat16, par.spec(TOKENS, None, None))
    w = sds((tokens, cfg.index_n_heads), jnp.float32, par.spec(TOKENS, None))
    fi = jax.jit(lambda q, w, a, b: select_topk(q, w, a, b, layout, "indexer", 0, cfg.index_topk, parallel=par))
    idx = int(fi.lower(iq, w, arena, batch).compile().memory_analysis().temp_size_in_bytes)
    return mla, idx


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, check=False,
                            text=True).stdout.strip()
    rows = []
    for kind, tokens, mns, mml in CASES:
        mla, idx = temp_bytes(kind, tokens, mns, mml)
        rows.append({"commit": commit, "step": kind, "tokens": tokens, "max_num_seqs": mns, "max_model_len": mml,
                     "sparse_mla_temp_bytes_per_device": mla, "indexer_temp_bytes_per_device": idx})
        print(f"{kind:>7} T={tokens:>5} max_num_seqs={mns:>3} max_model_len={mml:>8}: sparse MLA "
              f"{mla / 2**30:6.2f} GiB, indexer {idx / 2**30:6.2f} GiB temporary per device", flush=True)
    (args.out / "dcp_pcp_memory.json").write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
