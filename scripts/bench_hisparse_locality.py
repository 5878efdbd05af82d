"""Hot-buffer locality of Hybrid HiSparse on trained weights: a sweep of `device_buffer_size`.

    PYTHONPATH=. .venv/bin/python scripts/bench_hisparse_locality.py --out docs/results/hisparse_locality
    PYTHONPATH=. .venv/bin/python scripts/bench_hisparse_locality.py --quick --out /tmp/loc   # ~3 min

The workload is scaled to the trained `tiny-recall` checkpoint's 1K-token training contexts: held-out
retrieval prompts of 16 × index_topk context tokens (≈ 1,000 prompt tokens with the chat template;
`glm53/recall_tasks.py`, evaluation seeds), each answered greedily and then kept decoding to
`--max-tokens` tokens (`ignore_eos`), so every request decodes over its whole context. They are
served `--concurrency` at a time by the real engine (`serving.llm.LLM`) on a device pool far too
small for them (`--pages` pages of 64 tokens), so most of every context lives in the HiSparse host
pool and is read through the per-request hot buffer. The sweep sets the decode hot buffer to 1, 2
and 4 × index_topk rows (`hisparse_config.device_buffer_size`; `prefill_buffer_size` is the larger
of 128 and it) for:

* `tiny-recall` — the trained checkpoint (its indexer trained by KL to the dense attention);
* `random` — the same architecture and prompts with random weights (`glm53.tiny_checkpoint.tiny_weights`,
  seed 0): the indexer's selections have no trained structure.

Counted over decode-only steps (every scheduled row a decode row past its prompt), from the engine's
per-step records: hot hits and misses (distinct host rows a request's decode row selected that were
in its hot buffer / copied from the host pool; selections on resident pages are read in place and
are neither; each IndexShare group's full layer resolves its own top-k, so a row makes one lookup
per group), the hit rate hits / (hits + misses), misses per decode row and index group (out of
index_topk), host → device bytes per decoded token (the copy's bytes as the engine counts them:
missed rows × layers × row bytes), and the share of a row's selections served from host memory
((hits + misses) / selections, selections = index groups × min(index_topk, context) per row), and
missed rows per host read (the memory-kind copy reads a run of adjacent host rows with one slice
per 64 / 16 / 4 / 1-row piece: `kernels.host_rows.host_reads`). Prefill steps are reported apart (their lookups include the
chunk's own pages). The answers are compared with the same model's run with an ample pool (no
HiSparse pressure) under the project's equality rule (glm53/equality.py): streams equal, first
divergences accepted as near-ties of the ample run, and unexplained ones (a bug).

Writes `summary.json` and `locality.csv` into `--out` and prints the table.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for summary.json and locality.csv")
    ap.add_argument("--quick", action="store_true", help="4 prompts, 32 new tokens, tiny-recall only")
    ap.add_argument("--models", default="tiny-recall,random", help="comma list of tiny-recall, random")
    ap.add_argument("--multiples", default="1,2,4", help="device_buffer_size as multiples of index_topk")
    ap.add_argument("--prompts", type=int, default=8, help="retrieval prompts (default 8)")
    ap.add_argument("--max-tokens", type=int, default=96, help="tokens decoded per request (default 96)")
    ap.add_argument("--concurrency", type=int, default=4, help="--max-num-seqs (default 4)")
    ap.add_argument("--pages", type=int, default=32,
                    help="device pool pages of 64 tokens (default 32; 4 running 1K-token requests need 68)")
    args = ap.parse_args(argv)
    if args.quick:
        args.models, args.prompts, args.max_tokens = "tiny-recall", 4, 32
    return args


MAX_MODEL_LEN = 1152
CONTEXT_MULTIPLE = 16


def random_copy(path: str) -> str:
    """A temporary checkpoint: `path`'s config and tokenizer, random weights of its shapes (seed 0)."""
    from safetensors.numpy import save_file

    from glm53.config import GlmConfig
    from glm53.tiny_checkpoint import tiny_weights

    d = Path(tempfile.mkdtemp(prefix="tiny-recall-random-"))
    for f in Path(path).iterdir():
        if f.name != "model.safetensors":
            os.symlink(f.resolve(), d / f.name)
    save_file(tiny_weights(GlmConfig.from_pretrained(path), seed=0), str(d / "model.safetensors"),
              metadata={"format": "pt"})
    return str(d)


