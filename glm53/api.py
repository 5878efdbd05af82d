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
import gc
import logging
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

logger = logging.getLogger(__name__)


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
         progress: bool = False, quantization: str | None = None) -> LoadedModel:
    """Load an HF `glm_moe_dsa` checkpoint directory or hub id (`glm53.hub.resolve_model`; default:
    the embedded tiny checkpoint, generated on first use). `cache_dtype` defaults to the model
    dtype's name. `quantization`: as `glm53.loader.load_model` (None: an FP8 checkpoint keeps FP8
    weights; "fp8": quantise a bf16 checkpoint at load; "none": dequantise FP8 weights). Turns on the persistent compilation cache the server uses
    (`glm53.compile_cache`), so a notebook's later sessions reuse the compiled forward programs.
    Raises `glm53.hub.ModelNotFoundError` when `path` names nothing loadable."""
    from glm53.compile_cache import enable_compilation_cache
    from glm53.hub import resolve_model
    from glm53.tiny_checkpoint import default_model_dir
    from glm53.tokenizer import GlmTokenizer

    enable_compilation_cache()
    path = resolve_model(path) or str(default_model_dir())
    model = load_model(path, dtype=dtype, progress=progress, quantization=quantization)
    layout = build_kv_layout(model.cfg, cache_dtype or jnp.dtype(dtype).name)
    try:
        tok = GlmTokenizer.from_pretrained(path)
    except FileNotFoundError:
        logger.warning("%s has no tokenizer.json: the model loads without a tokenizer (LoadedModel.tokenizer is "
                       "None; pass token ids)", path)
        tok = None
    return LoadedModel(model, layout, tok, path)


def release_compiled() -> None:
    """Unload the compiled programs nothing uses any more: this module's (`forward_step`,
    `generate_batch`, kept per model and shape) and every function's in JAX's in-memory caches.
    Programs still referenced (a live `LLM` or engine) stay loaded; a later call recompiles, or
    reads the persistent compilation cache.

    Why: on XLA:CPU every loaded executable maps its code, read-only data and data into the
    process (an engine's step buckets take ≈ 1,200 memory maps, `/proc/self/maps`), and Linux
    bounds a process's maps (`vm.max_map_count`, 65,530 by default). A process that keeps
    compiling different models and shapes (a notebook, a test suite) runs out, and the next load
    crashes inside XLA's loader with a segmentation fault. Call this between such models.
    """
    _compiled.cache_clear()
    _compiled_generate.cache_clear()
    jax.clear_caches()
    gc.collect()


@functools.lru_cache(maxsize=8)
def _compiled(graphdef, layout: KVCacheLayout):
    @functools.partial(jax.jit, donate_argnums=(2,))
    def step(state, batch: ForwardBatch, kv_arena):
        model = nnx.merge(graphdef, state)
        return model(batch, kv_arena, layout)

    return step


def forward_step(lm: LoadedModel, batch: ForwardBatch, kv_arena: jax.Array):
    """One jitted forward over a prepared batch → (logits, hidden, kv_arena). The arena is donated.

    A model on one device gets the arena on that device (committed), as the arena this returns
    is: jit keys its programs on argument placement too, so a fresh (uncommitted) arena and a
    returned one would otherwise compile the same step twice."""
    graphdef, state = nnx.split(lm.model)
    devices = jax.tree.leaves(state)[0].sharding.device_set
    if len(devices) == 1:
        kv_arena = jax.device_put(kv_arena, next(iter(devices)))
    return _compiled(graphdef, lm.layout)(state, jax.tree.map(jnp.asarray, batch), kv_arena)


def _pages(lm: LoadedModel, num_tokens: int) -> tuple[dict[str, list[int]], int]:
    ids, nxt = {}, 1  # block 0 is the null block
    for g in lm.layout.groups:
        n = max(1, math.ceil(num_tokens / g.tokens_per_page))
        ids[g.name] = list(range(nxt, nxt + n))
        nxt += n
    return ids, nxt


def _is_int(v) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _new_tokens(max_new_tokens) -> int:
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    return int(max_new_tokens)


def _prompt_ids(lm: LoadedModel, token_ids, what: str) -> list[int]:
    """`token_ids` as ints, checked as the engine checks a prompt: non-empty, integers in
    [0, vocab_size) (an id outside would index the embedding out of range, which XLA clamps
    silently). Raises ValueError naming `what`."""
    ids = []
    for t in token_ids:
        if not _is_int(t):
            raise ValueError(f"{what}: token ids must be integers, got {t!r}")
        ids.append(int(t))
    if not ids:
        raise ValueError(f"{what} needs a non-empty prompt")
    vocab = lm.config.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"{what}: prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
    return ids


