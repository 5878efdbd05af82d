"""Shared fixtures for the parallel-layout tests: a small random model whose head and expert
counts divide 8, its single-device reference run, and a runner for any `ParallelLayout`.

The model is the tiny preset with 8 attention heads (the shipped tiny checkpoint has 4, which TP8
cannot split) and 10 layers (dense layer 0, MoE layer 1 with its own indexer, then two stacked
IndexShare groups of one full + three shared MoE layers), so compiles stay short. Weights come
from the tiny-checkpoint generator through the loader's parameter table.

Each run prefills S = 96 tokens in two chunked-prefill steps of 48 (the second reads the first's
cache; 96 > index_topk = 64 so the indexer really selects) and returns the logits of every token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from glm53.config import TINY_HF_CONFIG, GlmConfig
from glm53.kv_layout import build_kv_layout
from glm53.loader import load_weights
from glm53.model import GlmForCausalLM
from glm53.parallel_batch import empty_parallel_arena, replica_batch, shard_batch, stack_replicas
from glm53.safetensors_reader import InMemoryCheckpoint
from glm53.tiny_checkpoint import tiny_weights
from sharding.rules import shard_params

S = 96
CHUNK = 48
NUM_PROMPTS = 8
# fp32 throughout; a layout differs from one device only in summation order (sharded matmuls,
# psum / reduce-scatter, split softmax merged by log-sum-exp), observed ≈1e-5 on logits of |x| ≤ 5.
TOL = 1e-4


def sharding_test_config() -> GlmConfig:
    return GlmConfig.from_hf_config({**TINY_HF_CONFIG, "num_attention_heads": 8, "num_hidden_layers": 10,
                                     "first_k_dense_replace": 1})


@pytest.fixture(scope="session")
def model_setup():
    assert jax.device_count() >= 8, "tests/sharding need 8 devices (tests/conftest.py sets XLA_FLAGS)"
    cfg = sharding_test_config()
    assert cfg.layer_plan.num_stacked_groups == 2 and "shared" in cfg.indexer_types
    weights = tiny_weights(cfg, seed=1)
    model = load_weights(GlmForCausalLM(cfg), InMemoryCheckpoint(weights), progress=False)
    layout = build_kv_layout(cfg, "float32")
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(4, cfg.vocab_size, S) for _ in range(NUM_PROMPTS)]
    return cfg, layout, graphdef, state, prompts


def allocate(layout, dcp: int, first: int = 1):
    """Page ids per group for one S-token request (engine pages of tokens_per_page × dcp)."""
    blocks, nxt = {}, first
    for g in layout.groups:
        n = -(-S // (g.tokens_per_page * dcp))
        blocks[g.name] = list(range(nxt, nxt + n))
        nxt += n
    return blocks, nxt


_STEPS: dict = {}


def run_layout(setup, par):
    """Two chunked-prefill steps under `par` (None: one device). Replica r serves prompt r.
    → (logits `[dp, S, vocab]` of every token, final arena as numpy, block ids per group)."""
    cfg, layout, graphdef, state, prompts = setup
    dp = par.dp if par is not None else 1
    dcp = par.dcp if par is not None else 1
    blocks, nb = allocate(layout, dcp)
    key = (id(graphdef), par)
    if key not in _STEPS:
        _STEPS[key] = jax.jit(lambda st, b, a: nnx.merge(graphdef, st)(b, a, layout, par), donate_argnums=2)
    step = _STEPS[key]
    if par is None:
        arena = layout.empty_arena(nb)
        st = state
    else:
        arena = empty_parallel_arena(layout, nb, par)
        st = shard_params(state, par)
    out = []
    for c in range(S // CHUNK):
        sl = slice(c * CHUNK, (c + 1) * CHUNK)
        reps = [replica_batch(layout, [(prompts[r][sl], c * CHUNK, blocks)], CHUNK, 2, dcp, logits_all=True)
                for r in range(dp)]
        if par is None:
            batch = jax.tree.map(jnp.asarray, reps[0])
        else:
            batch = shard_batch(stack_replicas(reps, par.pcp), par)
        logits, _, arena = step(st, batch, arena)
        out.append(np.asarray(logits).reshape(dp, CHUNK, -1))
    return np.concatenate(out, axis=1), np.asarray(arena), blocks


@pytest.fixture(scope="session")
def reference(model_setup):
    """Single-device logits `[NUM_PROMPTS, S, vocab]` and the arena/blocks of prompt 0."""
    cfg, layout, graphdef, state, prompts = model_setup
    outs, first = [], None
    for r in range(NUM_PROMPTS):
        setup_r = (cfg, layout, graphdef, state, [prompts[r]])
        logits, arena, blocks = run_layout(setup_r, None)
        outs.append(logits[0])
        if r == 0:
            first = (arena, blocks)
    return np.stack(outs), first
