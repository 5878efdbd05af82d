"""Accuracy of the trained `tiny-recall` checkpoint in every serving mode, through the real engine.

    PYTHONPATH=. .venv/bin/python scripts/eval_tiny.py --quick --out /tmp/eval   # < 10 min, 2 cores
    PYTHONPATH=. .venv/bin/python scripts/eval_tiny.py --out docs/results/tiny_recall   # every mode

Held-out retrieval samples (glm53/recall_tasks.py, seeds ≥ EVAL_SEED_BASE, never used in
training) at prompt lengths 1, 2, 4, 8 and 16 × index_topk (64 … 1,024 tokens), answered greedily
through `serving.llm.LLM` (the server's engine: scheduler, paged cache, kernels' CPU paths) with
the chat template and `enable_thinking=False`; exact match of the answer text. Modes:

* `dense`: the same weights with `index_topk` raised to 2,048 (≥ every context: attention is
  dense), bf16 cache — the dense-equivalent reference.
* `sparse`: the checkpoint as trained (top-64), bf16 cache. `fp8`: the fp8 cache.
* `hisparse`: Hybrid HiSparse on a device pool far too small for the contexts (`--hisparse-pages`,
  default 14 pages of 64 tokens: 13 usable, where 4 running 16× prompts need 68 whole; prefix caching
  on), bf16 cache; `hot_steps` and the hot-buffer misses are reported.
* `tp2_dcp2`, `pcp2`: parallel layouts on 8 simulated CPU devices (TP2 × DCP2, PCP2), bf16 cache.
* `mtp`: copy samples with MTP speculation k = 1, 2, 3: acceptance length 1 + accepted / drafts
  (engine counters) and copy exact match; the same samples without speculation for reference.

Also the copy and short-answer tasks in the sparse mode. Answers of `hisparse`, `fp8` and the
layouts are compared one by one with `sparse` (the number of samples whose answer text differs).
Writes `summary.json` (everything), `answers.json` (per sample and mode) and `accuracy.png` into
`--out`, and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

PARALLEL_MODES = ("tp2_dcp2", "pcp2")
ALL_MODES = ("dense", "sparse", "fp8", "hisparse", "tp2_dcp2", "pcp2", "mtp")
QUICK_MODES = ("dense", "sparse", "fp8", "hisparse", "mtp")
MULTIPLES = (1, 2, 4, 8, 16)


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-recall", help="checkpoint directory or preset (default tiny-recall)")
    ap.add_argument("--out", required=True, help="directory for summary.json, answers.json, accuracy.png")
    ap.add_argument("--quick", action="store_true", help=f"20 samples per length, modes {', '.join(QUICK_MODES)}")
    ap.add_argument("--samples", type=int, default=None, help="retrieval samples per length (default 100; quick 20)")
    ap.add_argument("--copy-samples", type=int, default=None, help="copy / short samples (default 60; quick 20)")
    ap.add_argument("--modes", default=None, help=f"comma list from {', '.join(ALL_MODES)}")
    ap.add_argument("--hisparse-pages", type=int, default=14,
                    help="device pages of 64 tokens for the hisparse mode (default 14: 13 usable; 4 running 1K-token prompts need 68)")
    return ap.parse_args(argv)


ARGS = _parse(sys.argv[1:]) if __name__ == "__main__" else None
if ARGS is not None and set((ARGS.modes or ",".join(QUICK_MODES if ARGS.quick else ALL_MODES)).split(",")) & set(
        PARALLEL_MODES):
    # Parallel layouts run on simulated CPU devices; the flag must precede JAX's initialisation.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import numpy as np  # noqa: E402

from glm53 import recall_tasks  # noqa: E402
from glm53.hub import resolve_model  # noqa: E402
from glm53.tokenizer import GlmTokenizer  # noqa: E402

MAX_MODEL_LEN = 1152
CHAT = {"enable_thinking": False}


def held_out(tok, cfg_topk: int, per_length: int, n_copy: int) -> dict[str, list]:
    """The evaluation samples: retrieval per length multiple, copy and short (fixed seeds)."""
    out: dict[str, list] = {}
    for m in MULTIPLES:
        rng = np.random.default_rng(recall_tasks.EVAL_SEED_BASE + m)
        out[f"retrieval@{m}x"] = [recall_tasks.retrieval_sample(rng, tok, m * cfg_topk) for _ in range(per_length)]
    rng = np.random.default_rng(recall_tasks.EVAL_SEED_BASE + 100)
    out["copy"] = [recall_tasks.copy_sample(rng, tok) for _ in range(n_copy)]
    rng = np.random.default_rng(recall_tasks.EVAL_SEED_BASE + 200)
    out["short"] = [recall_tasks.short_sample(rng, tok) for _ in range(n_copy)]
    return out


def dense_copy(path: str, topk: int) -> str:
    """A temporary checkpoint directory: `path`'s files linked, config.json with `index_topk`."""
    d = Path(tempfile.mkdtemp(prefix="tiny-recall-dense-"))
    for f in Path(path).iterdir():
        if f.name != "config.json":
            os.symlink(f.resolve(), d / f.name)
    cfg = json.loads((Path(path) / "config.json").read_text())
    cfg["index_topk"] = topk
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def make_llm(path: str, **kw):
    from serving.llm import LLM

    base = dict(dtype="float32", kv_cache_dtype="bfloat16", max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
                max_num_batched_tokens=256, cuda_graph_sizes=[], compile_progress=False,
                disable_log_stats=True, enable_prefix_caching=False)
    base.update(kw)
    return LLM(path, **base)


