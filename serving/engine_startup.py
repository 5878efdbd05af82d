"""Engine start-up: load the checkpoint, size the KV arena, and log the plan (capacity, HiSparse,
MTP, prefix caching) before the step buckets compile. `serving.engine.LLMEngine.from_args` (and
the data-parallel engine, through it) call these."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from glm53.capacity import engine_capacity_summary
from glm53.kv_layout import KVCacheLayout, build_kv_layout
from glm53.loader import load_model
from glm53.weight_bytes import device_weight_bytes
from serving.engine_args import EngineArgs, model_dtype, num_kv_blocks
from serving.spec_decode import SpeculativeConfig
from sharding.mesh import ParallelLayout

logger = logging.getLogger("serving.engine")  # start-up lines under the engine's name


@dataclass
class EngineParts:
    """What an engine is built from: the loaded model, its KV layout, the arena's page count
    (per replica under data parallelism), the EOS ids and the checkpoint directory."""

    model: object
    layout: KVCacheLayout
    num_blocks: int
    eos_token_ids: tuple[int, ...]
    path: str


def _check_limits_before_loading(path: str, args: EngineArgs) -> None:
    """`--max-model-len` against the checkpoint's config.json's `max_position_embeddings`, before
    minutes of weight loading. (A config that cannot be read or does not set it is left to the
    check after `load_model`, whose errors name the problem.)"""
    import json
    import os

    try:
        with open(os.path.join(path, "config.json")) as f:
            positions = json.load(f).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return
    if not isinstance(positions, int):
        return
    if args.max_model_len is not None and args.max_model_len > positions:
        raise ValueError(f"--max-model-len {args.max_model_len} exceeds the model's max_position_embeddings "
                         f"{positions}")


def load_engine_parts(args: EngineArgs, eos_token_ids=None) -> EngineParts:
    """Load the checkpoint (each device reads its own shards), check the limits against it, build
    the KV layout and size the arena; fills `args.max_model_len` when None
    (min(max_position_embeddings, 4096)).

    Raises:
      ValueError: a limit the checkpoint cannot meet (the message names the flag), MTP speculation
        without an MTP layer, or a --quantization that cannot apply (`glm53.quant.QuantizationError`).
    """
    from glm53.hub import resolve_model
    from glm53.tiny_checkpoint import default_model_dir
    from glm53.tokenizer import eos_token_ids as read_eos

    path = resolve_model(args.model) or str(default_model_dir())
    device = jax.local_devices()[0]  # (jax.devices()[0] may be another process's device)
    dtype = model_dtype(args.dtype, device)
    t0 = time.perf_counter()
    par = args.parallel
    parallel = ParallelLayout.create(par) if par is not None and par.num_devices > 1 else None
    spec = SpeculativeConfig.from_dict(args.speculative_config)
    _check_limits_before_loading(path, args)
    # Each device reads its own shards of the weights; a --quantization that cannot apply raises
    # glm53.quant.QuantizationError (a ValueError naming the flag).
    model = load_model(path, dtype=dtype, progress=args.compile_progress, shardings=parallel,
                       quantization=args.quantization)
    cfg = model.cfg
    if args.max_model_len is None:
        args.max_model_len = min(cfg.max_position_embeddings, 4096)
    if args.max_model_len > cfg.max_position_embeddings:
        raise ValueError(f"--max-model-len {args.max_model_len} exceeds the model's max_position_embeddings "
                         f"{cfg.max_position_embeddings}")
    if args.max_num_batched_tokens < 1 or args.max_num_seqs < 1:
        raise ValueError("--max-num-batched-tokens and --max-num-seqs must be >= 1")
    cache_dtype = jnp.dtype(dtype).name if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    if spec is not None and cfg.num_mtp_layers == 0:
        raise ValueError(f"--speculative-config method \"mtp\" needs a checkpoint with an MTP layer; {path} has "
                         "none (num_nextn_predict_layers = 0, or no model.layers.N.* MTP tensors)")
    layout = build_kv_layout(cfg, cache_dtype, with_mtp=spec is not None)
    weight_bytes = device_weight_bytes(cfg, dtype=dtype, quant=model.quant, parallel=par)
    nblocks = num_kv_blocks(layout.page_bytes, args, device, weight_bytes)
    weights = "FP8 weights {}x{} blocks{}".format(*model.quant.block, " (quantised at load)" if model.quant.online
                                                  else "") if model.quant is not None else jnp.dtype(dtype).name
    logger.info("model %s loaded in %.1fs (%s, activations %s, %.1f MiB of weights per device); KV arena %d "
                "pages x %.2f MiB (%s cache rows; %s tokens/page per group)", path, time.perf_counter() - t0, weights,
                jnp.dtype(dtype).name, weight_bytes / 2**20, nblocks, layout.page_bytes / 2**20, cache_dtype,
                {g.name: g.tokens_per_page for g in layout.groups})
    if parallel is not None:
        logger.info("parallel layout: %s", par.describe())
    eos = tuple(eos_token_ids) if eos_token_ids is not None else read_eos(cfg, path)
    return EngineParts(model, layout, nblocks, eos, path)


def log_engine_plan(engine, layout: KVCacheLayout, nblocks: int, args: EngineArgs) -> None:
    """Log the KV capacity line (`glm53.capacity.engine_capacity_summary`), HiSparse's plan, the
    MTP speculation settings and prefix caching, as a freshly built `engine` will run them."""
    par = args.parallel
    line = engine_capacity_summary(layout, nblocks, args.max_model_len, args.max_num_seqs,
                                   dcp=par.decode_context_parallel_size if par is not None else 1,
                                   dp=par.data_parallel_size if par is not None else 1)
    if engine.hisparse is not None:  # the line counts full residency; HiSparse's own follows
        line = line.replace("KV capacity:", "KV capacity without HiSparse:", 1) + " (HiSparse: next line)"
    logger.info("%s", line)
    if engine.hisparse is not None:
        logger.info("%s", engine.hisparse.summary(nblocks, args.max_model_len, args.max_num_seqs,
                                                  args.max_num_batched_tokens))
        note = engine.hisparse.policy.admission_note(args.max_model_len)
        if note is not None:
            logger.warning("%s", note)
    elif engine.effective_max_model_len < args.max_model_len:  # (vLLM refuses to start here)
        logger.warning("%s Longer requests are refused with a 400, and the server reports %d tokens as the context "
                       "length; a larger pool (--num-gpu-blocks-override / --gpu-memory-utilization) or a smaller "
                       "--max-model-len removes this", engine.max_model_len_note().strip(),
                       engine.effective_max_model_len)
    if engine.spec_config is not None:
        sc, mla, idx = engine.spec_config, layout.group("mla"), layout.group("indexer")
        mtp_rows = mla.bytes_per_token // mla.component("mla")[1].num_layers  # one layer's latent row
        mtp_key = idx.bytes_per_token // idx.component("indexer")[1].num_layers
        mode = (f"adaptive, min acceptance {sc.adaptive_min_acceptance}" if sc.adaptive else "static") + (
            f"; none while more than {sc.disable_by_batch_size} requests run" if sc.disable_by_batch_size else "")
        logger.info("MTP speculative decoding: %d draft tokens per request per step (%s), %d verification rows per "
                    "decoding request; the MTP layer's KV adds %d B/token (one more layer of the mla and indexer "
                    "groups: a %d B latent row and a %d B key)%s",
                    sc.num_speculative_tokens, mode,
                    sc.num_speculative_tokens + 1, mtp_rows + mtp_key, mtp_rows, mtp_key,
                    "; the HiSparse hot buffer is sized for the verification rows, and the MTP rows of pages off "
                    "the device are read from the host pool like the backbone's" if engine.hisparse else "")
    if engine.prefix_cache is not None:
        logger.info("prefix caching on: hits in steps of %d tokens (the hash unit); pages a hit covers in "
                    "part are copied on write", engine.prefix_cache.unit)
