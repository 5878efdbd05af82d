"""Model configuration for GLM-5.x (`glm_moe_dsa`) built from an HF `config.json`.

Field names follow the HF checkpoint (`GlmMoeDsaConfig` in transformers >= 5.23). Derived
quantities (the IndexShare layer plan, the stacked-group layout, per-token cache widths) are
computed here once and never duplicated elsewhere.

Sources: the public GLM-5 / 5.1 / 5.3 checkpoints' `config.json`, HF transformers
`configuration_glm_moe_dsa.py` (IndexShare precedence: `indexer_types`, then
`index_topk_pattern`, then `index_topk_freq` / `index_skip_topk_offset`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

# Fields copied verbatim from config.json (name -> default). Defaults are GLM-5.3's.
_HF_FIELDS: dict[str, Any] = {
    "vocab_size": 154880,
    "hidden_size": 6144,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 78,
    "num_attention_heads": 64,
    "q_lora_rank": 2048,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 1048576,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 2048,
    "num_nextn_predict_layers": 1,
    "index_share_for_mtp_iteration": True,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
    "torch_dtype": "bfloat16",
}


class ConfigError(ValueError):
    """A config.json that this implementation cannot serve (names the field)."""


# Fields that fix a tensor's shape or the maths: a config.json without one takes GLM-5.3's value
# (as HF transformers' config class does), which is logged as a warning naming it.
_ARCHITECTURE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                        "num_hidden_layers", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
                        "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
                        "num_experts_per_tok", "n_shared_experts", "routed_scaling_factor", "rms_norm_eps",
                        "index_n_heads", "index_head_dim", "index_topk")
# Sizes that must be at least 1 (the others are counts that may be 0, e.g. n_shared_experts).
_POSITIVE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                    "v_head_dim", "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group",
                    "max_position_embeddings", "index_n_heads", "index_head_dim", "index_topk")


def _check_field_types(kw: dict[str, Any]) -> None:
    """Each known field has its default's type (an int where an int is expected: not a string, a
    float or a bool), and sizes are >= 1. Raises ConfigError naming the field."""
    for k, default in _HF_FIELDS.items():
        v = kw[k]
        if isinstance(default, bool):
            ok = isinstance(v, bool)
        elif isinstance(default, int):
            ok = isinstance(v, int) and not isinstance(v, bool)
        elif isinstance(default, float):
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        else:
            ok = isinstance(v, str)
        if not ok:
            raise ConfigError(f"{k}: expected {type(default).__name__}, got {v!r}")
        if k in _POSITIVE_FIELDS and v < 1:
            raise ConfigError(f"{k}: must be >= 1, got {v}")


def _indexer_types_from(raw: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    """IndexShare plan with HF's precedence: explicit list, then pattern string, then freq/offset."""
    if raw.get("indexer_types") is not None:
        types = tuple(raw["indexer_types"])
    elif raw.get("index_topk_pattern") is not None:
        pattern = raw["index_topk_pattern"]
        if isinstance(pattern, str):
            mapping = {"F": "full", "S": "shared"}
            try:
                types = tuple(mapping[c] for c in pattern)
            except KeyError as e:
                raise ConfigError(f"index_topk_pattern: unknown letter {e.args[0]!r} (expected 'F' or 'S')")
        else:
            types = tuple(pattern)
    else:
        # GLM-5 / 5.1 have no IndexShare keys at all: every layer owns an indexer.
        freq = max(int(raw.get("index_topk_freq", 1)), 1)
        offset = int(raw.get("index_skip_topk_offset", 0 if freq == 1 else 2))
        types = tuple(
            "full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)
        )
    if len(types) != num_layers:
        raise ConfigError(f"indexer_types: {len(types)} entries for num_hidden_layers={num_layers}")
    bad = [t for t in types if t not in ("full", "shared")]
    if bad:
        raise ConfigError(f"indexer_types: unknown entry {bad[0]!r} (expected 'full' or 'shared')")
    if types and types[0] != "full":
        raise ConfigError("indexer_types: layer 0 must be 'full' (a shared layer needs a preceding full layer)")
    return types


