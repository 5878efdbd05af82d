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


def _small_budget(monkeypatch, attention, par, layout, selected: bool):
    """Force one sparse-MLA path under DCP over PCP and a memory budget of one gathered page, so the
    copy runs a page per chunk and the exchange a few queries per block. Returns a function giving,
    per exchange traced so far, whether it ran in more than one block."""
    g = layout.group("mla")
    gather, _ = attention._dcp_axes(par)
    blocks = []
    query_block = attention._query_block
    monkeypatch.setattr(attention, "_query_block", lambda *a: blocks.append(a) or query_block(*a))
    monkeypatch.setattr(attention, "reads_selected_rows", lambda *a: selected)
    monkeypatch.setattr(attention, "copy_budget_rows",
                        lambda *a: g.tokens_per_page * attention._split_size(par, gather))
    return lambda: [query_block(*a) < a[0] for a in blocks]


@pytest.mark.parametrize("name", ["pcp4_dcp4", "pcp2_tp4_dcp8_a2a"])
def test_dcp_over_pcp_exchanging_selected_rows_matches_single_device(name, model_setup, reference, monkeypatch):
    """DCP over PCP (and over TP × PCP) with sparse MLA exchanging the selected rows each rank owns
    (forced: `glm53.attention.reads_selected_rows` picks this or the copy of the step's pages per
    step on the device, and a prefill chunk over short contexts takes the copy), a few queries per
    block (a budget of one gathered page), gives the single-device logits."""
    from glm53 import attention
    import tests.sharding.conftest as layouts

    par = ParallelLayout.create(LAYOUTS[name])
    in_blocks = _small_budget(monkeypatch, attention, par, model_setup[1], selected=True)
    monkeypatch.setattr(layouts, "_STEPS", {})  # trace the step again (not the cached program of the layout)
    ref_logits, _ = reference
    logits, _, _ = run_layout(model_setup, par)
    worst = float(np.abs(logits - ref_logits[:par.dp]).max())
    split = in_blocks()
    print(f"\n{name} (selected rows, {len(split)} exchanges traced): max |Δlogit| vs one device = {worst:.2e}")
    assert split and all(split), "the exchange ran in one block"
    assert worst <= TOL


def test_dcp_over_pcp_replicas_may_read_their_caches_differently(model_setup, reference, monkeypatch):
    """DP2 × PCP2 × DCP2: the choice between exchanging selected rows and copying the step's pages
    is made per replica on the device (each replica's collectives are its own), so two replicas of
    one step may take different ones. Forced here: replica 0 exchanges, replica 1 copies; each
    gives its prompt's single-device logits."""
    import jax

    from glm53 import attention
    import tests.sharding.conftest as layouts

    par = ParallelLayout.create(ParallelConfig(data_parallel_size=2, prefill_context_parallel_size=2,
                                               decode_context_parallel_size=2), devices=jax.devices()[:4])
    assert attention._dcp_axes(par)[0] == ("pcp",)
    monkeypatch.setattr(attention, "reads_selected_rows", lambda *a: jax.lax.axis_index("dp") == 0)
    monkeypatch.setattr(layouts, "_STEPS", {})
    ref_logits, _ = reference
    logits, _, _ = run_layout(model_setup, par)
    worst = [float(np.abs(logits[r] - ref_logits[r]).max()) for r in range(2)]
    print(f"\ndp2_pcp2_dcp2 (replica 0 selected rows, replica 1 step pages): max |Δlogit| {worst}")
    assert max(worst) <= TOL


def test_dcp_over_pcp_copying_the_step_pages_in_chunks_matches_single_device(model_setup, monkeypatch):
    """PCP2 × DCP2, two 192-token requests prefilled together in chunks of 96 tokens each: sparse MLA
    reads a copy of the step's pages (two engine pages per request), one page per chunk, so every
    query's selections are spread over chunks whose partials are merged (forced, with a budget of
    one page). Logits equal the single-device run of the same batch within TOL."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from glm53 import attention
    from glm53.parallel_batch import empty_parallel_arena, replica_batch, shard_batch, stack_replicas
    from sharding.rules import shard_params

    _, layout, graphdef, state, prompts = model_setup
    length, chunk, rows = 2 * S, S, 4  # block tables of 4 rows (3 empty or padding) x 2 pages
    par = ParallelLayout.create(ParallelConfig(prefill_context_parallel_size=2, decode_context_parallel_size=2))
    seqs = [np.concatenate([prompts[i], prompts[i + 2]]) for i in range(2)]

    def run(p):
        dcp = p.dcp if p is not None else 1
        blocks, nxt = [], 1
        for _ in seqs:
            b = {}
            for g in layout.groups:
                n = -(-length // (g.tokens_per_page * dcp))
                b[g.name], nxt = list(range(nxt, nxt + n)), nxt + n
            blocks.append(b)
        step = jax.jit(lambda st, bt, a: nnx.merge(graphdef, st)(bt, a, layout, p), donate_argnums=2)
        arena = layout.empty_arena(nxt) if p is None else empty_parallel_arena(layout, nxt, p)
        st = state if p is None else shard_params(state, p)
        out = []
        for c in range(length // chunk):
            sl = slice(c * chunk, (c + 1) * chunk)
            rep = replica_batch(layout, [(s_[sl], c * chunk, b) for s_, b in zip(seqs, blocks)], 2 * chunk, rows, dcp,
                                logits_all=True)
            batch = jax.tree.map(jnp.asarray, rep) if p is None else shard_batch(stack_replicas([rep], p.pcp), p)
            logits, _, arena = step(st, batch, arena)
            out.append(np.asarray(logits).reshape(2 * chunk, -1))
        return np.concatenate(out), blocks

    ref, blocks = run(None)
    g = layout.group("mla")
    assert len(blocks[0]["mla"]) * g.tokens_per_page >= length  # one device: pages of 64
    _small_budget(monkeypatch, attention, par, layout, selected=False)
    logits, blocks = run(par)
    assert all(len(b["mla"]) == 2 for b in blocks), "each request should span two engine pages"
    worst = float(np.abs(logits - ref).max())
    print(f"\npcp2_dcp2 (step pages, 1-page chunks): max |Δlogit| vs one device = {worst:.2e}")
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
