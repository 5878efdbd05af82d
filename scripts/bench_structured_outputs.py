"""Decode throughput of JSON-schema-constrained requests against unconstrained ones, side by side
in one run on one engine, and the host time the token masks cost per step.

For each batch size (default 1 and 32) three workloads alternate, `--repeats` rounds after one
warm-up round each (the warm-up compiles the masked step variant of each bucket):

* `plain`: unconstrained greedy requests, `ignore_eos`, `--new-tokens` tokens each;
* `json`: the same prompts under a JSON schema (`{"text": string of at least 4,000 characters}`,
  compact whitespace), greedy, `max_tokens` = `--new-tokens`: the grammar cannot end within it,
  so every request decodes exactly as many tokens as `plain`, each step computing a mask per row
  (llguidance over the model's tokenizer) and running the masked step;
* `json+plain`: half of the batch constrained, half not (what a mixed server sees).

All three run with synchronous scheduling (`LLMEngine.set_async_scheduling(False)`), the engine's
setting for the comparison, and once more with asynchronous scheduling (`--async-scheduling`),
where the step after one that sampled for a constrained request is dispatched as its forward pass
while that step runs, and sampled once its tokens are applied and the masks computed
(`ModelRunner.sample_deferred`).
Reported per batch and workload: decode tokens/s (steady phase: every row has its first token),
the ratio to `plain`, mean step time, and mask ms per step (`StructuredOutputManager.
mask_seconds_total` over the masked steps). Every constrained output is checked to be a prefix of
a JSON text the schema admits (it starts `{"text":"` and never leaves the string).

    PYTHONPATH=. .venv/bin/python scripts/bench_structured_outputs.py --out DIR

Options: `--model DIR` (default: the embedded tiny checkpoint), `--batches 1,32`, `--prompt-len 32`,
`--new-tokens 64`, `--repeats 3`. Writes `DIR/bench_structured_outputs.json` and
`DIR/summary.txt`, and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": 4000}}, "required": ["text"],
          "additionalProperties": False}


def run_once(engine, prompts, new_tokens: int, constrained: list[bool], tag: str, async_scheduling: bool) -> dict:
    from serving.structured_outputs import StructuredOutputsParams
    from serving.types import SamplingParams

    engine.set_async_scheduling(async_scheduling)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, p, c in zip(ids, prompts, constrained):
        so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True) if c else None
        engine.add_request(rid, p, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=not c,
                                                  structured_outputs=so))
    tokens = {rid: [] for rid in ids}
    m = engine.structured
    mask0, masked0 = m.mask_seconds_total, m.num_masked_steps
    decode_s = 0.0
    decode_steps = decode_tokens = 0
    while engine.has_unfinished_requests():
        steady = all(tokens[r] for r in ids)
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        for o in outs:
            tokens[o.request_id].extend(o.new_token_ids)
        if steady:
            decode_tokens += sum(len(o.new_token_ids) for o in outs)
            decode_s += dt
            decode_steps += 1
    if engine.audit():
        raise RuntimeError(f"engine audit failed: {engine.audit()[:3]}")
    if any(len(t) != new_tokens for t in tokens.values()):
        raise RuntimeError("a request did not decode --new-tokens tokens")
    masked = m.num_masked_steps - masked0
    return {"decode_tok_s": decode_tokens / decode_s, "step_ms": 1e3 * decode_s / max(decode_steps, 1),
            "mask_ms_per_step": 1e3 * (m.mask_seconds_total - mask0) / masked if masked else 0.0,
            "masked_steps": masked, "tokens": [tokens[r] for r in ids]}


def check_prefix(tok, engine, ids) -> None:
    """A constrained output must be `{"text":"` followed by string characters only."""
    text = tok.decode([t for t in ids if t not in engine.eos_token_ids])
    if not text.startswith('{"text":"'):
        raise RuntimeError(f"constrained output does not follow the schema: {text[:40]!r}")
    body = text[len('{"text":"'):]
    try:  # a string body is a valid JSON string once closed (cut mid-escape: drop the tail)
        json.loads('"' + body + '"')
    except json.JSONDecodeError:
        json.loads('"' + body[: body.rfind("\\")] + '"')


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default=None)
    p.add_argument("--batches", default="1,32")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    import numpy as np

    from glm53.tiny_checkpoint import default_model_dir
    from glm53.tokenizer import GlmTokenizer, tokenizer_vocab_size
    from serving.engine import EngineArgs
    from serving.engine_factory import build_engine

    model = args.model or str(default_model_dir())
    batches = [int(b) for b in args.batches.split(",")]
    B = max(batches)
    engine = build_engine(EngineArgs(model=model, max_model_len=args.prompt_len + args.new_tokens + 64,
                                     max_num_seqs=B, max_num_batched_tokens=max(B * args.prompt_len, 64),
                                     cuda_graph_sizes=sorted(set(batches)), compile_progress=False,
                                     disable_log_stats=True))
    tok = GlmTokenizer.from_pretrained(model)
    vocab = tokenizer_vocab_size(model) or engine.config.vocab_size
    rng = np.random.default_rng(0)
    specials = set(tok.all_special_ids)
    regular = [i for i in range(vocab) if i not in specials]
    rows: list[dict] = []
    results = {"setup": {"model": model, "batches": batches, "prompt_len": args.prompt_len,
                                   "new_tokens": args.new_tokens, "repeats": args.repeats, "schema": SCHEMA,
                                   "machine": platform.platform(), "cpus": os.cpu_count(),
                                   "python": sys.version.split()[0]}, "rows": rows}
    for b in batches:
        prompts = [list(rng.choice(regular, args.prompt_len)) for _ in range(b)]
        prompts = [[int(x) for x in q] for q in prompts]
        workloads = {"plain": [False] * b, "json": [True] * b,
                     "json+plain": [i % 2 == 0 for i in range(b)] if b > 1 else None}
        for async_scheduling in (False, True):
            runs = {w: [] for w, c in workloads.items() if c is not None}
            for r in range(args.repeats + 1):  # round 0: warm-up
                for w in runs:
                    out = run_once(engine, prompts, args.new_tokens, workloads[w], f"b{b}-{w}-{r}-{async_scheduling}",
                                   async_scheduling)
                    for ids, c in zip(out.pop("tokens"), workloads[w]):
                        if c:
                            check_prefix(tok, engine, ids)
                    if r:
                        runs[w].append(out)
            base = statistics.median(x["decode_tok_s"] for x in runs["plain"])
            for w, rs in runs.items():
                med = sorted(rs, key=lambda x: x["decode_tok_s"])[len(rs) // 2]
                rows.append({"batch": b, "workload": w, "async_scheduling": async_scheduling, **med,
                             "ratio_to_plain": med["decode_tok_s"] / base,
                             "all_tok_s": [x["decode_tok_s"] for x in rs]})
    lines = [f"{'batch':>5} {'sched':>5} {'workload':>10} {'tok/s':>9} {'vs plain':>8} {'step ms':>8} {'mask ms':>8}"]
    for r in rows:
        lines.append(f"{r['batch']:>5} {'async' if r['async_scheduling'] else 'sync':>5} {r['workload']:>10} "
                     f"{r['decode_tok_s']:>9.1f} {r['ratio_to_plain']:>7.2f}x {r['step_ms']:>8.2f} "
                     f"{r['mask_ms_per_step']:>8.3f}")
    summary = "\n".join(lines)
    print(summary)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_structured_outputs.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(args.out, "summary.txt"), "w") as f:
        f.write(f"# PYTHONPATH=. python scripts/bench_structured_outputs.py --out DIR  ({platform.platform()}, "
                f"{os.cpu_count()} CPUs; median of {args.repeats} rounds)\n" + summary + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