@dataclass(frozen=True)
class GlmConfig:
    """Frozen GLM-5.x config. Build with `GlmConfig.from_hf_config(dict)` or `from_pretrained(dir)`.

    Shapes of note: MLA latent row `kv_lora_rank + qk_rope_head_dim` (576 at full size); indexer
    key `index_head_dim` (128). `indexer_types[i]` is "full" (layer owns an indexer) or "shared"
    (reuses the top-k of the nearest preceding full layer).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    first_k_dense_replace: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    scoring_func: str
    topk_method: str
    rms_norm_eps: float
    max_position_embeddings: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    num_nextn_predict_layers: int
    index_share_for_mtp_iteration: bool
    tie_word_embeddings: bool
    hidden_act: str
    attention_bias: bool
    torch_dtype: str
    rope_theta: float
    indexer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    eos_token_id: tuple[int, ...]
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    quantization_config: dict | None = field(default=None, compare=False)
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_hf_config(cls, raw: dict[str, Any]) -> "GlmConfig":
        """Build from a parsed HF `config.json` of model_type `glm_moe_dsa`.

        Raises ConfigError naming the field when the config is not servable.
        """
        if not isinstance(raw, dict):
            raise ConfigError(f"config.json must be a JSON object, got {type(raw).__name__}")
        mt = raw.get("model_type", "glm_moe_dsa")
        if mt != "glm_moe_dsa":
            raise ConfigError(f"model_type: expected 'glm_moe_dsa', got {mt!r}")
        kw = {k: raw.get(k, v) for k, v in _HF_FIELDS.items()}
        if "num_local_experts" in raw and "n_routed_experts" not in raw:
            kw["n_routed_experts"] = raw["num_local_experts"]
        _check_field_types(kw)
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"rope_parameters: expected a JSON object, got {rope!r}")
        theta = raw.get("rope_theta", rope.get("rope_theta", 1_000_000.0))
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
            raise ConfigError(f"rope_theta: expected a positive number, got {theta!r}")
        defaulted = [k for k in _ARCHITECTURE_FIELDS if k not in raw
                     and not (k == "n_routed_experts" and "num_local_experts" in raw)]
        if "rope_theta" not in raw and "rope_theta" not in rope:
            defaulted.append("rope_theta")
        if defaulted:
            logger.warning("config.json does not set %s: using GLM-5.3's %s (as HF transformers does); a "
                           "checkpoint of another size will not match it", ", ".join(defaulted),
                           ", ".join(f"{k}={_HF_FIELDS.get(k, 1_000_000.0)}" for k in defaulted))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"rope_parameters.rope_type: only 'default' is supported, got {rope_type!r}")
        n = int(kw["num_hidden_layers"])
        indexer_types = _indexer_types_from(raw, n)
        mlp_types = raw.get("mlp_layer_types")
        if mlp_types is None:
            k = min(int(kw["first_k_dense_replace"]), n)
            mlp_types = ["dense"] * k + ["sparse"] * (n - k)
        mlp_types = tuple(mlp_types)
        if len(mlp_types) != n or any(t not in ("dense", "sparse") for t in mlp_types):
            raise ConfigError("mlp_layer_types: expected num_hidden_layers entries of 'dense'/'sparse'")
        if kw["scoring_func"] != "sigmoid":
            raise ConfigError(f"scoring_func: only 'sigmoid' is supported, got {kw['scoring_func']!r}")
        if kw["hidden_act"] != "silu":
            raise ConfigError(f"hidden_act: only 'silu' is supported, got {kw['hidden_act']!r}")
        if kw["attention_bias"]:
            raise ConfigError("attention_bias: true is not supported by GLM-5.x checkpoints")
        if kw["n_routed_experts"] % kw["n_group"]:
            raise ConfigError("n_group: must divide n_routed_experts")
        if kw["index_head_dim"] < kw["qk_rope_head_dim"]:
            raise ConfigError("index_head_dim: must be >= qk_rope_head_dim (rope is applied to its first dims)")
        eos = raw.get("eos_token_id")
        eos = () if eos is None else (tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),))
        q = raw.get("quantization_config")
        return cls(
            **kw,
            rope_theta=float(theta),
            indexer_types=indexer_types,
            mlp_layer_types=mlp_types,
            eos_token_id=eos,
            bos_token_id=raw.get("bos_token_id"),
            pad_token_id=raw.get("pad_token_id"),
            quantization_config=q,
            raw=dict(raw),
        )

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "GlmConfig":
        """Read `<path>/config.json` (or a path to the json file itself)."""
        p = os.fspath(path)
        if os.path.isdir(p):
            p = os.path.join(p, "config.json")
        if not os.path.exists(p):
            raise FileNotFoundError(f"no config.json at {p}")
        try:
            with open(p) as f:
                raw = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{p} is not valid JSON: {e}") from None
        try:
            return cls.from_hf_config(raw)
        except ConfigError as e:
            raise ConfigError(f"{p}: {e}") from None

    def to_hf_config(self) -> dict[str, Any]:
        """The HF `config.json` dict for this config (round-trips through `from_hf_config`)."""
        out = {k: getattr(self, k) for k in _HF_FIELDS}
        out.update(
            model_type="glm_moe_dsa",
            architectures=["GlmMoeDsaForCausalLM"],
            rope_theta=self.rope_theta,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            indexer_types=list(self.indexer_types),
            mlp_layer_types=list(self.mlp_layer_types),
            eos_token_id=list(self.eos_token_id),
            num_key_value_heads=self.num_attention_heads,
            head_dim=self.qk_rope_head_dim,
        )
        if self.bos_token_id is not None:
            out["bos_token_id"] = self.bos_token_id
        if self.pad_token_id is not None:
            out["pad_token_id"] = self.pad_token_id
        if self.quantization_config is not None:
            out["quantization_config"] = self.quantization_config
        return out

    def replace(self, **changes: Any) -> "GlmConfig":
        """A copy with fields changed (re-derives nothing: pass consistent values)."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ derived sizes
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_row_width(self) -> int:
        """Width A+R of one cached MLA latent row (576 at full size)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5 (exactly 1/16 for GLM-5.x; no YaRN mscale)."""
        return self.qk_head_dim ** -0.5

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.indexer_types) if t == "full")

    @property
    def num_mtp_layers(self) -> int:
        return int(self.num_nextn_predict_layers)

    @property
    def index_groups(self) -> tuple[tuple[int, ...], ...]:
        """IndexShare groups: each full layer followed by the shared layers that reuse its top-k."""
        groups: list[list[int]] = []
        for i, t in enumerate(self.indexer_types):
            if t == "full":
                groups.append([i])
            else:
                groups[-1].append(i)
        return tuple(tuple(g) for g in groups)

    def index_group_size(self, layer: int) -> int:
        """Layers in the IndexShare group a full `layer` starts (itself and the shared layers after
        it); 1 for a shared layer (it starts no group)."""
        return next((len(g) for g in self.index_groups if g[0] == layer), 1)

    @property
    def layer_plan(self) -> "LayerPlan":
        return LayerPlan.from_config(self)


