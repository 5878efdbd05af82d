"""Train the `tiny-recall` checkpoint: a GLM-5.3-structured model that must find far-away tokens.

    PYTHONPATH=. .venv/bin/python scripts/train_tiny.py --out /tmp/tiny-recall   # ≈ 25 min, 2 cores
    PYTHONPATH=. .venv/bin/python scripts/train_tiny.py --out /tmp/t --quick     # a 2-minute smoke run

Needs the `train` extra (`pip install -e .[train]`: optax). The model is the `tiny-recall` preset
(glm53/config.py: 1 dense + 5 MoE layers, three IndexShare groups, an MTP layer, kv_lora_rank 128,
index_topk 64) with the tiny tokenizer; the data are generated (glm53/recall_tasks.py): retrieval of
one-letter keys' values from contexts of up to 16 × index_topk tokens, span copying and short
answers, as multi-turn GLM chat sequences with the loss on answer tokens only.

Recipe (DeepSeek-V3.2 DSA, adapted to a model trained from scratch; glm53/training.py has the maths):
1. Dense phase: dense causal attention; the language-model loss trains the model, the indexers
   learn the attention distribution through the KL loss on detached inputs (they never change the
   model's forward in this phase).
2. Sparse phase: attention restricted to each query's indexer top-k (IndexShare: shared layers use
   their group's selection); the model adapts to it, the indexers keep training on the KL over the
   selected set.
The MTP layer trains throughout on token i + 2 from the backbone's (detached) final hidden state
(DeepSeek-V3 MTP), loss weight `--mtp-weight`.

Writes into `--out`: the HF checkpoint (config.json, model.safetensors in bf16, tokenizer.json,
tokenizer_config.json, chat_template.jinja, generation_config.json) and `train_log.json` (the
schedule, losses and answer-token accuracies every `--log-every` steps, wall time).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

try:
    import optax
except ImportError:  # pragma: no cover - message for a missing extra
    sys.exit("scripts/train_tiny.py needs optax: pip install -e '.[train]'")

from tqdm import tqdm

from glm53 import recall_tasks
from glm53.config import TINY_RECALL_HF_CONFIG, GlmConfig
from glm53.export import save_hf_checkpoint
from glm53.loader import _param_table
from glm53.model import GlmForCausalLM
from glm53.tiny_checkpoint import (CHAT_TEMPLATE_PATH, generation_config, tokenizer_config, build_tiny_tokenizer,
                                   padded_vocab_size, EOS_TOKENS, PAD_TOKEN)
from glm53.tokenizer import GlmTokenizer
from glm53.training import train_forward

# (phase, sequence length, sequences per step, steps): tokens per step stay ≈ 4-8K.
SCHEDULE = (
    ("dense", 128, 32, 450),
    ("dense", 256, 16, 300),
    ("dense", 1024, 4, 80),
    ("sparse", 1024, 4, 120),
    ("sparse", 512, 8, 100),
)
QUICK_SCHEDULE = (("dense", 128, 4, 20), ("sparse", 256, 2, 10))
# Task shares: the first (short-sequence) phase leans on copying, whose every answer token is an
# induction target — the mechanism retrieval needs too — then retrieval dominates.
EARLY_MIX = (("retrieval", 0.45), ("copy", 0.45), ("short", 0.1))
TASK_MIX = (("retrieval", 0.65), ("copy", 0.25), ("short", 0.1))


def recall_config(tok) -> GlmConfig:
    """The `tiny-recall` config with vocab / eos / pad from the tiny tokenizer."""
    raw = dict(TINY_RECALL_HF_CONFIG)
    raw.update(vocab_size=padded_vocab_size(tok.get_vocab_size(with_added_tokens=True)),
               eos_token_id=[tok.token_to_id(t) for t in EOS_TOKENS], pad_token_id=tok.token_to_id(PAD_TOKEN))
    return GlmConfig.from_hf_config(raw)


def init_params(model: GlmForCausalLM, seed: int) -> None:
    """Random init in place: linear / expert / absorbed-MLA weights N(0, 1/fan_in) (output
    projections further × (2 · layers)^-1/2, GPT-2 style), embeddings N(0, 1), norm scales 1,
    biases 0 (the router's correction bias stays 0: no load-balancing updates)."""
    rng = np.random.default_rng(seed)
    n_layers = model.cfg.num_hidden_layers + model.cfg.num_mtp_layers
    for path, node in sorted(_param_table(model).items()):
        shape = node.shape
        if path.endswith("norm.weight") or "layernorm" in path and path.endswith("weight"):
            v = np.ones(shape)
        elif path.endswith("bias"):
            v = np.zeros(shape)
        elif path == "embed_tokens.weight":
            v = rng.standard_normal(shape)
        elif path.endswith("w_uk") or path.endswith("w_uv") or "experts.gate_proj" in path or "experts.up_proj" in path \
                or "experts.down_proj" in path or path.endswith("weight"):
            fan_in = shape[-1] if path.endswith("w_uk") else shape[-2]
            v = rng.standard_normal(shape) / math.sqrt(fan_in)
            if path.endswith(("o_proj.weight", "down_proj.weight", "down_proj")):
                v /= math.sqrt(2 * n_layers)
        else:
            raise ValueError(f"init_params: no rule for {path}")
        node.set_value(jnp.asarray(v, node.dtype))


def make_batch(rng: np.random.Generator, tok, length: int, batch: int, mix=TASK_MIX):
    kinds = [k for k, _ in mix]
    probs = np.array([p for _, p in mix])
    rows = [recall_tasks.training_example(rng, tok, length, kinds[rng.choice(len(kinds), p=probs)])
            for _ in range(batch)]
    return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])


