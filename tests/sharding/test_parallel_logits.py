"""Every parallel layout gives the single-device logits (8 simulated CPU devices).

Independent oracle: the same model on one device (no mesh, no shard_map). Tolerance `TOL`
(conftest: fp32, summation order only). DP layouts serve a different prompt on each replica and
every replica is checked against that prompt's single-device run. DCP layouts also check that
the persistent cache really is sharded: DCP rank r's shard holds, at local position j, the row of
the j-th position that r owns under `(p // I) % N == r`, and nothing else.
"""

from __future__ import annotations

import numpy as np
import pytest

from kernels.paged import read_cache
from sharding.mesh import ParallelConfig, ParallelLayout
from tests.sharding.conftest import S, TOL, run_layout

# The tiny checkpoint's 7-layer twin (tests/helpers/shallow_model.py): the same code paths, faster steps.
pytestmark = pytest.mark.shallow_model

# Each size of each axis at least once (TP 2, TP 4, PCP 2 and PCP 4 inside the combinations; TP8
# and DP8 + EP8 also alone; the a2a backend at DCP 8, alone and under PCP2 × TP4). Each layout is a
# compile and a run of the model under it: a smaller axis alone adds little that its combinations
# do not check.
LAYOUTS = {
    "tp8": ParallelConfig(tensor_parallel_size=8),
    "dp8_ep8": ParallelConfig(data_parallel_size=8, enable_expert_parallel=True),
    "tp2_dp4_ep8": ParallelConfig(tensor_parallel_size=2, data_parallel_size=4, enable_expert_parallel=True),
    "dcp2_ag_rs": ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2),
    "dcp4_ag_rs_i2": ParallelConfig(tensor_parallel_size=4, decode_context_parallel_size=4,
                                    dcp_kv_cache_interleave_size=2),
    "dcp8_ag_rs": ParallelConfig(tensor_parallel_size=8, decode_context_parallel_size=8),
    "dcp8_a2a": ParallelConfig(tensor_parallel_size=8, decode_context_parallel_size=8, dcp_comm_backend="a2a"),
    "pcp4_dcp4": ParallelConfig(prefill_context_parallel_size=4, decode_context_parallel_size=4),
    "dp2_pcp2_tp2_dcp2": ParallelConfig(data_parallel_size=2, prefill_context_parallel_size=2, tensor_parallel_size=2,
                                        decode_context_parallel_size=2),  # DCP over TP (TP wins a tie with PCP)
    "pcp2_tp4_dcp8_a2a": ParallelConfig(prefill_context_parallel_size=2, tensor_parallel_size=4,
                                        decode_context_parallel_size=8, dcp_comm_backend="a2a"),
    "pcp2_dcp2_tp4_ep8": ParallelConfig(prefill_context_parallel_size=2, decode_context_parallel_size=2,
                                        tensor_parallel_size=4, enable_expert_parallel=True),
}


