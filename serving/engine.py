"""The synchronous engine core: scheduler + block pool + model runner, one `step()` at a time.

    engine = LLMEngine.from_args(EngineArgs(model="/path/to/ckpt"))
    engine.add_request("r1", prompt_ids, SamplingParams(temperature=0, max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step(): ...

All bookkeeping (scheduler, pool, block tables) is host-side Python; all compute is one jitted
step per call (serving/runner.py). `audit()` checks the pool and table invariants.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from glm53.capacity import engine_capacity_summary
from glm53.kv_layout import build_kv_layout
from glm53.loader import load_model
from serving.block_pool import BlockPool
from serving.kv_cache import KVCacheGroupSpec, KVCacheManager
from serving.request import Request
from serving.runner import ModelRunner
from serving.scheduler import Scheduler, SchedulerConfig
from serving.types import RequestOutput, SamplingParams

logger = logging.getLogger(__name__)

# On a backend that reports no memory limit (the CPU), the KV arena gets this many bytes unless
# --num-gpu-blocks-override says otherwise.
CPU_KV_CACHE_BYTES = 512 * 2**20


@dataclass
class EngineArgs:
    """Engine settings (vLLM flag names). `model` is a checkpoint directory (None = the tiny default)."""

    model: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    seed: int = 0
    compile_progress: bool = True
    kv_cache_dtype: str = "auto"  # "auto" (the model dtype), "bfloat16" or "fp8"


def _model_dtype(name: str, device) -> jnp.dtype:
    if name == "auto":
        return jnp.bfloat16 if device.platform in ("gpu", "cuda", "rocm", "tpu") else jnp.float32
    return {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[name]


def num_kv_blocks(page_bytes: int, args: EngineArgs, device, weight_bytes: int) -> int:
    """Arena pages (including the null block) from the override or the device memory budget."""
    if args.num_gpu_blocks_override is not None:
        if args.num_gpu_blocks_override < 2:
            raise ValueError("--num-gpu-blocks-override must be >= 2 (block 0 is the null block)")
        return int(args.num_gpu_blocks_override)
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    if limit:
        budget = int(limit * args.gpu_memory_utilization) - weight_bytes - stats.get("bytes_in_use", 0)
    else:
        budget = CPU_KV_CACHE_BYTES
    n = budget // page_bytes
    if n < 2:
        raise ValueError(f"not enough memory for the KV cache: {budget} bytes for pages of {page_bytes} bytes; "
                         "lower --max-model-len or raise --gpu-memory-utilization")
    return int(n)


class LLMEngine:
    """Continuous-batching engine over one device. Use `from_args` to build one."""

    def __init__(self, model, layout, num_blocks: int, args: EngineArgs, eos_token_ids, model_path: str):
        self.args = args
        self.model_path = model_path
        self.config = model.cfg
        self.layout = layout
        self.pool = BlockPool(num_blocks)
        groups = [KVCacheGroupSpec(g.name, g.tokens_per_page) for g in layout.groups]
        caps = {g.name: math.ceil(args.max_model_len / g.tokens_per_page) for g in layout.groups}
        self.kv = KVCacheManager(self.pool, groups, caps)
        self.scheduler = Scheduler(
            SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens, args.max_model_len),
            self.kv, eos_token_ids)
        self.runner = ModelRunner(model, layout, num_blocks, max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_model_len=args.max_model_len, seed=args.seed)
        self.eos_token_ids = tuple(eos_token_ids)
        self.num_steps = 0
        self.host_overhead_s = 0.0

    @classmethod
    def from_args(cls, args: EngineArgs, eos_token_ids=None) -> "LLMEngine":
        """Load the checkpoint, size the KV arena, build the engine and compile its step buckets."""
        from glm53.tiny_checkpoint import default_model_dir
        from glm53.tokenizer import eos_token_ids as read_eos

        path = args.model or str(default_model_dir())
        device = jax.devices()[0]
        dtype = _model_dtype(args.dtype, device)
        t0 = time.perf_counter()
        model = load_model(path, dtype=dtype, progress=args.compile_progress)
        cfg = model.cfg
        if args.max_model_len is None:
            args.max_model_len = min(cfg.max_position_embeddings, 4096)
        if args.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"--max-model-len {args.max_model_len} exceeds the model's max_position_embeddings "
                             f"{cfg.max_position_embeddings}")
        if args.max_num_batched_tokens < 1 or args.max_num_seqs < 1:
            raise ValueError("--max-num-batched-tokens and --max-num-seqs must be >= 1")
        cache_dtype = jnp.dtype(dtype).name if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
        layout = build_kv_layout(cfg, cache_dtype, with_mtp=False)
        weight_bytes = sum(x.nbytes for x in jax.tree.leaves(jax.tree.map(lambda v: v, model)) if hasattr(x, "nbytes"))
        nblocks = num_kv_blocks(layout.page_bytes, args, device, weight_bytes)
        logger.info("model %s loaded in %.1fs (%s, %.1f MiB of weights); KV arena %d pages x %.2f MiB "
                    "(%s tokens/page per group)", path, time.perf_counter() - t0, jnp.dtype(dtype).name,
                    weight_bytes / 2**20, nblocks, layout.page_bytes / 2**20,
                    {g.name: g.tokens_per_page for g in layout.groups})
        eos = tuple(eos_token_ids) if eos_token_ids is not None else read_eos(cfg, path)
        engine = cls(model, layout, nblocks, args, eos, path)
        logger.info("%s", engine_capacity_summary(layout, nblocks, args.max_model_len, args.max_num_seqs))
        secs = engine.runner.compile(progress=args.compile_progress)
        logger.info("compiled %d step buckets %s in %.1fs", len(engine.runner.buckets), engine.runner.buckets, secs)
        return engine

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request. Raises ValueError for bad params or a prompt that cannot be served."""
        params.validate()
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        if n >= self.args.max_model_len:
            raise ValueError(f"the prompt has {n} tokens; this model's maximum context length is "
                             f"{self.args.max_model_len} (--max-model-len), which must also leave room for output")
        if params.max_tokens is not None and n + params.max_tokens > self.args.max_model_len:
            raise ValueError(f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds the maximum context "
                             f"length {self.args.max_model_len}")
        vocab = self.config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        self.scheduler.add_request(Request(request_id, list(map(int, prompt_token_ids)), params))

    def abort(self, request_id: str) -> RequestOutput | None:
        return self.scheduler.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Schedule, run one jitted step, apply its tokens. Returns the new request outputs."""
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        sampled = self.runner.execute(sched, self.kv)
        t1 = time.perf_counter()
        outs = self.scheduler.update_from_output(sched, sampled)
        st = self.runner.last
        host = (time.perf_counter() - t0) - st.device_s
        self.num_steps += 1
        self.host_overhead_s += host
        logger.debug("step %d: %d tokens (bucket %d), host %.2f ms, device %.2f ms", self.num_steps, st.num_tokens,
                     st.padded_tokens, 1e3 * host, 1e3 * st.device_s)
        return outs

    def audit(self) -> list[str]:
        """Invariant violations of the scheduler, the block tables and the pool (empty when sound)."""
        return self.scheduler.audit()