def turn_exact_match(pred_BT: np.ndarray, ids_BT: np.ndarray, mask_BT: np.ndarray) -> tuple[int, int]:
    """Teacher-forced exact match per answer: (answers whose every token — the closing
    `<|user|>` included — is the argmax prediction, answers)."""
    good = total = 0
    for pred, ids, mask in zip(pred_BT, ids_BT, mask_BT):
        t = 1
        while t < len(ids):
            if mask[t]:
                a = t
                while t < len(ids) and mask[t]:
                    t += 1
                total += 1
                good += bool(np.all(pred[a - 1:t - 1] == ids[a:t]))
            t += 1
    return good, total


def held_out_batches(tok) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Fixed probe batches (seeds ≥ EVAL_SEED_BASE, never trained on)."""
    out = {}
    for name, kind, length, n in (("retrieval@256", "retrieval", 256, 8), ("retrieval@1024", "retrieval", 1024, 4),
                                  ("copy@256", "copy", 256, 4)):
        rng = np.random.default_rng(recall_tasks.EVAL_SEED_BASE + 7 + length)
        rows = [recall_tasks.training_example(rng, tok, length, kind) for _ in range(n)]
        out[name] = (np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows]))
    return out


def losses(model, ids, mask, sparse: bool, mtp_weight: float, kl_weight: float, prompt_weight: float, pad_id: int):
    out = train_forward(model, ids, sparse=sparse, mtp=True)

    def ce(logits, targets, weights):
        logp = jax.nn.log_softmax(logits, -1)
        nll = -jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]
        n = jnp.maximum(weights.sum(), 1.0)
        correct = (jnp.argmax(logits, -1) == targets) * weights
        return (nll * weights).sum() / n, correct.sum() / n

    lm, acc = ce(out.logits_BTV[:, :-1], ids[:, 1:], mask[:, 1:])
    # A light next-token loss on the prompts too (pad excluded): general features such as "which
    # token came before" form faster than from the answers alone.
    real = (ids[:, 1:] != pad_id).astype(jnp.float32) * (1 - mask[:, 1:])
    prompt, _ = ce(out.logits_BTV[:, :-1], ids[:, 1:], real)
    mtp, mtp_acc = ce(out.mtp_logits_BTV[:, :-2], ids[:, 2:], mask[:, 2:])
    total = lm + prompt_weight * prompt + mtp_weight * mtp + kl_weight * out.indexer_kl
    return total, dict(lm=lm, acc=acc, prompt=prompt, mtp=mtp, mtp_acc=mtp_acc, kl=out.indexer_kl,
                       topk_mass=out.topk_mass)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="checkpoint directory to write")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=4e-3)
    ap.add_argument("--mtp-weight", type=float, default=0.5)
    ap.add_argument("--kl-weight", type=float, default=1.0)
    ap.add_argument("--prompt-weight", type=float, default=0.1, help="weight of the next-token loss on prompt tokens")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--probe-every", type=int, default=100,
                    help="steps between teacher-forced exact-match probes on held-out batches (0: never)")
    ap.add_argument("--quick", action="store_true", help="a short smoke schedule (minutes), not a usable model")
    args = ap.parse_args(argv)

    schedule = QUICK_SCHEDULE if args.quick else SCHEDULE
    tok_raw = build_tiny_tokenizer()
    cfg = recall_config(tok_raw)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # Tokenizer files first: the data generator uses the checkpoint's own GlmTokenizer.
    raw_cfg = cfg.to_hf_config()
    (out / "tokenizer.json").write_text(tok_raw.to_str(pretty=True), encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(tok_raw, raw_cfg), indent=2,
                                                          sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(json.dumps(generation_config(raw_cfg), indent=2,
                                                           sort_keys=True) + "\n")
    shutil.copyfile(CHAT_TEMPLATE_PATH, out / "chat_template.jinja")
    tok = GlmTokenizer.from_pretrained(out)

    model = GlmForCausalLM(cfg, dtype=jnp.float32)
    init_params(model, args.seed)
    graphdef, params = nnx.split(model, nnx.Param)
    total_steps = sum(s[3] for s in schedule)
    lr = optax.warmup_cosine_decay_schedule(0.0, args.lr, min(100, total_steps // 10), total_steps, args.lr * 0.05)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr, b1=0.9, b2=0.98, weight_decay=0.01))
    opt_state = opt.init(params)

    def make_step(sparse: bool):
        @jax.jit
        def step(params, opt_state, ids, mask):
            def loss_fn(p):
                return losses(nnx.merge(graphdef, p), ids, mask, sparse, args.mtp_weight, args.kl_weight,
                              args.prompt_weight, tok.pad_token_id)

            (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss, metrics
        return step

    steps = {True: make_step(True), False: make_step(False)}

    @functools.partial(jax.jit, static_argnums=2)
    def predict(params, ids, sparse):
        out = train_forward(nnx.merge(graphdef, params), ids, sparse=sparse, mtp=False)
        return jnp.argmax(out.logits_BTV, -1)

    probes = held_out_batches(tok)

    def probe(params, sparse: bool) -> dict:
        res = {}
        for name, (ids, mask) in probes.items():
            pred = np.asarray(predict(params, ids, sparse))
            good, total = turn_exact_match(pred, ids, mask)
            res[name] = round(good / max(total, 1), 3)
        return res

    rng = np.random.default_rng(args.seed)
    log: list[dict] = []
    t0 = time.time()
    step_no = 0
    with tqdm(total=total_steps, unit="step", desc="training") as bar:
        for phase_no, (phase, length, batch, n) in enumerate(schedule):
            mix = EARLY_MIX if phase_no == 0 else TASK_MIX
            acc_window: list[dict] = []
            for _ in range(n):
                ids, mask = make_batch(rng, tok, length, batch, mix)
                params, opt_state, loss, metrics = steps[phase == "sparse"](params, opt_state, ids, mask)
                step_no += 1
                acc_window.append({k: float(v) for k, v in metrics.items()})
                if step_no % args.log_every == 0 or _ == n - 1:
                    mean = {k: float(np.mean([m[k] for m in acc_window])) for k in acc_window[0]}
                    entry = dict(step=step_no, phase=phase, length=length, batch=batch,
                                 seconds=round(time.time() - t0, 1), **{k: round(v, 4) for k, v in mean.items()})
                    if args.probe_every and (step_no % args.probe_every == 0 or step_no == total_steps):
                        entry["probe_exact_match"] = probe(params, phase == "sparse")
                    log.append(entry)
                    bar.set_postfix(phase=phase, T=length, lm=f"{mean['lm']:.3f}", acc=f"{mean['acc']:.3f}",
                                    mtp_acc=f"{mean['mtp_acc']:.3f}", kl=f"{mean['kl']:.3f}",
                                    mass=f"{mean['topk_mass']:.3f}")
                    tqdm.write(json.dumps(entry), file=sys.stderr)
                    acc_window = []
                bar.update(1)
    wall = time.time() - t0
    nnx.update(model, params)
    save_hf_checkpoint(model, out, metadata={"trained_by": "scripts/train_tiny.py"})
    (out / "train_log.json").write_text(json.dumps(dict(
        schedule=[dict(phase=p, length=t, batch=b, steps=s) for p, t, b, s in schedule], seed=args.seed, lr=args.lr,
        task_mix=dict(first_phase=dict(EARLY_MIX), later=dict(TASK_MIX)),
        mtp_weight=args.mtp_weight, kl_weight=args.kl_weight, prompt_weight=args.prompt_weight, wall_seconds=round(wall, 1),
        jax=jax.__version__, devices=str(jax.devices()), cpu_count=os.cpu_count(), log=log), indent=1) + "\n")
    print(f"wrote {out} in {wall / 60:.1f} min")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
