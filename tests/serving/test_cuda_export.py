"""Every device program an engine runs, exported for CUDA from this CPU machine (`jax.export`,
`platforms=("cuda",)`, an abstract H200 — `kernels/mode.py`'s "triton" mode picks the Pallas
kernels without interpret mode): the step (plain, HiSparse's hot program, MTP's verify step, under
TP2 × DCP2), HiSparse's store program, the offloading connector's store and load programs, and the
step split in forward and sample programs (asynchronous scheduling with structured outputs).

Each export fails the test if an op has no CUDA lowering; the Pallas kernels expected on a GPU
must be lowered into the exported step (their Triton modules are recorded as the lowering builds
them); and, where a program touches host memory, no host-memory value may feed anything but a
slice, a move or a `dynamic_update_slice` (`tests/helpers/host_memory.py`: on a GPU anything else is
refused or becomes slow host compute).

What cannot be exported without a GPU, and why (pinned by the last test): the host-callback
programs of the "callback" host mechanism (HiSparse's GPU default, and the offloading connector's):
a Python callback is registered with the backend that lowers it, and this machine's backend is the
CPU, so `jax.export` refuses to lower it for CUDA. Those programs are first compiled on a GPU
(`scripts/gpu_check.py` territory). Also only on a GPU: Triton IR → PTX, and XLA's GPU compile
(fusion, memory-space assignment of host operands).

Tiny-model notes for a GPU run: its indexer has 4 heads and the Triton indexer kernel needs ≥ 16,
so the tiny model's indexer runs the reference on a GPU (GLM-5.3 has 32 heads); its FP8 matmuls
have K = 64 / 96, below the kernel's 128-wide K block, so they run the reference too. Both fall
back with a warning (kernels/mode.py).
"""

from __future__ import annotations

import jax
import pytest

from kernels.mode import use_kernels
from serving.engine import EngineArgs
from serving.engine_factory import build_engine
from serving.step_inputs import COPY_DST, COPY_SRC, NUM_SAMPLING
from sharding.mesh import ParallelConfig
from tests.helpers.host_memory import host_memory_reads
from tests.helpers.triton_lowering import (
    TRITON_CALL,
    export_cuda,
    record_triton_lowerings,
)

# The tiny checkpoint's 7-layer twin (tests/helpers/shallow_model.py): the same code paths, faster steps.
pytestmark = pytest.mark.shallow_model

HOT_RESOLVER = {"hot_resolve_validate", "hot_resolve_lookup", "hot_resolve_rank", "hot_resolve_assign"}


@pytest.fixture
def lowered_kernels(monkeypatch):
    """Names of the Pallas kernels lowered to Triton during the test."""
    return record_triton_lowerings(monkeypatch, lambda m: m.name)


def build(**overrides):
    args = dict(max_model_len=256, max_num_seqs=2, max_num_batched_tokens=32, cuda_graph_sizes=[],
                precompile_token_paddings=[], enable_prefix_caching=True, compile_progress=False,
                disable_log_stats=True, skip_precompile=True)
    with use_kernels("triton"):
        return build_engine(EngineArgs(**{**args, **overrides}))


HISPARSE = {"num_gpu_blocks_override": 10, "max_model_len": 512, "attention_config": {"hisparse_config": {
    "host_pool_gib": 0.05, "prefill_buffer_size": 1024, "host_gather": "memory_kind"}}}
OFFLOAD = {"kv_transfer_config": {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                  "kv_connector_extra_config": {"cpu_bytes_to_use": 64 * 2**20}}}
CASES = {
    # name: (EngineArgs overrides, Pallas kernels the exported step must hold)
    "default": ({}, {"sparse_mla"}),
    # (The tiny model's fp8 rows are too narrow for the GPU kernels — 8 rope lanes, 8 key lanes,
    # where Triton needs 16 — so its fp8 step exports with the references, saying so; GLM-5.3's
    # fp8 rows lower: tests/kernels/test_pallas_lowering.py.)
    "fp8_cache": ({"kv_cache_dtype": "fp8"}, set()),
    "mtp": ({"speculative_config": {"method": "mtp", "num_speculative_tokens": 2}}, {"sparse_mla"}),
    "hisparse": (HISPARSE, {"sparse_mla"} | HOT_RESOLVER),
    "offload": (OFFLOAD, {"sparse_mla"}),
    "tp2_dcp2": ({"parallel": ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2)}, {"sparse_mla"}),
    "dp2_ep": ({"parallel": ParallelConfig(data_parallel_size=2, enable_expert_parallel=True)}, {"sparse_mla"}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_every_program_exports_for_cuda_with_its_kernels(name, lowered_kernels):
    overrides, kernels = CASES[name]
    e = build(**overrides)
    r = e.runner
    devices = 1 if r.parallel is None else r.parallel.mesh.size
    hot = r.hisparse is not None
    text = export_cuda(r._step, *r.example_step_args(hot), devices=devices)
    assert text.count(TRITON_CALL) >= len(kernels) and (kernels or TRITON_CALL not in text)
    assert kernels <= set(lowered_kernels), f"Pallas kernels missing from the exported step: {kernels - set(lowered_kernels)}"
    programs = {"step": (r._step, r.example_step_args(hot))}
    if hot:
        programs["plain step"] = (r._step, r.example_step_args(False))
        src, dst = r.hisparse.store_lists([])
        programs["store"] = (r._store_only, (r.hisparse.pool, r.kv_arena, src, dst))
    if name in ("default", "hisparse"):  # the step split in two (async with structured outputs): its ops are
        # the step's, so the layouts' step exports cover them; exported on one device, plain and hot
        args = r.example_step_args(hot)  # (state, batch, arena, *StepInputs.extra, hs, spec)
        extra = args[3:3 + COPY_DST + 1]
        programs["forward"] = (r._forward, (*args[:3], extra[COPY_SRC], extra[COPY_DST], args[3 + COPY_DST + 1]))
        logits = jax.eval_shape(r._forward, *programs["forward"][1])[0]
        bitmask = jax.ShapeDtypeStruct((logits.shape[0], -(-logits.shape[1] // 32)), jax.numpy.int32)
        programs["sample"] = (r._sample, (logits, *extra[:NUM_SAMPLING], bitmask))
    if r.offload is not None:
        t = r.offload.transfer
        src, dst = next(iter(t._lists([(1, 1)])))
        programs["offload store"] = (t._store, (t.host, r.kv_arena, src, dst))
        programs["offload load"] = (t._load, (r.kv_arena, t.host, src, dst))
    for label, (fn, args) in programs.items():
        if label != "step":
            assert export_cuda(fn, *args, devices=devices), label
        reads = host_memory_reads(jax.make_jaxpr(fn)(*args))
        assert [x for x in reads if x[1] != "ok"] == [], (label, reads)
    print(f"\n{name}: exported {sorted(programs)}; Pallas kernels lowered: {sorted(set(lowered_kernels))}")


def test_host_callback_programs_cannot_be_exported_without_a_gpu():
    """The "callback" host mechanism's programs lower only where the callback's backend is the
    target's: from a CPU machine jax.export refuses them for CUDA (a GPU compiles them)."""
    e = build(**{**HISPARSE, "attention_config": {"hisparse_config": {
        "host_pool_gib": 0.05, "prefill_buffer_size": 1024, "host_gather": "callback"}}})
    r = e.runner
    export_cuda(r._step, *r.example_step_args(False))  # the plain step has no callback: it exports
    with pytest.raises(ValueError, match="platform for the specified backend cpu is different from the lowering platform cuda"):
        export_cuda(r._step, *r.example_step_args(True))
