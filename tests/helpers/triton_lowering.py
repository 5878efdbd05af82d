"""Lowering and exporting programs for CUDA on a machine without a GPU: `jax.export` for platform
"cuda" with an abstract H200 traces each Pallas kernel through the Pallas→Triton lowering into the
Triton IR XLA's GPU compiler consumes (tests/kernels/test_pallas_lowering.py for the kernels alone,
tests/serving/test_cuda_export.py for the engine's programs)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from unittest import mock

import jax
import numpy as np
from jax._src.pallas.triton import gpu_info
from jax._src.pallas.triton import pallas_call_registration as triton_registration

from kernels.mode import use_kernels

TRITON_CALL = "__gpu$xla.gpu.triton"
H200 = "NVIDIA H200"


@dataclass
class TritonModule:
    """One Triton module the lowering built: its kernel's name (the kernel function's, without a
    `_kernel` suffix), its IR text, and the MLIR verifier's result on it."""

    name: str
    text: str
    verified: bool


def record_triton_lowerings(monkeypatch, keep=lambda m: m) -> list:
    """Record every Triton module the lowering builds from now on (private hook: the Triton IR is
    otherwise only checked by XLA's GPU compiler) → the list `keep(TritonModule)` of each is
    appended to (e.g. `lambda m: m.verified`)."""
    modules: list = []
    lower = triton_registration.lowering.lower_jaxpr_to_triton_module

    def record(jaxpr, *args, **kwargs):
        out = lower(jaxpr, *args, **kwargs)
        modules.append(keep(TritonModule(str(jaxpr.debug_info.func_name).removesuffix("_kernel"), str(out.module),
                                         out.module.operation.verify())))
        return out

    monkeypatch.setattr(triton_registration.lowering, "lower_jaxpr_to_triton_module", record)
    return modules


def spec(x):
    """An argument → its `ShapeDtypeStruct` (a jax.Array keeps its sharding and, in host memory,
    its memory space: the sharding's memory kind alone does not make the traced value a host
    value); anything else is returned as is."""
    if isinstance(x, jax.Array):
        host = getattr(x.sharding, "memory_kind", None) in ("pinned_host", "unpinned_host")
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding,
                                    _memory_space=jax.memory.Space.Host if host else None)
    if isinstance(x, np.ndarray):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    return x


def export_cuda(fn, *args, devices: int = 1) -> str:
    """`fn(*args)` (arrays or `ShapeDtypeStruct`s: shapes, dtypes, shardings) exported for CUDA
    with the Pallas kernels in their GPU form (kernels/mode.py "triton") → its MLIR text. One
    device: under an abstract H200 mesh. A parallel layout keeps the program's own mesh (its
    `shard_map`s name it) and tells the Triton lowering the GPU it targets instead."""
    if devices == 1:
        dev = jax.sharding.AbstractDevice(device_kind=H200, num_cores=132, platform="cuda")
        target = jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh(
            (1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), abstract_device=dev))
    else:
        target = mock.patch.object(gpu_info, "get_device_kind", lambda: H200)
    with warnings.catch_warnings(), target, use_kernels("triton"):
        warnings.simplefilter("ignore", DeprecationWarning)  # the Triton backend's deprecation notice
        exp = jax.export.export(jax.jit(fn), platforms=["cuda"],
                                disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(
            *jax.tree.map(spec, args))
    return exp.mlir_module()