@dataclass(frozen=True)
class LayerPlan:
    """How layers are laid out for the forward pass.

    `head` lists irregular leading layers run one by one. `stack_start`, `group_size` and
    `num_stacked_groups` describe the tail of identical IndexShare groups (one full MoE layer then
    `group_size - 1` shared MoE layers) whose weights are stacked and scanned over; for GLM-5.3
    head = 0..5 and 18 groups of 4 starting at layer 6.
    """

    head: tuple[int, ...]
    stack_start: int
    group_size: int
    num_stacked_groups: int

    @classmethod
    def from_config(cls, cfg: GlmConfig) -> "LayerPlan":
        groups = cfg.index_groups
        n = cfg.num_hidden_layers

        def regular(g: tuple[int, ...], size: int) -> bool:
            return len(g) == size and all(cfg.mlp_layer_types[i] == "sparse" for i in g)

        # Longest suffix of identical, all-MoE groups of the same size.
        last = groups[-1]
        size = len(last)
        k = len(groups)
        while k > 0 and regular(groups[k - 1], size):
            k -= 1
        num = len(groups) - k
        if num < 1:  # nothing to stack
            return cls(head=tuple(range(n)), stack_start=n, group_size=size, num_stacked_groups=0)
        start = groups[k][0]
        return cls(head=tuple(range(start)), stack_start=start, group_size=size, num_stacked_groups=num)

    def stacked_layer(self, group: int, j: int) -> int:
        return self.stack_start + group * self.group_size + j


