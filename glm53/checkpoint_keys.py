"""The tensor names, shapes and dtypes of an HF `glm_moe_dsa` (GLM-5.x) bf16 checkpoint.

One source of truth for the checkpoint layout (docs/design.md §3.7): the tiny checkpoint writer
generates exactly these tensors and the loader uses the same table to report missing,
unexpected or mis-shaped tensors. Linear weights are `[out, in]`. Everything is bfloat16 except
the MoE router (`mlp.gate.weight` and `mlp.gate.e_score_correction_bias`), which is float32.

The MTP layers are stored after the backbone as `model.layers.{num_hidden_layers + k}`; each is a
full MoE decoder layer with its own indexer plus `enorm`, `hnorm`, `eh_proj` and
`shared_head.norm` (the embedding and `lm_head` are shared with the backbone and not repeated).
"""

from __future__ import annotations

from glm53.config import GlmConfig

BF16 = "bfloat16"
F32 = "float32"

Shape = tuple[int, ...]
ShapeTable = dict[str, tuple[Shape, str]]


def _attention(cfg: GlmConfig, p: str, with_indexer: bool) -> ShapeTable:
    h, n = cfg.hidden_size, cfg.num_attention_heads
    out: ShapeTable = {
        f"{p}.self_attn.q_a_proj.weight": ((cfg.q_lora_rank, h), BF16),
        f"{p}.self_attn.q_a_layernorm.weight": ((cfg.q_lora_rank,), BF16),
        f"{p}.self_attn.q_b_proj.weight": ((n * cfg.qk_head_dim, cfg.q_lora_rank), BF16),
        f"{p}.self_attn.kv_a_proj_with_mqa.weight": ((cfg.kv_lora_rank + cfg.qk_rope_head_dim, h), BF16),
        f"{p}.self_attn.kv_a_layernorm.weight": ((cfg.kv_lora_rank,), BF16),
        f"{p}.self_attn.kv_b_proj.weight": (
            (n * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
            BF16,
        ),
        f"{p}.self_attn.o_proj.weight": ((h, n * cfg.v_head_dim), BF16),
    }
    if with_indexer:
        ih, hd = cfg.index_n_heads, cfg.index_head_dim
        out.update(
            {
                f"{p}.self_attn.indexer.wq_b.weight": ((ih * hd, cfg.q_lora_rank), BF16),
                f"{p}.self_attn.indexer.wk.weight": ((hd, h), BF16),
                f"{p}.self_attn.indexer.k_norm.weight": ((hd,), BF16),
                f"{p}.self_attn.indexer.k_norm.bias": ((hd,), BF16),
                f"{p}.self_attn.indexer.weights_proj.weight": ((ih, h), BF16),
            }
        )
    return out


def _dense_mlp(cfg: GlmConfig, p: str) -> ShapeTable:
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {
        f"{p}.mlp.gate_proj.weight": ((i, h), BF16),
        f"{p}.mlp.up_proj.weight": ((i, h), BF16),
        f"{p}.mlp.down_proj.weight": ((h, i), BF16),
    }


def _moe_mlp(cfg: GlmConfig, p: str) -> ShapeTable:
    h, i, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
    out: ShapeTable = {
        f"{p}.mlp.gate.weight": ((e, h), F32),
        f"{p}.mlp.gate.e_score_correction_bias": ((e,), F32),
    }
    for j in range(e):
        out[f"{p}.mlp.experts.{j}.gate_proj.weight"] = ((i, h), BF16)
        out[f"{p}.mlp.experts.{j}.up_proj.weight"] = ((i, h), BF16)
        out[f"{p}.mlp.experts.{j}.down_proj.weight"] = ((h, i), BF16)
    si = i * cfg.n_shared_experts
    if si:
        out[f"{p}.mlp.shared_experts.gate_proj.weight"] = ((si, h), BF16)
        out[f"{p}.mlp.shared_experts.up_proj.weight"] = ((si, h), BF16)
        out[f"{p}.mlp.shared_experts.down_proj.weight"] = ((h, si), BF16)
    return out


def layer_checkpoint_shapes(config: GlmConfig, layer: int) -> ShapeTable:
    """Tensors of decoder layer `layer` (backbone `0 <= layer < num_hidden_layers`, or an MTP layer
    `num_hidden_layers <= layer < num_hidden_layers + num_nextn_predict_layers`).

    Returns `{name: (shape, dtype_name)}` in a fixed order. Backbone layers carry an indexer only
    when `config.indexer_types[layer] == "full"` and a dense MLP when
    `config.mlp_layer_types[layer] == "dense"`; MTP layers always have an indexer and an MoE MLP
    plus `enorm`, `hnorm`, `eh_proj [hidden, 2*hidden]` and `shared_head.norm`.
    Raises IndexError for a layer index outside that range.
    """
    n = config.num_hidden_layers
    h = config.hidden_size
    if not 0 <= layer < n + config.num_mtp_layers:
        raise IndexError(f"layer {layer} out of range [0, {n + config.num_mtp_layers})")
    mtp = layer >= n
    p = f"model.layers.{layer}"
    out: ShapeTable = {
        f"{p}.input_layernorm.weight": ((h,), BF16),
        f"{p}.post_attention_layernorm.weight": ((h,), BF16),
    }
    out.update(_attention(config, p, with_indexer=mtp or config.indexer_types[layer] == "full"))
    if not mtp and config.mlp_layer_types[layer] == "dense":
        out.update(_dense_mlp(config, p))
    else:
        out.update(_moe_mlp(config, p))
    if mtp:
        out.update(
            {
                f"{p}.enorm.weight": ((h,), BF16),
                f"{p}.hnorm.weight": ((h,), BF16),
                f"{p}.eh_proj.weight": ((h, 2 * h), BF16),
                f"{p}.shared_head.norm.weight": ((h,), BF16),
            }
        )
    return out


def expected_checkpoint_shapes(config: GlmConfig, *, include_mtp: bool = True) -> ShapeTable:
    """Every tensor of a bf16 HF checkpoint for `config`: `{name: (shape, dtype_name)}`.

    dtype names are numpy/ml_dtypes names ("bfloat16", "float32"). The order is fixed: top-level
    tensors, then layers 0.. in order (MTP layers last when `include_mtp`). `lm_head.weight` is
    omitted when `config.tie_word_embeddings` is true.
    """
    h, v = config.hidden_size, config.vocab_size
    out: ShapeTable = {
        "model.embed_tokens.weight": ((v, h), BF16),
        "model.norm.weight": ((h,), BF16),
    }
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = ((v, h), BF16)
    last = config.num_hidden_layers + (config.num_mtp_layers if include_mtp else 0)
    for layer in range(last):
        out.update(layer_checkpoint_shapes(config, layer))
    return out