def answer_all(llm, samples, max_tokens: int) -> list[str]:
    from serving.types import SamplingParams

    outs = llm.chat([s.messages for s in samples], SamplingParams(temperature=0.0, max_tokens=max_tokens),
                    chat_template_kwargs=CHAT)
    return [o.outputs[0].text.strip() for o in outs]


def score(samples, answers) -> float:
    return float(np.mean([a == s.answer for a, s in zip(answers, samples)])) if samples else float("nan")


class StepCounts:
    """A stat logger summing the engine's per-step records (preemptions, HiSparse traffic)."""

    def __init__(self):
        self.steps = self.preemptions = self.hisparse_hits = self.hisparse_misses = self.hisparse_h2d_bytes = 0

    def record(self, rec) -> None:
        if not getattr(rec, "is_step", True):
            return
        self.steps += 1
        self.preemptions += rec.num_preemptions
        self.hisparse_hits += rec.hisparse_hits or 0
        self.hisparse_misses += rec.hisparse_misses or 0
        self.hisparse_h2d_bytes += rec.hisparse_h2d_bytes or 0


def run_mode(mode: str, path: str, data: dict, args) -> dict:
    from sharding.mesh import ParallelConfig

    retrieval = {k: v for k, v in data.items() if k.startswith("retrieval@")}
    kw: dict = {}
    model = path
    if mode == "dense":
        model = dense_copy(path, 2048)
    elif mode == "fp8":
        kw["kv_cache_dtype"] = "fp8"
    elif mode == "hisparse":
        kw.update(max_num_seqs=4, num_gpu_blocks_override=args.hisparse_pages, enable_prefix_caching=True,
                  attention_config={"hisparse_config": {"host_pool_gib": 0.05, "prefill_buffer_size": 128}})
    elif mode == "tp2_dcp2":
        kw["parallel"] = ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2)
    elif mode == "pcp2":
        kw["parallel"] = ParallelConfig(prefill_context_parallel_size=2)
    t0 = time.time()
    llm = make_llm(model, **kw)
    counts = StepCounts()
    llm.engine.stat_loggers.append(counts)
    res: dict = {"mode": mode, "answers": {}}
    for name, samples in retrieval.items():
        res["answers"][name] = answer_all(llm, samples, 8)
    if mode == "sparse":
        for name in ("copy", "short"):
            res["answers"][name] = answer_all(llm, data[name], 64)
    res["engine"] = counts.__dict__
    if mode == "hisparse":
        d = llm.engine.hisparse.device
        res["engine"].update(hot_steps=llm.engine.runner.num_hot_steps, hisparse_hits=d.hits,
                             hisparse_misses=d.misses, hisparse_dropped=d.dropped)
        res["num_gpu_blocks"] = args.hisparse_pages
    res["accuracy"] = {name: score(data[name], ans) for name, ans in res["answers"].items()}
    res["seconds"] = round(time.time() - t0, 1)
    return res