# ---------------------------------------------------------------------- presets
GLM53_HF_CONFIG: dict[str, Any] = {
    "model_type": "glm_moe_dsa",
    "architectures": ["GlmMoeDsaForCausalLM"],
    **_HF_FIELDS,
    "rope_theta": 8_000_000.0,
    "index_topk_freq": 4,
    "index_skip_topk_offset": 3,
    "eos_token_id": [154820, 154827, 154829],
}

# Tiny structural twin of GLM-5.3: 3 dense + 11 MoE layers; IndexShare freq 4 / offset 3 gives
# full = {0, 1, 2, 6, 10}, groups {0} {1} {2..5} {6..9} {10..13}, the last two stacked and
# scanned like GLM-5.3's 18 groups; one MTP layer; index_topk 64 so
# sparsity is exercised by short prompts; kv_lora_rank 128 (a multiple of the fp8 tile).
# vocab_size / eos_token_id are placeholders: the tiny checkpoint generator sets them from its
# tokenizer.
TINY_HF_CONFIG: dict[str, Any] = {
    **GLM53_HF_CONFIG,
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 14,
    "num_attention_heads": 4,
    "q_lora_rank": 96,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 3,
    "index_n_heads": 4,
    "index_head_dim": 32,
    "index_topk": 64,
    "max_position_embeddings": 16384,
    "rms_norm_eps": 1e-6,
    "eos_token_id": [1, 2, 3],
}

# The trained tiny model (`tiny-recall`, scripts/train_tiny.py): GLM-5.3's structure at a size
# that trains on 2 CPU cores — 1 dense + 5 MoE layers in three IndexShare groups {0, 1} {2, 3}
# {4, 5} (the last two stacked and scanned), one MTP layer, kv_lora_rank 128, index_topk 64,
# rope theta 10,000 (contexts of ≤ 1K tokens) on 32 of the 64 qk dims (position-precise heads
# such as "the previous token" need the finer angles; 16 rope dims learnt retrieval far slower).
# vocab/eos come from the tiny tokenizer as above.
TINY_RECALL_HF_CONFIG: dict[str, Any] = {
    **TINY_HF_CONFIG,
    "num_hidden_layers": 6,
    "qk_rope_head_dim": 32,
    "index_head_dim": 64,
    "first_k_dense_replace": 1,
    "indexer_types": ["full", "shared", "full", "shared", "full", "shared"],
    "rope_theta": 10_000.0,
    "max_position_embeddings": 2048,
}

PRESETS: dict[str, dict[str, Any]] = {"glm-5.3": GLM53_HF_CONFIG, "tiny": TINY_HF_CONFIG,
                                      "tiny-recall": TINY_RECALL_HF_CONFIG}


def preset(name: str) -> GlmConfig:
    """A named config: `glm-5.3` (full size, for shapes and memory planning) or `tiny`."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return GlmConfig.from_hf_config(PRESETS[name])
