"""The KV row format a P/D transfer carries, and the check that both sides share it.

`kv_layout_descriptor` describes what the canonical rows of `serving/pd/relayout.py` mean: the
model's shape (so KV of another model is refused even when its rows happen to be the same size)
and, per KV cache group, its components (name, layers, width, row dtype, rope dim). Tokens per
page, DCP size, interleave and page count are *not* part of it: the re-layout handles those.
`layout_mismatch` compares a remote descriptor with the local one; the transfer runtime checks
only byte sizes, so a mismatch must be caught here, never by the pull.
"""

from __future__ import annotations

from glm53.kv_layout import KVCacheLayout

MODEL_FIELDS = ("hidden_size", "num_hidden_layers", "vocab_size", "kv_lora_rank", "qk_rope_head_dim",
                "index_head_dim", "num_mtp_layers")


def kv_layout_descriptor(layout: KVCacheLayout, cfg) -> dict:
    """JSON-able description of the rows: `{"model": {...}, "groups": {name: [[component, layers,
    width, row_dtype, rope_dim], ...]}}`."""
    return {
        "model": {f: int(getattr(cfg, f)) for f in MODEL_FIELDS if hasattr(cfg, f)},
        "groups": {g.name: [[c.name, c.num_layers, c.width, c.row_dtype, c.rope_dim] for c in g.components]
                   for g in layout.groups},
    }


def layout_mismatch(remote: dict, local: dict, groups) -> str | None:
    """Why KV described by `remote` cannot fill the `groups` of `local` (None when it can)."""
    if not isinstance(remote, dict) or not isinstance(remote.get("groups"), dict):
        return "kv_layout is not a KV layout descriptor"
    if remote.get("model") != local["model"]:
        return f"KV of another model: {remote.get('model')} here {local['model']}"
    for name in groups:
        if name not in remote["groups"]:
            return (f"the prefill engine has no {name!r} KV group (its groups: {sorted(remote['groups'])}); "
                    "run both engines with the same --speculative-config")
        there, here = [list(c) for c in remote["groups"][name]], local["groups"][name]
        if there != here:
            only_layers = len(there) == len(here) and all(
                a[:1] + a[2:] == b[:1] + b[2:] for a, b in zip(there, here))
            why = ("the MTP layer's rows are one more layer of each group on one side only: run both engines "
                   "with the same --speculative-config" if only_layers else "--kv-cache-dtype must match")
            return f"KV group {name!r} rows differ: {there} there, {here} here ({why})"
    return None
