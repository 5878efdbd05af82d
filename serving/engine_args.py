"""Engine settings (vLLM's flag names) and the KV arena's page count they give."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import jax.numpy as jnp

from sharding.mesh import ParallelConfig

logger = logging.getLogger("serving.engine")  # start-up lines under the engine's name


# On a backend that reports no memory limit (the CPU), the KV arena gets this many bytes unless
# --num-gpu-blocks-override says otherwise.
CPU_KV_CACHE_BYTES = 512 * 2**20


@dataclass
class EngineArgs:
    """Engine settings (vLLM flag names). `model` is a checkpoint directory, a Hugging Face hub id or
    'tiny' (None = the tiny default; `glm53.hub.resolve_model`).

    max_logprobs: most `logprobs` alternatives a request may ask for (the device step always
        computes this many). disable_log_stats: no periodic statistics log line.
    skip_precompile: True: do not compile the step buckets at start-up; each program compiles on
        its first use instead. For tests, notebooks and quick experiments, where start-up time
        matters and many programs go unused: the first step of each shape pays the compile, so a
        server keeps the default. None (the default): the environment decides
        (`skip_precompile_requested`); False: compile at start-up whatever the environment says.
    """

    model: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    seed: int = 0
    compile_progress: bool = True
    enable_prefix_caching: bool = False
    max_logprobs: int = 20
    disable_log_stats: bool = False
    log_stats_interval_s: float = 5.0
    parallel: ParallelConfig | None = None  # TP / PCP / DCP / EP sizes (None: one device)
    kv_cache_dtype: str = "auto"  # "auto" (the model dtype), "bfloat16" or "fp8"
    quantization: str | None = None  # --quantization: None (the checkpoint's), "fp8" (online for bf16 checkpoints)
    cuda_graph_sizes: list[int] | None = None  # decode-sized step buckets (None: 1, 2, 4, … max_num_seqs)
    precompile_token_paddings: list[int] | None = None  # prefill-sized step buckets (None: 16·4^k; []: the budget alone)
    attention_config: dict | None = None  # --attention-config (hisparse_config: Hybrid HiSparse)
    kv_transfer_config: dict | None = None  # --kv-transfer-config (OffloadingConnector, JaxTransferConnector)
    speculative_config: dict | None = None  # --speculative-config (MTP speculative decoding)
    kv_events_config: dict | None = None  # --kv-events-config (KV cache events for prefix-aware routers)
    structured_outputs_config: dict | None = None  # --structured-outputs-config (serving/structured_outputs)
    # --async-scheduling (serving/async_scheduling.py): True or None (the server's default) turn it
    # on, False (the library's default): off.
    async_scheduling: bool | None = False
    skip_precompile: bool | None = None


# tpu-inference's switch for the same thing (vLLM's JAX backend): SKIP_JAX_PRECOMPILE=1.
SKIP_PRECOMPILE_ENV = "SKIP_JAX_PRECOMPILE"


def skip_precompile_requested(args: EngineArgs) -> bool:
    """Whether the engine leaves its step programs to compile on first use: `args.skip_precompile`
    when it is set, else whether the environment variable `SKIP_JAX_PRECOMPILE` is set to anything
    but "" / "0" (the name tpu-inference reads), so a test suite or a notebook session can ask for
    it without touching every engine it builds."""
    if args.skip_precompile is not None:
        return bool(args.skip_precompile)
    return os.environ.get(SKIP_PRECOMPILE_ENV, "") not in ("", "0")


def model_dtype(name: str, device) -> jnp.dtype:
    """`--dtype` → the activation dtype: auto = bf16 on accelerators, fp32 on the CPU. Raises
    ValueError naming the choices for anything else (float16 is not one: GLM-5.x runs in bf16)."""
    if name == "auto":
        return jnp.bfloat16 if device.platform in ("gpu", "cuda", "rocm", "tpu") else jnp.float32
    dtypes = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
    if name not in dtypes:
        raise ValueError(f"dtype {name!r} is not supported; choose one of auto, {', '.join(dtypes)}")
    return dtypes[name]


def num_kv_blocks(page_bytes: int, args: EngineArgs, device, weight_bytes: int) -> int:
    """Arena pages (including the null block) from `--num-gpu-blocks-override`, or from the
    device budget: `bytes_limit * gpu_memory_utilization` minus what is already allocated on the
    device (`bytes_in_use`, which includes the loaded weights; when the backend reports no usage,
    `weight_bytes` is subtracted instead), divided by the page size (vLLM's meaning of
    --gpu-memory-utilization: the share of device memory this engine may use in all). A backend
    that reports no memory limit (the CPU) gets `CPU_KV_CACHE_BYTES` for the arena.

    Raises:
      ValueError: an override < 2, or a budget of fewer than 2 pages (the message names the flags).
    """
    if args.num_gpu_blocks_override is not None:
        if args.num_gpu_blocks_override < 2:
            raise ValueError("--num-gpu-blocks-override must be >= 2 (block 0 is the null block)")
        logger.info("KV arena: %d pages from --num-gpu-blocks-override", args.num_gpu_blocks_override)
        return int(args.num_gpu_blocks_override)
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    if limit:
        in_use = stats.get("bytes_in_use") or weight_bytes
        budget = int(limit * args.gpu_memory_utilization) - in_use
        logger.info("KV arena budget: %.2f GiB = %.2f GiB x --gpu-memory-utilization %.2f - %.2f GiB in use",
                    budget / 2**30, limit / 2**30, args.gpu_memory_utilization, in_use / 2**30)
    else:
        budget = CPU_KV_CACHE_BYTES
        logger.info("KV arena budget: %.0f MiB (the backend reports no memory limit)", budget / 2**20)
    n = budget // page_bytes
    if n < 2:
        raise ValueError(f"not enough memory for the KV cache: {budget} bytes for pages of {page_bytes} bytes; "
                         "lower --max-model-len or raise --gpu-memory-utilization")
    return int(n)
