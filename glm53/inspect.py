"""Looking inside the model from a notebook: which positions each indexer selects.

`indexer_selections(lm, token_ids)` prefills `token_ids` from scratch (`glm53.api.forward`) and
returns, for every full (indexer-owning) layer in order, the request-local positions its lightning
indexer selected for every query row. The IndexShare layers after a full layer attend to exactly
that layer's selection (`GlmConfig.layer_plan`, `cfg.full_layers`).
"""

from __future__ import annotations

import contextlib

import jax
import numpy as np


@contextlib.contextmanager
def _capture_topk(out: list[np.ndarray]):
    """Within the context, every full layer's indexer also sends its top-k positions `[T, K]` to
    the host (in layer order) through an ordered `jax.debug.callback`."""
    import glm53.attention as attn

    orig = attn.indexer_topk

    def recording(*args, **kw):
        res = orig(*args, **kw)
        jax.debug.callback(lambda idx: out.append(np.asarray(idx)), res[0], ordered=True)
        return res

    attn.indexer_topk = recording
    try:
        yield
    finally:
        attn.indexer_topk = orig


def forward_fresh(lm, token_ids) -> None:
    """`glm53.api.forward` recompiled now (so an indexer patched by the caller is traced) and its
    host callbacks flushed; the compiled-step cache is cleared again after, so later calls do not
    keep the patched program."""
    from glm53 import api

    api._compiled.cache_clear()
    try:
        api.forward(lm, token_ids)
        jax.effects_barrier()
    finally:
        api._compiled.cache_clear()


def indexer_selections(lm, token_ids) -> list[np.ndarray]:
    """→ one int32 array `[S, index_topk]` per full layer (`lm.config.full_layers` order): row i
    holds the positions (≤ i) the layer's indexer selected for query i, −1 where fewer than
    `index_topk` positions exist."""
    sel: list[np.ndarray] = []
    with _capture_topk(sel):
        forward_fresh(lm, token_ids)
    return sel
