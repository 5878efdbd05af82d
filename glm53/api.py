"""Plain functions for notebooks and scripts: load a checkpoint, run a forward pass, generate.

    from glm53 import api
    lm = api.load()                      # the embedded tiny checkpoint (or api.load("/path/to/ckpt"))
    logits = api.forward(lm, [1, 2, 3])  # [3, vocab] float32, one full causal forward
    ids = api.generate(lm, [1, 2, 3], max_new_tokens=8)   # greedy, paged prefill + decode

Everything goes through the same paged-cache path as the server: a private arena with enough
pages for the sequence, a jitted step that donates the arena.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glm53.batch import ForwardBatch, single_sequence_batch
from glm53.kv_layout import KVCacheLayout, build_kv_layout
from glm53.loader import load_model
from glm53.model import GlmForCausalLM


@dataclass
class LoadedModel:
    """A model, its cache layout and (when the checkpoint ships one) its tokenizer."""

    model: GlmForCausalLM
    layout: KVCacheLayout
    tokenizer: object | None
    path: str

    @property
    def config(self):
        return self.model.cfg


def load(path: str | None = None, *, dtype=jnp.float32, cache_dtype: str | None = None,
         progress: bool = False) -> LoadedModel:
    """Load an HF `glm_moe_dsa` checkpoint directory (default: the embedded tiny checkpoint,
    generated on first use). `cache_dtype` defaults to the model dtype's name."""
    from glm53.tiny_checkpoint import default_model_dir
    from glm53.tokenizer import GlmTokenizer

    path = path or str(default_model_dir())
    model = load_model(path, dtype=dtype, progress=progress)
    layout = build_kv_layout(model.cfg, cache_dtype or jnp.dtype(dtype).name)
    try:
        tok = GlmTokenizer.from_pretrained(path)
    except FileNotFoundError:
        tok = None
    return LoadedModel(model, layout, tok, path)


@functools.lru_cache(maxsize=8)
def _compiled(graphdef, layout: KVCacheLayout):
    @functools.partial(jax.jit, donate_argnums=(2,))
    def step(state, batch: ForwardBatch, kv_arena):
        model = nnx.merge(graphdef, state)
        return model(batch, kv_arena, layout)

    return step


def forward_step(lm: LoadedModel, batch: ForwardBatch, kv_arena: jax.Array):
    """One jitted forward over a prepared batch → (logits, hidden, kv_arena). The arena is donated."""
    graphdef, state = nnx.split(lm.model)
    return _compiled(graphdef, lm.layout)(state, jax.tree.map(jnp.asarray, batch), kv_arena)


def _pages(lm: LoadedModel, num_tokens: int) -> tuple[dict[str, list[int]], int]:
    ids, nxt = {}, 1  # block 0 is the null block
    for g in lm.layout.groups:
        n = max(1, math.ceil(num_tokens / g.tokens_per_page))
        ids[g.name] = list(range(nxt, nxt + n))
        nxt += n
    return ids, nxt


def forward(lm: LoadedModel, token_ids) -> np.ndarray:
    """Logits `[S, vocab]` float32 of one sequence, prefilled in one step on a fresh cache."""
    token_ids = list(map(int, token_ids))
    pages, nblocks = _pages(lm, len(token_ids))
    arena = lm.layout.empty_arena(nblocks)
    batch = single_sequence_batch(lm.layout, token_ids, 0, pages, logits_all=True)
    logits, _, _ = forward_step(lm, batch, arena)
    return np.asarray(logits)


def generate(lm: LoadedModel, prompt_ids, max_new_tokens: int = 16, *, eos_token_ids=(),
             return_logits: bool = False):
    """Greedy generation: one prefill step, then one decode step per token (paged cache).

    Returns the generated ids (and, if `return_logits`, the logits `[n, vocab]` each token was
    chosen from)."""
    prompt = list(map(int, prompt_ids))
    total = len(prompt) + max_new_tokens
    pages, nblocks = _pages(lm, total)
    arena = lm.layout.empty_arena(nblocks)
    batch = single_sequence_batch(lm.layout, prompt, 0, pages, logits_all=False)
    logits, _, arena = forward_step(lm, batch, arena)
    out, all_logits = [], []
    for _ in range(max_new_tokens):
        row = np.asarray(logits[-1])
        tok = int(np.argmax(row))
        out.append(tok)
        all_logits.append(row)
        if tok in eos_token_ids or len(out) == max_new_tokens:
            break
        batch = single_sequence_batch(lm.layout, [tok], len(prompt) + len(out) - 1, pages, logits_all=True)
        logits, _, arena = forward_step(lm, batch, arena)
    return (out, np.stack(all_logits)) if return_logits else out
