"""The MTP layer as a drafter: one forward of the layer, and the k-step draft recurrence.

Sources for each choice (docs/design.md §3.6):
* Input fusion `u = eh_proj([enorm(embed(t_{i+1})) | hnorm(h_i)])`, embedding half first: the
  GLM-5.x / DeepSeek-V3 checkpoint (`eh_proj` is `[D, 2D]`), vLLM `deepseek_mtp.py`, SGLang
  `deepseek_nextn.py`. The embedding is zeroed at position 0 as vLLM's MTP forward does
  (docs/design.md §3.6); `zero_embed_pos0=False` gives the plain HF-block form our goldens use.
* Step 0's `h_i` is the backbone's final-normed hidden state (the `lm_head` input), the trained
  contract (vLLM's proposer, SGLang's `spec_info.hidden_states`).
* Steps ≥ 1 carry the MTP output AFTER `shared_head.norm` (post-norm), as SGLang's NextN layer
  returns it and as vLLM does since its GLM-5 fix (vllm#45895): carrying the pre-norm block
  output (the old DeepSeek form in vLLM) collapses GLM acceptance at draft positions ≥ 1
  (vllm#46075). `hnorm` is applied only at the input, to whatever hidden comes in.
* Drafts are greedy (argmax of the MTP logits over the reachable vocabulary), as vLLM's MTP/EAGLE
  proposer drafts; the verifier then treats each draft as a one-hot proposal
  (`serving.spec_decode.rejection`).
* `index_share_for_mtp_iteration`: draft steps 1…k−1 reuse draft step 0's indexer top-k unchanged
  (vLLM `set_skip_topk` + `compact_topk_indices`; SGLang `IndexTopKShareState`): their indexer does
  not run, and the positions drafted in this step are not added to the selection (neither
  reference adds them). Without it every step runs the MTP indexer over its own keys.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from glm53.batch import ForwardBatch
from glm53.hot_cache import HostAccess, PagedKV
from glm53.kv_layout import KVCacheLayout, mtp_index_layer, mtp_mla_layer
from glm53.layers import rope_cos_sin
from glm53.mla import LayerContext
from sharding.mesh import TOKENS, ParallelLayout, constrain


def mtp_forward(model, batch: ForwardBatch, hidden_TD: jax.Array, kv, layout: KVCacheLayout,
                parallel: ParallelLayout | None = None, prev_sel=None, zero_embed_pos0: bool = True,
                host: HostAccess | None = None):
    """One application of the MTP layer over `batch`: its latent rows are layer L of the `mla`
    group, its indexer keys layer F of the `indexer` group (`glm53.kv_layout.mtp_mla_layer`,
    `mtp_index_layer`).

    Row i pairs token `batch.input_ids_T[i]` (the token AFTER position `batch.positions_T[i]`) with
    `hidden_TD[i]` (the hidden state of position i). With `prev_sel` (top-k positions `[T, K]`,
    None) the layer's indexer does not run and that selection is used. With `host` (Hybrid
    HiSparse: `batch.hot` and a `PagedKV` with hot state) the layer resolves its top-k through
    the hot buffer as a full layer of its own, hot-state index group F, so its rows of pages off
    the device come from the host pool like the backbone's.

    Returns `(h_TD, kv, sel)`: `h_TD = shared_head.norm(block output)` (what `lm_head` reads and
    what the next draft step carries), the cache in the form given (arena or `PagedKV`), and the
    selection `(topk [T, K], slots)` the layer used.

    Raises ValueError when the model has no MTP layer."""
    if model.mtp is None:
        raise ValueError("this checkpoint has no MTP layer (num_nextn_predict_layers = 0)")
    cfg, m = model.cfg, model.mtp
    cos, sin = rope_cos_sin(batch.positions_T, cfg.qk_rope_head_dim, cfg.rope_theta)
    hot = host is not None and batch.hot is not None
    ctx = LayerContext(batch=batch, layout=layout, cos=cos, sin=sin, parallel=parallel,
                       reuse_topk=prev_sel is not None, host=host if hot else None)
    emb = constrain(model.embed_tokens(batch.input_ids_T), parallel, TOKENS, None)
    if zero_embed_pos0:
        emb = jnp.where((batch.positions_T == 0)[:, None], jnp.zeros_like(emb), emb)
    e = m.enorm(emb)
    u = m.eh_proj(jnp.concatenate([e, m.hnorm(hidden_TD.astype(e.dtype))], axis=-1))
    wrapped = isinstance(kv, PagedKV)
    x, kv, sel = m.block(u, kv if wrapped else PagedKV(kv), ctx, mtp_mla_layer(cfg), mtp_index_layer(cfg), prev_sel)
    return m.shared_head_norm(x), (kv if wrapped else kv.arena), sel


def _argmax_reachable(logits_BV: jax.Array, reachable: int) -> jax.Array:
    if reachable < logits_BV.shape[-1]:
        logits_BV = jnp.where(jnp.arange(logits_BV.shape[-1]) < reachable, logits_BV, -jnp.inf)
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)


def propose_drafts(model, batch: ForwardBatch, next_ids_T: jax.Array, hidden_TD: jax.Array, kv,
                   layout: KVCacheLayout, *, last_row_B: jax.Array, valid_B: jax.Array, num_steps: jax.Array,
                   k: int, reachable: int, parallel: ParallelLayout | None = None,
                   zero_embed_pos0: bool = True, host: HostAccess | None = None):
    """Draft `k` tokens per request with the MTP layer, inside the jitted step.

    Step 0 runs over every row of the step's `batch` (positions, slots and block tables as the
    target used; `host`: HiSparse host access, as `mtp_forward`): row i pairs `next_ids_T[i]`
    (the token after row i: the next scheduled token, the next prompt token at the end of a
    prefill chunk, or the token just accepted at a request's last accepted row) with the
    target's final-normed `hidden_TD[i]`, and writes the
    MTP KV of every row; rows past a request's last accepted one hold rejected drafts, and their
    KV is overwritten when those positions are computed again. The logits of row `last_row_B[b]`
    give draft 1. Steps 1 … `num_steps` − 1 (a traced scalar ≤ k: adaptive drafting runs fewer) run
    one row per request at position q + s (q = the last accepted position) with the previous
    draft and the previous step's post-norm hidden; under `index_share_for_mtp_iteration` they
    reuse step 0's top-k and write nothing, otherwise they run the indexer and write their KV
    where the request's pages reach (elsewhere the write is dropped).

    Args:
      batch: the step's ForwardBatch (T rows; its last block-table row is the all-null padding row).
      next_ids_T: int32 `[T]`. hidden_TD: the target's final-normed hidden states `[T, D]`.
      kv: the cache (arena or `PagedKV`), returned updated in the same form.
      last_row_B: int32 `[B]` row of each request's last accepted token (any row where not valid),
        for the first B block-table rows (B may be fewer than the batch's request rows); under
        data parallelism for each replica's first B / dp rows, replica-major.
      valid_B: bool `[B]`, requests that draft this step (their chunk sampled).
      num_steps: int32 scalar, drafted tokens wanted (≤ k; draft slots past it hold 0).
      k: static, the width of the draft array. reachable: ids ≥ it are never drafted.

    Returns `(drafts_BK int32 [B, k], kv)`.
    """
    cfg = model.cfg
    b0 = dataclasses.replace(batch, input_ids_T=next_ids_T)
    h_T, kv, sel = mtp_forward(model, b0, hidden_TD, kv, layout, parallel, zero_embed_pos0=zero_embed_pos0,
                               host=host)
    h_B = h_T[last_row_B]
    d_B = _argmax_reachable(model.logits(h_B), reachable)
    drafts = jnp.zeros((d_B.shape[0], k), jnp.int32).at[:, 0].set(d_B)
    if k == 1:
        return drafts, kv
    share = bool(cfg.index_share_for_mtp_iteration)
    topk0_BK = sel[0][last_row_B]
    B = last_row_B.shape[0]
    q_B = batch.positions_T[last_row_B]
    # Data parallel (dp replicas stacked replica-major): the B draft rows are every replica's
    # first B / dp request rows, the block tables every replica's n_rows / dp rows, and a token's
    # `req_idx` names a row of its own replica's table (glm53.parallel_batch).
    dp = parallel.dp if parallel is not None else 1
    rows_per_replica = batch.block_tables["mla"].shape[0] // dp
    b_B = jnp.arange(B, dtype=jnp.int32)
    # the replica's last table row is all null
    req_B = jnp.where(valid_B, b_B % (B // dp), rows_per_replica - 1)
    table_row_B = (b_B // (B // dp)) * rows_per_replica + req_B
    dcp = parallel.dcp if parallel is not None else 1

    def slots_of(g, pos):
        """Slot of position `pos` [B] in group g (−1 where the request's pages do not reach)."""
        bt = batch.block_tables[g]
        tpp = layout.group(g).tokens_per_page * dcp
        page = pos // tpp
        blk = bt[table_row_B, jnp.minimum(page, bt.shape[1] - 1)]
        return jnp.where(valid_B & (page < bt.shape[1]) & (blk > 0), blk * tpp + pos % tpp, -1).astype(jnp.int32)

    def body(s, carry):
        drafts, h_B, kv = carry
        pos = q_B + s
        none = jnp.full((B,), -1, jnp.int32)
        # Under index sharing a draft step writes nothing; otherwise its latent row and its
        # indexer key (the MTP layer's layers of the `mla` and `indexer` groups).
        written = () if share else ("mla", "indexer")
        bs = ForwardBatch(input_ids_T=drafts[:, s - 1], positions_T=pos.astype(jnp.int32), req_idx_T=req_B,
                          slot_mapping={g: (slots_of(g, pos) if g in written else none) for g in batch.slot_mapping},
                          block_tables=batch.block_tables, logits_indices_B=jnp.arange(B, dtype=jnp.int32),
                          hot=batch.hot)
        h_new, kv, _ = mtp_forward(model, bs, h_B, kv, layout, parallel,
                                   prev_sel=(topk0_BK, None) if share else None, zero_embed_pos0=zero_embed_pos0,
                                   host=host)
        d = _argmax_reachable(model.logits(h_new), reachable)
        drafts = drafts.at[:, s].set(d)
        return drafts, h_new.astype(h_B.dtype), kv

    drafts, _, kv = lax.fori_loop(1, jnp.clip(num_steps, 1, k), body, (drafts, h_B, kv))
    return drafts, kv