def forward(lm: LoadedModel, token_ids) -> np.ndarray:
    """Logits `[S, vocab]` float32 of one sequence, prefilled in one step on a fresh cache.
    Raises ValueError for an empty prompt or an id that is not in [0, vocab_size)."""
    token_ids = _prompt_ids(lm, token_ids, "forward")
    pages, nblocks = _pages(lm, len(token_ids))
    arena = lm.layout.empty_arena(nblocks)
    batch = single_sequence_batch(lm.layout, token_ids, 0, pages, logits_all=True)
    logits, _, _ = forward_step(lm, batch, arena)
    return np.asarray(logits)


def _eos_ids(eos_token_ids) -> tuple[int, ...]:
    """An id or a sequence of ids → a tuple of ints (ValueError otherwise)."""
    if _is_int(eos_token_ids):
        return (int(eos_token_ids),)
    try:
        ids = tuple(eos_token_ids)
    except TypeError:
        raise ValueError(f"eos_token_ids must be a token id or a sequence of them, got {eos_token_ids!r}") from None
    if not all(_is_int(t) for t in ids):
        raise ValueError(f"eos_token_ids must be token ids (integers), got {eos_token_ids!r}")
    return tuple(int(t) for t in ids)


def generate(lm: LoadedModel, prompt_ids, max_new_tokens: int = 16, *, eos_token_ids=(),
             return_logits: bool = False):
    """Greedy generation of ONE sequence: one prefill step, then one jitted decode step per token
    driven from Python (paged cache) — simple to step through; for batches and speed use
    `generate_batch` (one compiled program).

    Tokens are the argmax over the tokenizer's ids (a checkpoint's padded vocabulary rows are never
    chosen, as in the engine). Returns the generated ids only, not the prompt (and, if
    `return_logits`, the raw logits `[n, vocab]` each token was chosen from).

    Raises ValueError for a batch of prompts (a list of lists, or a 2-D array: use
    `generate_batch`), an empty prompt, an id outside [0, vocab_size), or `max_new_tokens` < 1."""
    from glm53.tokenizer import tokenizer_vocab_size

    try:
        nested = any(np.ndim(t) != 0 for t in prompt_ids)
    except TypeError:  # not a sequence at all
        nested = True
    if nested:
        raise ValueError("generate takes ONE prompt (a 1-D sequence of token ids); for a batch of prompts use "
                         "glm53.api.generate_batch(lm, [prompt, ...], ...)")
    prompt = _prompt_ids(lm, prompt_ids, "generate")
    max_new_tokens = _new_tokens(max_new_tokens)
    eos_token_ids = _eos_ids(eos_token_ids)
    reachable = min(lm.config.vocab_size, tokenizer_vocab_size(lm.path) or lm.config.vocab_size)
    total = len(prompt) + max_new_tokens
    pages, nblocks = _pages(lm, total)
    arena = lm.layout.empty_arena(nblocks)
    batch = single_sequence_batch(lm.layout, prompt, 0, pages, logits_all=False)
    logits, _, arena = forward_step(lm, batch, arena)
    out, all_logits = [], []
    for _ in range(max_new_tokens):
        row = np.asarray(logits[-1])
        tok = int(np.argmax(row[:reachable]))
        out.append(tok)
        all_logits.append(row)
        if tok in eos_token_ids or len(out) == max_new_tokens:
            break
        batch = single_sequence_batch(lm.layout, [tok], len(prompt) + len(out) - 1, pages, logits_all=True)
        logits, _, arena = forward_step(lm, batch, arena)
    return (out, np.stack(all_logits)) if return_logits else out


