"""Every device program an engine runs, exported for CUDA from this CPU machine (`jax.export`,
`platforms=("cuda",)`, an abstract H200 — `kernels/mode.py`'s "triton" mode picks the Pallas
kernels without interpret mode): the step (plain, HiSparse's hot program, MTP's verify step, under
TP2 × DCP2), HiSparse's store program and the offloading connector's store and load programs.

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

import warnings
from unittest import mock

import jax
import numpy as np
import pytest
from jax._src.pallas.triton import gpu_info
from jax._src.pallas.triton import pallas_call_registration as triton_registration

from kernels.mode import use_kernels
from serving.engine import EngineArgs
from serving.engine_factory import build_engine
from sharding.mesh import ParallelConfig
from tests.helpers.host_memory import host_memory_reads

TRITON_CALL = "__gpu$xla.gpu.triton"
H200 = "NVIDIA H200"
HOT_RESOLVER = {"hot_resolve_validate", "hot_resolve_lookup", "hot_resolve_rank", "hot_resolve_assign"}


@pytest.fixture
def lowered_kernels(monkeypatch):
    """Names of the Pallas kernels lowered to Triton during the test (private hook, as in
    tests/kernels/test_pallas_lowering.py)."""
    names = []
    lower = triton_registration.lowering.lower_jaxpr_to_triton_module

    def record(jaxpr, *args, **kwargs):
        names.append(str(jaxpr.debug_info.func_name).removesuffix("_kernel"))
        return lower(jaxpr, *args, **kwargs)

    monkeypatch.setattr(triton_registration.lowering, "lower_jaxpr_to_triton_module", record)
    return names


def _spec(x):
    if isinstance(x, jax.Array):
        # (A host-memory array's memory space is carried explicitly: the sharding's memory kind
        # alone does not make the traced value a host value.)
        host = getattr(x.sharding, "memory_kind", None) in ("pinned_host", "unpinned_host")
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding,
                                    _memory_space=jax.memory.Space.Host if host else None)
    if isinstance(x, np.ndarray):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    return x


def export_cuda(fn, *args, devices: int = 1) -> str:
    """`fn(*args)` (shapes, dtypes and shardings of `args`) exported for CUDA → its MLIR text.
    One device: under an abstract H200 mesh. A parallel layout keeps the engine's own mesh (its
    `shard_map`s name it) and tells the Triton lowering the GPU it targets instead."""
    if devices == 1:
        dev = jax.sharding.AbstractDevice(device_kind=H200, num_cores=132, platform="cuda")
        target = jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh(
            (1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), abstract_device=dev))
    else:
        target = mock.patch.object(gpu_info, "get_device_kind", lambda: H200)
    with warnings.catch_warnings(), target, use_kernels("triton"):
        warnings.simplefilter("ignore", DeprecationWarning)  # the Triton backend's deprecation notice
        exp = jax.export.export(fn, platforms=["cuda"],
                                disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(
            *jax.tree.map(_spec, args))
    return exp.mlir_module()


def build(**overrides):
    args = dict(max_model_len=256, max_num_seqs=2, max_num_batched_tokens=32, cuda_graph_sizes=[],
                precompile_token_paddings=[], enable_prefix_caching=True, compile_progress=False,
                disable_log_stats=True, skip_precompile=True)
    with use_kernels("triton"):
        return build_engine(EngineArgs(**{**args, **overrides}))


def step_args(r, hot: bool):
    batch, extra = r._dummy(r.buckets[0])
    hs = r._hisparse_args() if hot else None
    if not hot:
        batch.hot = None
    return (r._state_leaves, r._place(batch), r.kv_arena, *extra, hs, r._dummy_spec)


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
    text = export_cuda(r._step, *step_args(r, hot), devices=devices)
    assert text.count(TRITON_CALL) >= len(kernels) and (kernels or TRITON_CALL not in text)
    assert kernels <= set(lowered_kernels), f"Pallas kernels missing from the exported step: {kernels - set(lowered_kernels)}"
    programs = {"step": (r._step, step_args(r, hot))}
    if hot:
        programs["plain step"] = (r._step, step_args(r, False))
        src, dst = r.hisparse.store_lists([])
        programs["store"] = (r._store_only, (r.hisparse.pool, r.kv_arena, src, dst))
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
    export_cuda(r._step, *step_args(r, False))  # the plain step has no callback: it exports
    with pytest.raises(ValueError, match="platform for the specified backend cpu is different from the lowering platform cuda"):
        export_cuda(r._step, *step_args(r, True))
