"""The model's HiSparse path (glm53/hot_cache.py, glm53.attention.resolve_hot) on the tiny
checkpoint: a decode step whose early MLA pages are off the device (their arena pages overwritten
with garbage) and are read through the hot buffer from the host pool gives bit-identical logits to
the same step with every page resident, for both transfer mechanisms; a second step hits the hot
buffer instead of copying; an inactive `HotBatch` reads exactly as without HiSparse. The traced
step reads host memory only through slices and memory-kind moves."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import SingleDeviceSharding

from glm53 import api
from glm53.batch import single_sequence_batch
from glm53.hot_cache import HostAccess, HotBatch, HotState, PagedKV
from kernels.host_rows import HostRowStore, page_to_rows
from tests.helpers.host_memory import host_memory_reads

# The tiny checkpoint's 7-layer twin (tests/helpers/shallow_model.py): the same code paths, faster steps.
pytestmark = pytest.mark.shallow_model

PROMPT = 400  # > index_topk (64): sparse selection over 7 MLA pages
OFF = 5  # pages 0..4 live only in the host pool
NH = 10  # host blocks (block i + 1 holds page i)


@pytest.fixture(scope="module")
def setup():
    lm = api.load()
    lay = lm.layout
    rng = np.random.default_rng(0)
    prompt = rng.integers(10, 400, PROMPT).tolist()
    pages = {"mla": list(range(1, 9)), "indexer": [9], "mtp": [10]}
    b = single_sequence_batch(lay, prompt, 0, pages, logits_all=False)
    _, _, arena = api.forward_step(lm, b, lay.empty_arena(30))
    arena = np.asarray(arena)
    g = lay.group("mla")
    rows = np.stack([np.asarray(page_to_rows(jnp.asarray(arena[blk]), g, "mla")) for blk in pages["mla"]])
    host = np.zeros((NH * 64, rows.shape[-1]), np.uint32)
    host[64:64 + rows.shape[0] * 64] = rows.reshape(-1, rows.shape[-1])
    graphdef, state = nnx.split(lm.model)
    fwd = jax.jit(lambda b, kv, host_access: nnx.merge(graphdef, state)(b, kv, lay, None, host_access))
    plain = jax.jit(lambda b, a: nnx.merge(graphdef, state)(b, a, lay))
    return lm, arena, host, pages, fwd, plain, rng


def hot_batch(lay, pages, tok, reset, active=True):
    b = single_sequence_batch(lay, [tok], PROMPT, pages, logits_all=True)
    bt = np.array(pages["mla"], np.int32)
    bt[:OFF] = 0
    b.block_tables["mla"] = bt[None]
    b.hot = HotBatch(host_table_BP=np.arange(1, 9, dtype=np.int32)[None], hot_table_BH=np.array([[20, 21]], np.int32),
                     state_row_B=np.array([0], np.int32), reset_from_B=np.array([reset], np.int32),
                     active=np.bool_(active), num_host_blocks=np.int32(NH))
    return jax.tree.map(jnp.asarray, b)


def host_pool(mechanism, host):
    if mechanism == "callback":
        pool = HostRowStore(*host.shape)
        pool.rows[:] = host
        return pool
    return jax.device_put(host, SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host"))


@pytest.mark.parametrize("mechanism", ["memory_kind", "callback"])
def test_hot_path_step_is_bit_identical_to_the_resident_step(setup, mechanism):
    lm, arena, host, pages, fwd, plain, rng = setup
    cfg, lay = lm.config, lm.layout
    tok = 77
    want, _, _ = plain(jax.tree.map(jnp.asarray, single_sequence_batch(lay, [tok], PROMPT, pages, logits_all=True)),
                       jnp.asarray(arena))
    garbage = arena.copy()
    garbage[1:1 + OFF] = rng.integers(0, 2**32, garbage[1:1 + OFF].shape, dtype=np.uint32)  # never read
    kv = PagedKV(jnp.asarray(garbage), HotState.empty(2, len(cfg.full_layers), 128))
    pool = host_pool(mechanism, host)
    got, _, kv = fwd(hot_batch(lay, pages, tok, 0), kv, HostAccess(pool, mechanism))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    hits, misses, dropped, layer_rows, reads = np.asarray(kv.hot.stats_Z5)[0].tolist()
    assert hits == 0 and misses > 0 and dropped == 0
    if mechanism == "memory_kind":
        # each miss copies the layers of its IndexShare group (1 to 4 on the tiny model); a run of
        # adjacent host rows is read with one host slice per run piece
        assert misses <= layer_rows <= max(cfg.index_group_size(i) for i in cfg.full_layers) * misses
        assert len(cfg.full_layers) <= reads <= misses
    else:
        # the callback path moves whole chunks: the counter is what the host store handed over
        # (its own count of words gathered), padding included, not misses x row
        words_per_layer_row = lay.group("mla").component("mla")[1].row_words
        assert layer_rows * words_per_layer_row == pool.words_gathered > misses * words_per_layer_row
        assert reads == len(cfg.full_layers)  # one chunk per IndexShare group
    # Again, nothing stale: every off-device row the indexer picks is a hot hit, nothing is copied.
    kv = PagedKV(kv.arena, HotState(kv.hot.host_row_SGM, kv.hot.rank_SGM, jnp.zeros((1, 5), jnp.int32)))
    got2, _, kv2 = fwd(hot_batch(lay, pages, tok, 128), kv, HostAccess(pool, mechanism))
    np.testing.assert_array_equal(np.asarray(got2), np.asarray(want))
    assert np.asarray(kv2.hot.stats_Z5)[0].tolist()[:3] == [misses, 0, 0]


def test_inactive_hot_batch_reads_exactly_as_without_hisparse(setup):
    lm, arena, host, pages, fwd, plain, _ = setup
    lay = lm.layout
    b = single_sequence_batch(lay, [5], PROMPT, pages, logits_all=True)
    want, _, _ = plain(jax.tree.map(jnp.asarray, b), jnp.asarray(arena))
    hb = hot_batch(lay, pages, 5, 0, active=False)
    hb.block_tables["mla"] = jnp.asarray(np.array(pages["mla"], np.int32)[None])  # everything resident
    kv = PagedKV(jnp.asarray(arena), HotState.empty(2, len(lm.config.full_layers), 128))
    got, _, kv = fwd(hb, kv, HostAccess(host_pool("memory_kind", host), "memory_kind"))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert np.asarray(kv.hot.stats_Z5)[0].tolist() == [0, 0, 0, 0, 0]


def test_the_traced_step_reads_host_memory_only_through_slices_and_moves(setup):
    lm, arena, host, pages, fwd, plain, _ = setup
    lay = lm.layout
    kv = PagedKV(jnp.asarray(arena), HotState.empty(2, len(lm.config.full_layers), 128))
    pool = host_pool("memory_kind", host)
    jaxpr = jax.make_jaxpr(lambda b, kv, p: fwd(b, kv, HostAccess(p, "memory_kind")))(
        hot_batch(lay, pages, 5, 0), kv, pool)
    reads = host_memory_reads(jaxpr)
    assert [r for r in reads if r[1] != "ok"] == []
    assert ("dynamic_slice", "ok") in reads and ("device_put", "ok") in reads  # the pool is really read
    # The check catches what a GPU would refuse: arithmetic on a host value.
    bad = jax.make_jaxpr(lambda p: jax.lax.dynamic_slice(p, (0, 0), (1, 4)) + 1)(pool)
    assert ("add", "reads a host-memory operand") in host_memory_reads(bad)