@dataclass
class BatchGeneration:
    """The result of `generate_batch` for B prompts.

    token_ids: int32 `[B, P + N]` numpy: each row is its prompt, then its new tokens, then
        `pad_id` (P = the longest prompt, N = max_new_tokens; prompts are NOT left-padded: row b's
        new tokens start at `prompt_lens[b]`).
    prompt_lens / num_new: int32 `[B]`: prompt length and tokens generated (≤ N; fewer when an
        EOS id ended the row, the EOS token included).
    """

    token_ids: np.ndarray
    prompt_lens: np.ndarray
    num_new: np.ndarray
    pad_id: int = 0

    @property
    def new_token_ids(self) -> list[list[int]]:
        """The generated tokens of each row (EOS included when one ended it)."""
        return [list(map(int, row[p:p + n])) for row, p, n in zip(self.token_ids, self.prompt_lens, self.num_new)]

    @property
    def sequences(self) -> list[list[int]]:
        """Prompt followed by its generated tokens, per row."""
        return [list(map(int, row[: p + n])) for row, p, n in zip(self.token_ids, self.prompt_lens, self.num_new)]


@functools.lru_cache(maxsize=16)
def _compiled_generate(graphdef, layout: KVCacheLayout, B: int, P: int, N: int, num_eos: int, reachable: int):
    """One program: prefill of B ragged prompts (padded to P each), then the whole decode loop."""
    from glm53.sampling import mask_unreachable, sample_tokens

    total = P + N
    per_group = {g.name: math.ceil(total / g.tokens_per_page) for g in layout.groups}
    # Request b's pages of group g: a contiguous range after block 0 (the null block); row B of the
    # block tables is all null (padding tokens point at it).
    base, nxt = {}, 1
    for g in layout.groups:
        base[g.name] = nxt
        nxt += B * per_group[g.name]
    num_blocks = nxt
    tables = {g.name: jnp.concatenate([
        base[g.name] + jnp.arange(B, dtype=jnp.int32)[:, None] * per_group[g.name]
        + jnp.arange(per_group[g.name], dtype=jnp.int32)[None, :],
        jnp.zeros((1, per_group[g.name]), jnp.int32)]) for g in layout.groups}

    def slots(req, pos, valid):
        out = {}
        for g in layout.groups:
            tpp = g.tokens_per_page
            page = tables[g.name][req, pos // tpp]
            out[g.name] = jnp.where(valid, page * tpp + pos % tpp, -1).astype(jnp.int32)
        return out

    @jax.jit
    def run(state, prompts_BP, plen_B, temperature_B, top_p_B, top_k_B, min_p_B, seed_B, eos_E, pad_id):
        model = nnx.merge(graphdef, state)
        arena = layout.empty_arena(num_blocks)
        # Prefill: every prompt's P rows (the rows past its length are padding: no write, null row).
        j_P = jnp.arange(P, dtype=jnp.int32)
        valid_BP = j_P[None, :] < plen_B[:, None]
        req_BP = jnp.where(valid_BP, jnp.arange(B, dtype=jnp.int32)[:, None], B)
        pos_BP = jnp.broadcast_to(j_P[None, :], (B, P))
        batch = ForwardBatch(input_ids_T=prompts_BP.reshape(-1), positions_T=jnp.where(valid_BP, pos_BP, 0).reshape(-1),
                             req_idx_T=req_BP.reshape(-1), slot_mapping=slots(req_BP.reshape(-1), pos_BP.reshape(-1),
                                                                              valid_BP.reshape(-1)),
                             block_tables=tables, logits_indices_B=jnp.arange(B, dtype=jnp.int32) * P + plen_B - 1)
        logits, _, arena = model(batch, arena, layout)

        def sample(logits, step):
            return sample_tokens(mask_unreachable(logits, reachable), temperature_B, top_p_B, seed_B,
                                 jnp.full((B,), step, jnp.int32), top_k_B, min_p_B)

        tok = sample(logits, 0)
        is_eos = lambda t: jnp.any(t[:, None] == eos_E[None, :], axis=1) if num_eos else jnp.zeros(B, bool)  # noqa: E731
        out = jnp.full((B, N), pad_id, jnp.int32).at[:, 0].set(tok)
        done = is_eos(tok)
        num_new = jnp.ones(B, jnp.int32)

        def cond(c):
            step, _, _, done, _, _ = c
            return (step < N) & ~jnp.all(done)

        def body(c):
            step, arena, tok, done, out, num_new = c
            pos = plen_B + step - 1  # the position of the token sampled last
            live = ~done
            req = jnp.where(live, jnp.arange(B, dtype=jnp.int32), B)
            b = ForwardBatch(input_ids_T=tok, positions_T=jnp.where(live, pos, 0), req_idx_T=req,
                             slot_mapping=slots(req, pos, live), block_tables=tables,
                             logits_indices_B=jnp.arange(B, dtype=jnp.int32))
            logits, _, arena = model(b, arena, layout)
            new = sample(logits, step)
            out = out.at[:, step].set(jnp.where(live, new, pad_id))
            num_new = num_new + live.astype(jnp.int32)
            done = done | (live & is_eos(new))
            return step + 1, arena, jnp.where(live, new, tok), done, out, num_new

        _, _, _, _, out, num_new = jax.lax.while_loop(cond, body, (jnp.int32(1), arena, tok, done, out, num_new))
        return out, num_new

    return run


def generate_batch(lm: LoadedModel, prompts, max_new_tokens: int = 16, *, temperature: float = 0.0,
                   top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, seed: int = 0, eos_token_ids=(),
                   pad_id: int | None = None) -> BatchGeneration:
    """Generate for a batch of prompts with ONE jit-compiled program: the prefill of every prompt,
    then the whole decode loop (`lax.while_loop`) with on-device sampling and EOS handling — no
    Python per token. For notebooks and batch scripts; the server's engine (`serving.llm.LLM`) adds
    continuous batching, prefix caching and the rest.

    Args:
      prompts: B lists of token ids (ragged; each non-empty).
      max_new_tokens: N, the most tokens generated per prompt (a row stops at an EOS id).
      temperature / top_p / top_k / min_p: temperature 0 = greedy (ties: lowest id); else sampling
        with the engine's rules (`glm53.sampling.sample_tokens`: temperature, then min-p, top-k and
        the top-p nucleus; top_k 0 or -1 and min_p 0 are off), reachable ids only.
      seed: row b draws from `fold_in(PRNGKey(seed + b), step)`.
      eos_token_ids: ids that end a row (kept as its last token); () = none.
      pad_id: fills the rows past their end (default: the tokenizer's pad id, else 0).

    Returns a `BatchGeneration` (`token_ids [B, P + N]`: prompt, then new tokens, then padding;
    `prompt_lens`, `num_new`; `.new_token_ids`, `.sequences`). The program is compiled once per
    (B, longest prompt, N, number of EOS ids) and kept (and stored in the persistent compilation
    cache). Raises ValueError for an empty prompt or batch, an id outside [0, vocab_size), N < 1,
    a negative or non-finite temperature, top_p outside (0, 1], top_k below -1 or min_p outside
    [0, 1].
    """
    from glm53.tokenizer import tokenizer_vocab_size

    if isinstance(prompts, (str, bytes)) or not len(prompts):
        raise ValueError("generate_batch needs at least one prompt (a list of token-id lists)")
    prompts = [_prompt_ids(lm, p, f"generate_batch prompt {b}") for b, p in enumerate(prompts)]
    max_new_tokens = _new_tokens(max_new_tokens)
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if int(top_k) != top_k or top_k < -1:
        raise ValueError(f"top_k must be 0 or -1 (disabled) or at least 1, got {top_k!r}")
    if not 0 <= min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1], got {min_p!r}")
    eos_token_ids = _eos_ids(eos_token_ids)
    B, P, N = len(prompts), max(map(len, prompts)), int(max_new_tokens)
    if pad_id is None:
        pad_id = getattr(lm.tokenizer, "pad_token_id", None) or 0
    reachable = min(lm.config.vocab_size, tokenizer_vocab_size(lm.path) or lm.config.vocab_size)
    eos = tuple(int(t) for t in eos_token_ids)
    graphdef, state = nnx.split(lm.model)
    run = _compiled_generate(graphdef, lm.layout, B, P, N, len(eos), reachable)
    prompts_BP = np.full((B, P), pad_id, np.int32)
    for b, p in enumerate(prompts):
        prompts_BP[b, : len(p)] = p
    plen = np.array([len(p) for p in prompts], np.int32)
    out, num_new = run(state, prompts_BP, plen, np.full(B, temperature, np.float32), np.full(B, top_p, np.float32),
                       np.full(B, min(int(top_k), np.iinfo(np.int32).max), np.int32), np.full(B, min_p, np.float32),
                       (seed + np.arange(B)).astype(np.uint32), np.array(eos or (0,), np.int32), np.int32(pad_id))
    out, num_new = np.asarray(out), np.asarray(num_new)
    ids = np.full((B, P + N), pad_id, np.int32)
    for b in range(B):
        ids[b, : plen[b]] = prompts[b]
        ids[b, plen[b]: plen[b] + N] = out[b]
    return BatchGeneration(ids, plen, num_new, pad_id)