class DecodeLocality:
    """Wraps the engine's runner and stat loggers: per step, whether every row decodes, the rows'
    top-k selections, and the step's HiSparse counters (synchronous engine: one record per
    `execute`)."""

    def __init__(self, engine, index_topk: int, index_groups: int):
        self.topk, self.groups = index_topk, index_groups
        self.pending: list[tuple[bool, int, int]] = []
        self.decode = dict(steps=0, rows=0, selections=0, hits=0, misses=0, h2d_bytes=0, host_reads=0)
        self.prefill = dict(steps=0, rows=0, hits=0, misses=0, h2d_bytes=0, host_reads=0)
        self.device = engine.hisparse.device
        self.reads_seen = 0
        runner = engine.runner
        inner = runner.execute

        def execute(sched, kv):
            rows = sched.scheduled
            is_decode = bool(rows) and all(sr.num_new_tokens == 1 and sr.start_pos >= sr.request.num_prompt_tokens
                                           for sr in rows)
            sel = self.groups * sum(min(self.topk, sr.start_pos + 1) for sr in rows)
            self.pending.append((is_decode, sum(sr.num_new_tokens for sr in rows), sel))
            return inner(sched, kv)

        runner.execute = execute
        engine.stat_loggers.append(self)

    def record(self, rec) -> None:
        if not getattr(rec, "is_step", True) or not self.pending:
            return
        is_decode, rows, sel = self.pending.pop(0)
        d = self.decode if is_decode else self.prefill
        d["steps"] += 1
        d["rows"] += rows
        if is_decode:
            d["selections"] += sel
        d["hits"] += rec.hisparse_hits or 0
        d["misses"] += rec.hisparse_misses or 0
        d["h2d_bytes"] += rec.hisparse_h2d_bytes or 0
        d["host_reads"] += self.device.host_reads - self.reads_seen  # host slices (memory_kind) or callbacks
        self.reads_seen = self.device.host_reads


def make_llm(path: str, **kw):
    from serving.llm import LLM

    base = dict(dtype="float32", kv_cache_dtype="bfloat16", max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=256,
                cuda_graph_sizes=[], compile_progress=False, disable_log_stats=True, enable_prefix_caching=False)
    base.update(kw)
    return LLM(path, **base)


def serve(llm, samples, max_tokens: int, logprobs: int | None = None):
    """Greedy answers of `samples`: → (token ids per sample, the top-`logprobs` logprobs per token
    or None, the prompt token ids per sample)."""
    from serving.types import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    outs = llm.chat([s.messages for s in samples], params, chat_template_kwargs={"enable_thinking": False})
    return ([list(o.outputs[0].token_ids) for o in outs], [o.outputs[0].logprobs for o in outs],
            [list(o.prompt_token_ids) for o in outs])


def compare(reference, ref_logprobs, prompts, got, lm) -> dict:
    """Streams against the ample run under the equality rule (glm53/equality.py: a first
    divergence is accepted where the reference's top-2 logprob gap, or the indexer's score gap at
    its top-k boundary over the context so far (`lm`, the model loaded by `glm53.api.load`), is
    below its epsilon)."""
    from glm53.equality import compare_streams

    keys = range(len(reference))
    divs = compare_streams(dict(zip(keys, reference)), dict(zip(keys, got)), dict(zip(keys, ref_logprobs)),
                           dict(zip(keys, prompts)), lm, strict=False, verbose=True)
    return dict(streams=len(reference), streams_equal=len(reference) - len(divs),
                divergences_accepted=sum(d.accepted_by is not None for d in divs),
                divergences_unexplained=sum(d.accepted_by is None for d in divs))


