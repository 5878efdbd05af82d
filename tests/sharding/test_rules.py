"""Mesh construction, role tables and partition rules (no compilation)."""

from __future__ import annotations

import jax
import pytest
from flax import nnx

from glm53.config import preset
from glm53.model import GlmForCausalLM
from sharding.mesh import ParallelConfig, ParallelLayout
from sharding.rules import cache_sharding, param_roles, param_shardings


def _abstract_state(cfg):
    return nnx.state(nnx.eval_shape(lambda: GlmForCausalLM(cfg)))


def _flat(tree):
    from sharding.rules import _path_str

    return {_path_str(p): v for p, v in jax.tree_util.tree_leaves_with_path(tree)}


def test_mesh_axes_and_validation():
    par = ParallelLayout.create(ParallelConfig(tensor_parallel_size=2, data_parallel_size=2,
                                               prefill_context_parallel_size=2))
    assert dict(par.mesh.shape) == {"dp": 2, "pcp": 2, "tp": 2}
    # TP is the fastest-varying axis: a TP group is two neighbouring devices
    assert [d.id for d in par.mesh.devices[0, 0]] == [0, 1]
    with pytest.raises(ValueError, match="--decode-context-parallel-size"):
        ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=4)
    with pytest.raises(ValueError, match="--dcp-comm-backend"):
        ParallelConfig(dcp_comm_backend="ring")
    with pytest.raises(ValueError, match="needs 16 devices"):
        ParallelLayout.create(ParallelConfig(tensor_parallel_size=16))


def test_the_start_up_line_names_every_size_and_the_dcp_axes():
    """`ParallelConfig.describe` (logged at start-up): the mesh sizes, and DCP over the group the
    KV is really sharded over (TP wins a tie with PCP)."""
    assert ParallelConfig(prefill_context_parallel_size=2, decode_context_parallel_size=2).describe() == (
        "DP 1 x PCP 2 x TP 1 = 2 devices, DCP 2 over PCP (ag_rs, interleave 1), EP off")
    assert ParallelConfig(tensor_parallel_size=4, prefill_context_parallel_size=2, decode_context_parallel_size=8,
                          enable_expert_parallel=True, dcp_comm_backend="a2a").describe() == (
        "DP 1 x PCP 2 x TP 4 = 8 devices, DCP 8 over PCP x TP (a2a, interleave 1), EP on")
    assert "DCP 2 over TP" in ParallelConfig(tensor_parallel_size=2, prefill_context_parallel_size=2,
                                             decode_context_parallel_size=2).describe()
    assert ParallelConfig(data_parallel_size=2).describe() == "DP 2 x PCP 1 x TP 1 = 2 devices, EP off"


def test_every_glm53_parameter_has_a_rule_and_full_size_splits():
    """The real GLM-5.3 shapes (abstract, nothing allocated) under TP8 and DP8+EP8."""
    cfg = preset("glm-5.3")
    state = _abstract_state(cfg)
    for c in (ParallelConfig(tensor_parallel_size=8),
              ParallelConfig(data_parallel_size=8, enable_expert_parallel=True)):
        par = ParallelLayout.create(c)
        sh = _flat(param_shardings(state, par))
        shapes = {k: v.shape for k, v in _flat(state).items()}
        assert set(sh) == set(shapes)
        for path, s in sh.items():
            local = s.shard_shape(shapes[path])
            if c.tensor_parallel_size == 8 and path.endswith("self_attn.w_uk"):
                assert local[-3] == cfg.num_attention_heads // 8
            if c.enable_expert_parallel and path.endswith("mlp.experts.gate_proj"):
                assert local[-3] == cfg.n_routed_experts // 8
            if path.endswith("kv_a_proj_with_mqa.weight") or ".indexer." in path:
                assert local == shapes[path], path  # latent projection and indexer replicated


def test_stacked_leading_axis_never_sharded():
    par = ParallelLayout.create(ParallelConfig(tensor_parallel_size=4))
    roles = param_roles("stack.layers.0.self_attn.q_b_proj.weight", 3)
    assert roles[0] is None and par.spec(*roles) == jax.sharding.PartitionSpec(None, None, "tp")
    with pytest.raises(KeyError, match="no partition rule"):
        param_roles("stack.layers.0.self_attn.new_thing", 2)


def test_cache_sharding_replicates_over_tp_and_shards_dcp():
    tp = ParallelLayout.create(ParallelConfig(tensor_parallel_size=4, data_parallel_size=2))
    assert cache_sharding(tp).spec == jax.sharding.PartitionSpec("dp", None)
    dcp = ParallelLayout.create(ParallelConfig(tensor_parallel_size=4, decode_context_parallel_size=4))
    assert cache_sharding(dcp).spec == jax.sharding.PartitionSpec(("dp", "tp"), None)
    pcp = ParallelLayout.create(ParallelConfig(prefill_context_parallel_size=8, decode_context_parallel_size=8))
    assert cache_sharding(pcp).spec == jax.sharding.PartitionSpec(("dp", "pcp"), None)


def test_too_few_devices_is_a_clear_error_with_the_cpu_hint():
    from sharding.mesh import make_mesh

    with pytest.raises(ValueError, match=r"needs 4 devices .* only 2 available; on CPU, "
                                         r"XLA_FLAGS=--xla_force_host_platform_device_count=4"):
        make_mesh(ParallelConfig(tensor_parallel_size=2, data_parallel_size=2), devices=jax.devices()[:2])