def run_mtp(path: str, data: dict) -> dict:
    samples = data["copy"]
    res: dict = {"mode": "mtp", "k": {}}
    for k in (0, 1, 2, 3):
        t0 = time.time()
        spec = None if k == 0 else {"method": "mtp", "num_speculative_tokens": k}
        llm = make_llm(path, speculative_config=spec)
        answers = answer_all(llm, samples, 64)
        entry = {"copy_accuracy": score(samples, answers), "seconds": round(time.time() - t0, 1)}
        if k:
            st = llm.engine.spec_stats
            entry.update(acceptance_length=1.0 + st.num_accepted_tokens / max(st.num_drafts, 1),
                         drafts=st.num_drafts, accepted=st.num_accepted_tokens,
                         per_position=[a / max(st.num_drafts, 1) for a in st.accepted_per_pos])
        res["k"][str(k)] = entry
        res.setdefault("answers", {})[f"k{k}"] = answers
    return res


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, r in summary["modes"].items():
        if mode == "mtp":
            continue
        xs = [m for m in MULTIPLES if f"retrieval@{m}x" in r["accuracy"]]
        ax.plot(xs, [100 * r["accuracy"][f"retrieval@{m}x"] for m in xs], marker="o", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_xticks(MULTIPLES, [f"{m}×\n{m * summary['index_topk']}" for m in MULTIPLES])
    ax.set_xlabel("prompt length (× index_topk, tokens)")
    ax.set_ylabel("retrieval exact match (%)")
    ax.set_ylim(0, 102)
    ax.grid(alpha=0.3)
    ax.legend()
    mtp = summary["modes"].get("mtp")
    if mtp:
        ks = [k for k in mtp["k"] if k != "0"]
        bx.bar(ks, [mtp["k"][k]["acceptance_length"] for k in ks])
        bx.set_xlabel("num_speculative_tokens k")
        bx.set_ylabel("acceptance length (copy samples)")
        bx.grid(alpha=0.3, axis="y")
    fig.suptitle(f"tiny-recall: {summary['samples_per_length']} samples per length")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(args) -> int:
    import jax

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    modes = (args.modes or ",".join(QUICK_MODES if args.quick else ALL_MODES)).split(",")
    bad = sorted(set(modes) - set(ALL_MODES))
    if bad:
        raise SystemExit(f"error: --modes: unknown {bad}; choose from {', '.join(ALL_MODES)}")
    path = resolve_model(args.model)
    if path is None:
        raise SystemExit("error: --model tiny has random weights; evaluate 'tiny-recall' or a trained checkpoint")
    tok = GlmTokenizer.from_pretrained(path)
    topk = json.loads((Path(path) / "config.json").read_text())["index_topk"]
    per = args.samples or (20 if args.quick else 100)
    n_copy = args.copy_samples or (20 if args.quick else 60)
    data = held_out(tok, topk, per, n_copy)
    t0 = time.time()
    summary: dict = {"model": args.model, "path": path, "index_topk": topk, "samples_per_length": per,
                     "copy_samples": n_copy, "jax": jax.__version__, "devices": len(jax.devices()),
                     "prompt_tokens": {k: float(np.mean([s.prompt_tokens for s in v])) for k, v in data.items()},
                     "modes": {}}
    answers: dict = {"expected": {k: [s.answer for s in v] for k, v in data.items()}}
    for mode in modes:
        print(f"[eval] {mode} …", flush=True)
        r = run_mtp(path, data) if mode == "mtp" else run_mode(mode, path, data, args)
        answers[mode] = r.pop("answers")
        summary["modes"][mode] = r
        print(f"[eval] {mode}: {json.dumps({k: v for k, v in r.items() if k != 'mode'})}", flush=True)
    base = answers.get("sparse")
    if base:
        for mode in ("fp8", "hisparse", *PARALLEL_MODES, "dense"):
            if mode in answers:
                diff = {k: int(sum(a != b for a, b in zip(answers[mode][k], base[k]))) for k in answers[mode] if k in base}
                summary["modes"][mode]["answers_differing_from_sparse"] = diff
    summary["seconds"] = round(time.time() - t0, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "answers.json").write_text(json.dumps(answers, indent=1) + "\n")
    plot(summary, out / "accuracy.png")
    print_table(summary)
    print(f"wrote {out}/summary.json, answers.json, accuracy.png in {summary['seconds'] / 60:.1f} min")
    return 0


def print_table(summary: dict) -> None:
    cols = [f"retrieval@{m}x" for m in MULTIPLES]
    print(f"{'mode':10s} " + " ".join(f"{c.split('@')[1] + ' (' + str(int(summary['prompt_tokens'][c])) + ')':>11s}"
                                       for c in cols) + "   differing from sparse")
    for mode, r in summary["modes"].items():
        if mode == "mtp":
            continue
        accs = " ".join(f"{100 * r['accuracy'].get(c, float('nan')):10.1f}%" for c in cols)
        diff = r.get("answers_differing_from_sparse")
        print(f"{mode:10s} {accs}   {'' if diff is None else sum(diff.values())}")
    sp = summary["modes"].get("sparse", {}).get("accuracy", {})
    if "copy" in sp:
        print(f"sparse: copy {100 * sp['copy']:.1f}%, short answers {100 * sp['short']:.1f}%")
    mtp = summary["modes"].get("mtp")
    if mtp:
        for k, e in mtp["k"].items():
            extra = f", acceptance length {e['acceptance_length']:.2f}" if k != "0" else ""
            print(f"mtp k={k}: copy {100 * e['copy_accuracy']:.1f}%{extra}")


if __name__ == "__main__":
    raise SystemExit(main(ARGS))
