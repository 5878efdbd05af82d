"""Dispatch for sparse MLA: picks an implementation for the backend, falling back to the reference.

Implementations (the registry `IMPLEMENTATIONS`):
  "xla"            `reference.sparse_mla_reference`: pure JAX, the CPU path and the oracle.
  "pallas_triton"  `pallas_triton.sparse_mla_pallas_triton`: Pallas kernel lowered through Triton.

Default choice (`implementation=None`): "pallas_triton" when JAX's default backend is "gpu",
else "xla". The Pallas kernel is skipped (reference used instead) when its
`unsupported_reason` names one: row dtypes without a lane codec in `kernels.pallas_rows` (every
MLA row dtype of `kernels.paged` has one today: float32, bfloat16, fp8_ds_mla), latent or rope
lane widths that are not powers of two ≥ 16 (A / L, R / L with L values per word: 1, 2, or 4 for
the fp8 latent and 2 for its bf16 rope), fp8_ds_mla rows with A not a multiple of 128 (the scale
tile), block sizes that are not powers of two ≥ 16. An explicit
`implementation=` is used as given and raises NotImplementedError when unsupported.
`interpret=True` runs the Pallas kernel in interpret mode on any backend (tests) and selects it
unless `implementation` says otherwise.

`sparse_mla_force_mqa` (vLLM's flag for GLM-5.x / DeepSeek-V3.2) is a choice one level up, in the
model's attention interface, not here: this op is always the absorbed MQA form over top-k slots.
For a prompt no longer than `index_topk` every key is selected and sparse MLA equals dense causal
attention, so an attention layer may run such prefills as dense MHA instead; with the flag set it
keeps them on this op (the sparse path) as well.
"""

from __future__ import annotations

import jax
from jaxtyping import Array, Float, Int, UInt32

from kernels.mode import choose, warn_fallback
from kernels.sparse_mla.pallas_triton import sparse_mla_pallas_triton, unsupported_reason
from kernels.sparse_mla.reference import sparse_mla_reference

IMPLEMENTATIONS = {"xla": sparse_mla_reference, "pallas_triton": sparse_mla_pallas_triton}


def default_implementation() -> str:
    """What a call without `implementation=` / `interpret=` runs under the active kernel mode
    (`kernels/mode.py`; by default "pallas_triton" on a GPU backend, "xla" elsewhere)."""
    return choose(None, False)[0]


def sparse_mla(q_TNC: Float[Array, "T N C"], kv_arena: UInt32[Array, "blocks page_words"],
               topk_slots_TK: Int[Array, "T K"], layer: Int[Array, ""] | int, *, layout, component="mla",
               kv_lora_rank: int, scale: float, implementation: str | None = None, interpret: bool = False,
               precision: str | None = None) -> tuple[Float[Array, "T N A"], Float[Array, "T N"]]:
    """`(o_lat [T,N,A] fp32, lse [T,N] fp32)`; see `reference.sparse_mla_reference` for the contract.

    implementation: None (choose, module docstring), "xla" or "pallas_triton".
    interpret: Pallas interpret mode (tests). precision: Pallas only; None → "bf16" for bfloat16
      queries, "highest" otherwise (see `pallas_triton`).
    Raises:
      KeyError: unknown implementation name.
      NotImplementedError: an explicitly requested Pallas configuration it does not support.
    """
    explicit = implementation is not None
    name, interpret = choose(implementation, interpret)
    impl = IMPLEMENTATIONS[name]
    if name == "xla":
        return impl(q_TNC, kv_arena, topk_slots_TK, layer, layout=layout, component=component,
                    kv_lora_rank=kv_lora_rank, scale=scale)
    if precision is None:
        precision = "bf16" if q_TNC.dtype == jax.numpy.bfloat16 else "highest"
    reason = unsupported_reason(layout, component, kv_lora_rank, precision=precision, interpret=interpret)
    if reason is not None and not explicit:
        warn_fallback("sparse_mla", reason)
        return sparse_mla_reference(q_TNC, kv_arena, topk_slots_TK, layer, layout=layout, component=component,
                                    kv_lora_rank=kv_lora_rank, scale=scale)
    return impl(q_TNC, kv_arena, topk_slots_TK, layer, layout=layout, component=component, kv_lora_rank=kv_lora_rank,
                scale=scale, precision=precision, interpret=interpret)