def run_model(name: str, path: str, samples, args) -> list[dict]:
    import jax

    from glm53.config import GlmConfig

    cfg = GlmConfig.from_pretrained(path)
    topk, groups = cfg.index_topk, len(cfg.full_layers)
    t0 = time.time()
    ample = make_llm(path, max_num_seqs=args.concurrency)
    reference, ref_logprobs, prompts = serve(ample, samples, args.max_tokens, logprobs=2)
    from glm53 import api

    lm = api.load(path, cache_dtype="bfloat16")
    print(f"{name}: ample pool served in {time.time() - t0:.1f} s", flush=True)
    del ample
    jax.clear_caches()
    rows = []
    for m in [int(x) for x in args.multiples.split(",")]:
        rows_hot = m * topk
        hs = {"host_pool_gib": 0.05, "device_buffer_size": rows_hot, "prefill_buffer_size": max(128, rows_hot)}
        t0 = time.time()
        llm = make_llm(path, max_num_seqs=args.concurrency, num_gpu_blocks_override=args.pages,
                       attention_config={"hisparse_config": hs})
        probe = DecodeLocality(llm.engine, topk, groups)
        got, _, _ = serve(llm, samples, args.max_tokens)
        eng = llm.engine
        d, p = probe.decode, probe.prefill
        lookups = d["hits"] + d["misses"]
        row = dict(model=name, device_buffer_size=rows_hot, multiple=m, pages=args.pages,
                   index_groups=groups, decode_steps=d["steps"], decode_rows=d["rows"],
                   all_rows=d["rows"] + p["rows"],
                   hit_rate=round(d["hits"] / lookups, 4) if lookups else None,
                   miss_rate=round(d["misses"] / lookups, 4) if lookups else None,
                   misses_per_decode_row=round(d["misses"] / d["rows"] / groups, 2) if d["rows"] else None,
                   h2d_bytes_per_decoded_token=round(d["h2d_bytes"] / d["rows"]) if d["rows"] else None,
                   host_share_of_selections=round(lookups / d["selections"], 4) if d["selections"] else None,
                   misses_per_host_read=round(d["misses"] / d["host_reads"], 2) if d["host_reads"] else None,
                   prefill_misses_per_host_read=round(p["misses"] / p["host_reads"], 2) if p["host_reads"] else None,
                   decode=d, prefill=p,
                   prefill_hit_rate=round(p["hits"] / (p["hits"] + p["misses"]), 4) if p["hits"] + p["misses"] else None,
                   preemptions=eng.scheduler.num_preemptions_total,
                   dropped_outside_truncation=eng.hisparse.device.drops_outside_truncation,
                   **compare(reference, ref_logprobs, prompts, got, lm),
                   mean_prompt_tokens=round(float(np.mean([len(p) for p in prompts])), 1),
                   seconds=round(time.time() - t0, 1))
        rows.append(row)
        print(f"{name} x{m}: hit rate {row['hit_rate']}, misses/row {row['misses_per_decode_row']}, "
              f"{row['h2d_bytes_per_decoded_token']} B/token, streams equal {row['streams_equal']}/{row['streams']} "
              f"(+{row['divergences_accepted']} accepted divergences, {row['divergences_unexplained']} unexplained) "
              f"({row['seconds']} s)", flush=True)
        del llm, eng, probe
        jax.clear_caches()
    return rows


def main(args) -> int:
    from glm53 import recall_tasks
    from glm53.hub import resolve_model
    from glm53.tokenizer import GlmTokenizer

    trained = resolve_model("tiny-recall")
    tok = GlmTokenizer.from_pretrained(trained)
    from glm53.config import GlmConfig

    topk = GlmConfig.from_pretrained(trained).index_topk
    rng = np.random.default_rng(recall_tasks.EVAL_SEED_BASE + CONTEXT_MULTIPLE)
    samples = [recall_tasks.retrieval_sample(rng, tok, CONTEXT_MULTIPLE * topk) for _ in range(args.prompts)]
    t0 = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in args.models.split(","):
        if name not in ("tiny-recall", "random"):
            raise SystemExit(f"--models: unknown model {name!r} (tiny-recall, random)")
        path = trained if name == "tiny-recall" else random_copy(trained)
        results += run_model(name, path, samples, args)
    import jax

    summary = dict(command="PYTHONPATH=. .venv/bin/python scripts/bench_hisparse_locality.py " + " ".join(sys.argv[1:]),
                   jax=jax.__version__, devices=len(jax.devices()), index_topk=topk, prompts=args.prompts,
                   mean_prompt_tokens=results[0]["mean_prompt_tokens"] if results else None, max_tokens=args.max_tokens, concurrency=args.concurrency,
                   pages=args.pages, results=results, seconds=round(time.time() - t0, 1))
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    cols = ["model", "multiple", "device_buffer_size", "decode_steps", "decode_rows", "hit_rate", "miss_rate", "misses_per_decode_row",
            "h2d_bytes_per_decoded_token", "host_share_of_selections", "misses_per_host_read",
            "prefill_misses_per_host_read", "prefill_hit_rate", "preemptions",
            "streams_equal", "divergences_accepted", "divergences_unexplained", "streams", "seconds"]
    with open(out / "locality.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(results)
    print()
    print(" | ".join(cols))
    for r in results:
        print(" | ".join(str(r[c]) for c in cols))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(_parse(sys.argv[1:])))