def check_dcp_shards(setup, par, arena_np, blocks, ref_arena, ref_blocks):
    """Rank r's local position j holds the j-th position r owns (layer-0 latent rows, compared with
    the single-device cache), and its other rows in the request's pages are empty."""
    import jax.numpy as jnp

    _, layout, _, _, _ = setup
    g = layout.group("mla")
    n, inter, tpp = par.dcp, par.config.dcp_kv_cache_interleave_size, g.tokens_per_page
    shards = arena_np.reshape(par.dp, n, -1, arena_np.shape[-1])[0]  # replica 0
    ref_pos = np.arange(S)
    ref_slots = np.asarray(ref_blocks["mla"])[ref_pos // tpp] * tpp + ref_pos % tpp
    ref_rows = np.asarray(read_cache(jnp.asarray(ref_arena), jnp.asarray(ref_slots), g, "mla", 0))
    for r in range(n):
        owned = [p for p in range(S) if (p // inter) % n == r]
        local = np.arange(len(blocks["mla"]) * tpp)
        slots = np.asarray(blocks["mla"])[local // tpp] * tpp + local % tpp
        rows = np.asarray(read_cache(jnp.asarray(shards[r]), jnp.asarray(slots), g, "mla", 0))
        np.testing.assert_allclose(rows[:len(owned)], ref_rows[owned], rtol=0, atol=1e-5)
        assert not rows[len(owned):].any(), f"rank {r} holds rows it does not own"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_device(name, model_setup, reference):
    cfg = LAYOUTS[name]
    par = ParallelLayout.create(cfg)
    ref_logits, (ref_arena, ref_blocks) = reference
    logits, arena, blocks = run_layout(model_setup, par)
    worst = float(np.abs(logits - ref_logits[:par.dp]).max())
    print(f"\n{name}: max |Δlogit| vs one device = {worst:.2e} over {par.dp} replica(s)")
    assert worst <= TOL
    if par.dcp > 1:
        check_dcp_shards(model_setup, par, arena, blocks, ref_arena, ref_blocks)


@pytest.mark.parametrize("name", ["pcp4_dcp4", "pcp2_tp4_dcp8_a2a"])
def test_dcp_over_pcp_exchanging_selected_rows_matches_single_device(name, model_setup, reference, monkeypatch):
    """DCP over PCP (and over TP × PCP) with sparse MLA exchanging the selected rows instead of
    reading a temporary copy of every page (`glm53.attention.reads_selected_rows`, which picks the
    smaller per step program: here, a prefill over a small table, the copy; forced the other way
    here, as decode steps over the engine's tables take it)."""
    from glm53 import attention
    import tests.sharding.conftest as layouts

    monkeypatch.setattr(attention, "reads_selected_rows", lambda *a: True)
    monkeypatch.setattr(layouts, "_STEPS", {})  # trace the step again (not the cached program of the layout)
    par = ParallelLayout.create(LAYOUTS[name])
    ref_logits, _ = reference
    logits, _, _ = run_layout(model_setup, par)
    worst = float(np.abs(logits - ref_logits[:par.dp]).max())
    print(f"\n{name} (selected rows): max |Δlogit| vs one device = {worst:.2e}")
    assert worst <= TOL


def test_mtp_layer_under_pcp_tp_dcp(model_setup):
    """The MTP layer (its own KV group, indexer and MoE) under PCP2 × TP4 × DCP8 gives the
    single-device MTP logits for one 48-token prefill chunk (backbone hidden states from the same
    layout, as the engine would use them)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from glm53.parallel_batch import empty_parallel_arena, replica_batch, shard_batch, stack_replicas
    from sharding.rules import shard_params
    from tests.sharding.conftest import CHUNK, allocate

    _, layout, graphdef, state, prompts = model_setup

    def run(par):
        dcp = par.dcp if par is not None else 1
        blocks, nb = allocate(layout, dcp)
        b0 = replica_batch(layout, [(prompts[0][:CHUNK], 0, blocks)], CHUNK, 2, dcp, logits_all=True)
        b1 = replica_batch(layout, [(prompts[0][1:CHUNK + 1], 0, blocks)], CHUNK, 2, dcp, logits_all=True)

        def f(st, b0, b1, arena):
            m = nnx.merge(graphdef, st)
            _, h, arena = m(b0, arena, layout, par)
            return m.mtp_logits(b1, h, arena, layout, par)[0]

        if par is None:
            return np.asarray(jax.jit(f)(state, *(jax.tree.map(jnp.asarray, b) for b in (b0, b1)),
                                         layout.empty_arena(nb)))
        put = lambda b: shard_batch(stack_replicas([b], par.pcp), par)  # noqa: E731
        return np.asarray(jax.jit(f)(shard_params(state, par), put(b0), put(b1), empty_parallel_arena(layout, nb, par)))

    ref = run(None)
    got = run(ParallelLayout.create(LAYOUTS["pcp2_tp4_dcp8_a2a"]))
    worst = float(np.abs(got - ref).max())
    print(f"\nMTP: max |Δlogit| vs one device = {worst:.2e}")
    assert worst <= TOL
