"""Config parsing: IndexShare plan precedence, GLM-5 / 5.1 / 5.3 variants, the stacked layout."""

import pytest

from glm53.config import GLM53_HF_CONFIG, ConfigError, GlmConfig, preset


def test_glm53_full_layers_and_groups():
    cfg = preset("glm-5.3")
    assert cfg.full_layers == (0, 1, 2) + tuple(range(6, 78, 4))
    assert len(cfg.full_layers) == 21 and cfg.indexer_types.count("shared") == 57
    groups = cfg.index_groups
    assert groups[:3] == ((0,), (1,), (2, 3, 4, 5)) and groups[-1] == (74, 75, 76, 77)
    plan = cfg.layer_plan
    assert (plan.head, plan.stack_start, plan.group_size, plan.num_stacked_groups) == (tuple(range(6)), 6, 4, 18)
    assert cfg.softmax_scale == 1 / 16 and cfg.mla_row_width == 576 and cfg.rope_theta == 8e6


def test_indexshare_precedence_list_then_pattern_then_freq():
    base = {**GLM53_HF_CONFIG, "num_hidden_layers": 6}
    by_freq = GlmConfig.from_hf_config(base)
    assert by_freq.indexer_types == ("full", "full", "full", "shared", "shared", "shared")
    by_pattern = GlmConfig.from_hf_config({**base, "index_topk_pattern": "FSFSFS"})
    assert by_pattern.indexer_types == ("full", "shared") * 3
    explicit = ["full"] * 6
    both = GlmConfig.from_hf_config({**base, "index_topk_pattern": "FSFSFS", "indexer_types": explicit})
    assert both.indexer_types == tuple(explicit)


def test_glm5_and_51_have_an_indexer_on_every_layer():
    raw = {k: v for k, v in GLM53_HF_CONFIG.items() if k not in ("index_topk_freq", "index_skip_topk_offset")}
    raw.update(rope_theta=1e6, max_position_embeddings=202752)
    cfg = GlmConfig.from_hf_config(raw)
    assert cfg.indexer_types == ("full",) * 78 and cfg.rope_theta == 1e6
    plan = cfg.layer_plan  # the 75 MoE layers repeat as groups of one full layer each
    assert (plan.head, plan.stack_start, plan.group_size, plan.num_stacked_groups) == ((0, 1, 2), 3, 1, 75)


def test_rope_theta_from_rope_parameters_and_roundtrip():
    raw = {k: v for k, v in GLM53_HF_CONFIG.items() if k != "rope_theta"}
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 8e6}
    cfg = GlmConfig.from_hf_config(raw)
    assert cfg.rope_theta == 8e6
    assert GlmConfig.from_hf_config(cfg.to_hf_config()) == cfg


@pytest.mark.parametrize("change,field", [
    ({"model_type": "llama"}, "model_type"),
    ({"index_topk_pattern": "FSX"}, "index_topk_pattern"),
    ({"indexer_types": ["shared"] + ["full"] * 77}, "indexer_types"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4}}, "rope_type"),
    ({"scoring_func": "softmax"}, "scoring_func"),
])
def test_bad_configs_name_the_field(change, field):
    with pytest.raises(ConfigError, match=field):
        GlmConfig.from_hf_config({**GLM53_HF_CONFIG, **change})


def test_tiny_preset_keeps_the_structure():
    cfg = preset("tiny")
    assert "dense" in cfg.mlp_layer_types and "sparse" in cfg.mlp_layer_types
    assert sum(1 for g in cfg.index_groups if len(g) > 1) >= 2
    assert cfg.num_mtp_layers == 1 and cfg.index_topk == 64 and cfg.kv_lora_rank % 128 == 0
    assert cfg.layer_plan.num_stacked_groups == 2
