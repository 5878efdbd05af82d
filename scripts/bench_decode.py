"""Decode throughput of our engine vs HF transformers' `generate`, side by side in one run.

For each batch size (default 1, 8, 32) the same workload runs through both:

* ours: `serving.engine.LLMEngine` (the server's engine: scheduler, paged KV arena, one jitted
  step per token bucket, sampling on device), greedy, `ignore_eos`, fixed `max_tokens`;
* HF: `GlmMoeDsaForCausalLM.from_pretrained(checkpoint)` + `generate` (greedy, EOS disabled,
  `max_new_tokens` = the same count, prompts padded on the left with the checkpoint's pad token
  and an attention mask), in fp32 on CPU.

Both sides get the same prompts (random token ids of the regular vocabulary, fixed seed; or, with
`--prompt-kind copy`, the tails of "Repeat: …" conversations, on which the trained `tiny-recall`
checkpoint's MTP drafts are accepted) and
generate the same number of new tokens. The checkpoint's padded vocabulary rows (ids past the
tokenizer's) are never chosen by ours (`glm53.sampling.mask_unreachable`); HF gets them as
`suppress_tokens`, so both choose among the same ids. Only the steady decode phase is compared: for ours the
steps after every request of the batch has its first token (each of them schedules exactly one
token per request), for HF the forward passes after the first one (a logits processor stamps
the time of every generation step). Prefill time is reported separately. The HF model lives in a
worker process for the whole run and the two sides alternate, one run each per round
(`--repeats` rounds per batch after one warm-up each), so both see the same background load;
the median run of each side is reported, with every round's ratio.

Reported per batch: decode tokens/s of both and their ratio (ours/HF; the figure of merit),
ours' mean step wall time, device time (`ModelRunner.last.device_s`: dispatch of the jitted step
until its sampled tokens are on the host) and host overhead (`LLMEngine.host_overhead_s`: step
wall time minus device time: scheduling, input preparation, output processing) and the host
share of the step time.

A sanity line per batch compares the greedy tokens. The reference is one extra, untimed HF run
with the indexer's top-k tie order pinned to ours (higher score, then lower position;
`scripts/hf_tie_rule.py`): every row must equal ours in all tokens, or differ first at a token
where HF's top-2 logit gap is below 1e-4 (docs/design.md §10's near-tie rule); `parity.ok` in the JSON.
HF as shipped is compared too (`greedy_match`), for information only: its `torch.topk` keeps an
arbitrary subset of exactly tied index scores (exact zeros of the ReLU-weighted sum, common with
random weights), which differs between a full forward and a cached decode step, so on the tiny
checkpoint its rows leave ours (and HF's own full forward) soon after the context passes
index_topk (64).

HF setup. torch for Python 3.12 on PyPI is the CUDA build (it pulls several GB of CUDA
libraries), so the HF half runs in a subprocess under another interpreter that has
`torch` (a CPU build) and `transformers>=5.23` (which has `glm_moe_dsa`); this file is its entry
point too (`--hf-worker`; the file imports only the standard library at module level). For example:

    python3.11 -m venv /tmp/v311
    /tmp/v311/bin/pip install torch 'transformers>=5.23' safetensors numpy
    PYTHONPATH=. python scripts/bench_decode.py --out runs/bench --hf-python /tmp/v311/bin/python

`--hf-python` defaults to `$HF_PYTHON`, else the current interpreter when it can import torch
and transformers. Other options: `--model DIR` (default: the embedded tiny checkpoint),
`--batches 1,8,32`, `--prompt-len 32`, `--new-tokens 64`, `--repeats 3`, `--max-model-len 512`
(the engine's context limit, which sets its block-table width),
`--num-gpu-blocks-override N`, `--check-tokens 4`, `--hf-threads 0`, `--skip-hf`, `--skip-jit`,
`--data-parallel-size N` (DP + EP over N devices, simulated on CPU; `generate_batch` and HF stay on
one device, so pass `--skip-jit --skip-hf` to compare synchronous and asynchronous DP only),
`--engine-args JSON` (more `EngineArgs` fields: e.g. Hybrid HiSparse on a pool too small for the
batch, `docs/results/bench_decode/hisparse/`, or MTP speculation with `--model
glm53/checkpoints/tiny-recall`, `docs/results/bench_decode/mtp_async/`: a step then has 1 + the
drafts it verifies rows per request, and every step after the batch's first tokens counts as
decode). Writes
`DIR/bench_decode.json` and prints a table.

`--hf-threads` defaults to 0 (torch's default, one OpenMP thread per core): HF's fastest setting
on an idle machine (2 cores, tiny model: 135 / 594 / 1,227 tok/s at batch 1 / 8 / 32 against 118 /
560 / 929 with one thread). On a loaded machine the OpenMP workers wait on each other and each HF
decode step became 10-40x slower (0.3-0.75 s instead of 16-35 ms at batch 1), which would flatter
our ratio: pass `--hf-threads 1` there. Give HF whichever is faster on the machine at hand.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NEAR_TIE_EPS = 1e-4  # fp32 top-2 logit gap below which a greedy divergence is acceptable (docs/design.md §10)


# ----------------------------------------------------------------------------------- workload
def make_prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    """`batch` prompts of `prompt_len` token ids drawn uniformly from [0, vocab) (deterministic)."""
    import random

    rng = random.Random(seed * 1_000_003 + batch)
    return [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(batch)]


def make_copy_prompts(batch: int, prompt_len: int, model_dir: str, seed: int) -> list[list[int]]:
    """`batch` prompts of exactly `prompt_len` tokens: the last `prompt_len` tokens of chat-templated
    conversations of "Repeat: …" turns, each answered by its span but the last (the `copy` task of
    glm53/recall_tasks.py, which the `tiny-recall` checkpoint was trained on: its MTP drafts are
    then accepted as on text the model knows; deterministic). Needs the checkpoint's tokenizer."""
    import numpy as np

    from glm53 import recall_tasks
    from glm53.tokenizer import GlmTokenizer

    tok = GlmTokenizer.from_pretrained(model_dir)
    rng = np.random.default_rng(recall_tasks.EVAL_SEED_BASE + seed * 1_000_003 + batch)
    out = []
    for _ in range(batch):
        msgs, ids = [], []
        while len(ids) < prompt_len:
            span = recall_tasks.copy_span(rng, int(rng.integers(6, 17)))
            if msgs:
                msgs.append({"role": "assistant", "content": msgs[-1]["content"].removeprefix("Repeat: ")})
            msgs.append({"role": "user", "content": f"Repeat: {span}"})
            ids = tok.encode(tok.apply_chat_template(msgs, enable_thinking=False))
        out.append(ids[-prompt_len:])
    return out


def regular_vocab_size(model_dir: str) -> int:
    """Ids below the first added token (the BPE vocabulary), read from tokenizer.json."""
    with open(os.path.join(model_dir, "tokenizer.json"), encoding="utf-8") as f:
        tok = json.load(f)
    added = [t["id"] for t in tok.get("added_tokens", [])]
    return min(added) if added else len(tok["model"]["vocab"])


# ----------------------------------------------------------------------------------- ours
def unreachable_ids(model_dir: str, vocab_size: int) -> list[int]:
    """The checkpoint's padded vocabulary rows: ids at or past the tokenizer's size (which ours
    never chooses, `glm53.sampling.mask_unreachable`)."""
    from glm53.tokenizer import tokenizer_vocab_size

    n = tokenizer_vocab_size(model_dir)
    return list(range(n, vocab_size)) if n is not None and n < vocab_size else []


def run_ours_once(engine, prompts: list[list[int]], new_tokens: int, tag: str, async_scheduling: bool = False) -> dict:
    """One batch through `engine` (synchronous or asynchronous scheduling, `--async-scheduling`);
    returns timings and every row's generated ids. Decode throughput counts the tokens the
    steady-phase `step()` calls return (with asynchronous scheduling a call returns the tokens of
    the step dispatched by the call before)."""
    from serving.types import SamplingParams

    engine.set_async_scheduling(async_scheduling)

    B = len(prompts)
    ids = [f"{tag}-{i}" for i in range(B)]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True))
    tokens = {rid: [] for rid in ids}
    hot0 = engine.runner.num_hot_steps  # HiSparse: steps on the hot program (leases, host reads)
    prefill_s = decode_s = device_s = host_s = 0.0
    prefill_steps = decode_steps = decode_tokens = 0
    t_start = time.perf_counter()
    while engine.has_unfinished_requests():
        steady = all(tokens[r] for r in ids)  # every row has its first token: this step is pure decode
        h0 = engine.host_overhead_s
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        for o in outs:
            if o.request_id in tokens:
                tokens[o.request_id].extend(o.new_token_ids)
        # (Under MTP speculation a decode step has 1 + the drafts it verifies rows per request, and
        # requests finish at different steps: every step after the first tokens counts.)
        if steady and engine.drafts is None and engine.runner.last.num_tokens != B:
            if engine.hisparse is None:
                raise RuntimeError(f"a decode step of batch {B} scheduled {engine.runner.last.num_tokens} tokens")
            # Under HiSparse pressure admission is staggered (a request waits for released pages):
            # only steps that decode the whole batch count as decode steps.
            steady = False
        if steady:
            decode_tokens += sum(len(o.new_token_ids) for o in outs)
            decode_s += dt
            device_s += engine.runner.last.device_s
            host_s += engine.host_overhead_s - h0
            decode_steps += 1
        else:
            prefill_s += dt
            prefill_steps += 1
    total_s = time.perf_counter() - t_start
    problems = engine.audit()
    if problems:
        raise RuntimeError(f"engine audit failed: {problems[:3]}")
    if any(len(tokens[r]) != new_tokens for r in ids):
        raise RuntimeError("a request did not generate the requested number of tokens")
    return {
        "total_s": total_s, "prefill_s": prefill_s, "prefill_steps": prefill_steps,
        "decode_s": decode_s, "decode_steps": decode_steps, "decode_tokens": decode_tokens,
        "decode_tok_s": decode_tokens / decode_s,
        "step_ms": 1e3 * decode_s / decode_steps, "device_ms": 1e3 * device_s / decode_steps,
        "host_ms": 1e3 * host_s / decode_steps, "host_share": host_s / decode_s,
        "hot_steps": engine.runner.num_hot_steps - hot0,
        "tokens": [tokens[r] for r in ids],
    }


def run_jit_once(lm, prompts: list[list[int]], new_tokens: int) -> dict:
    """`glm53.api.generate_batch` (one jit-compiled program: prefill + `lax.while_loop` decode):
    timed with `new_tokens` and with 1 new token; the difference is the decode of new_tokens − 1
    steps. → timings and every row's generated ids."""
    from glm53 import api

    t0 = time.perf_counter()
    api.generate_batch(lm, prompts, 1)
    t1 = time.perf_counter()
    out = api.generate_batch(lm, prompts, new_tokens)
    t2 = time.perf_counter()
    B, decode_s = len(prompts), max((t2 - t1) - (t1 - t0), 1e-9)
    return {"total_s": t2 - t1, "prefill_s": t1 - t0, "decode_s": decode_s,
            "decode_tok_s": B * (new_tokens - 1) / decode_s, "tokens": out.new_token_ids}


def build_engine(args, model_dir: str, batches: list[int]):
    """The engine, sized so that every batch prefills in one step. → (engine, setup facts)."""
    import jax

    from serving.engine import EngineArgs
    from serving.engine_factory import build_engine
    from glm53.compile_cache import enable_compilation_cache

    enable_compilation_cache()
    max_batched = max(512, max(batches) * args.prompt_len)
    parallel = None
    if args.data_parallel_size > 1:
        from sharding.mesh import ParallelConfig

        parallel = ParallelConfig(data_parallel_size=args.data_parallel_size, enable_expert_parallel=True)
    extra = json.loads(args.engine_args)
    eargs = EngineArgs(**{**dict(model=model_dir, max_model_len=args.max_model_len, max_num_seqs=max(batches),
                                 max_num_batched_tokens=max_batched,
                                 num_gpu_blocks_override=args.num_gpu_blocks_override,
                                 compile_progress=False, parallel=parallel), **extra})
    t0 = time.perf_counter()
    engine = build_engine(eargs)
    setup = {"load_and_compile_s": time.perf_counter() - t0, "buckets": list(engine.runner.buckets),
             "max_num_seqs": max(batches), "max_num_batched_tokens": max_batched,
             "max_model_len": args.max_model_len, "num_kv_blocks": engine.runner.kv_arena.shape[0],
             "kv_arena_mib": engine.runner.kv_arena.nbytes / 2**20, "dtype": str(engine.runner.kv_arena.dtype),
             "jax": jax.__version__, "device": str(jax.devices()[0]), "num_devices": jax.device_count(),
             "data_parallel_size": args.data_parallel_size, "engine_args": json.loads(args.engine_args),
             "hisparse": engine.hisparse is not None,
             "compile_s_per_bucket": {str(k): round(v, 2) for k, v in engine.runner.compile_seconds.items()}}
    return engine, setup


def median_run(runs: list[dict]) -> dict:
    """The run with the median decode throughput, plus the throughput of every run."""
    ordered = sorted(runs, key=lambda r: r["decode_tok_s"])
    med = dict(ordered[len(ordered) // 2])
    med["decode_tok_s_all"] = [r["decode_tok_s"] for r in runs]
    return med


# ----------------------------------------------------------------------------------- HF
def hf_worker(spec: dict) -> int:
    """Runs under the HF interpreter. Loads the model, then answers one JSON line on stdout for each
    JSON request line on stdin: {"prompts": [[ids]], "new_tokens": n} → timings and tokens;
    {"setup": true} → versions. Everything else it prints goes to stderr."""
    proto = sys.stdout
    sys.stdout = sys.stderr
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from hf_tie_rule import position_tie_rule

    torch.manual_seed(0)
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    kwargs = {"dtype": torch.float32}
    if spec.get("attn_implementation"):
        kwargs["attn_implementation"] = spec["attn_implementation"]
    transformers.logging.set_verbosity_error()  # the load report lists the MTP layer's unused weights
    transformers.utils.logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(spec["model"], **kwargs).eval()
    # Run to max_new_tokens, as ignore_eos does on our side: generate() fills fields left unset in
    # the config it is given from the model's own generation config, so clear EOS there too.
    model.generation_config.eos_token_id = None
    pad = spec["pad_token_id"]

    class StepClock(LogitsProcessor):
        """Records the wall time at which each generation step's logits are ready."""

        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    def once(prompts, n, position_ties=False):
        L = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (L - len(p)) + p for p in prompts], dtype=torch.long)
        mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
        clock = StepClock()
        gen_cfg = copy.deepcopy(model.generation_config)
        gen_cfg.update(max_new_tokens=n, do_sample=False, pad_token_id=pad, eos_token_id=None)
        if spec.get("suppress_tokens"):  # the checkpoint's padded vocabulary rows, never sampled by ours
            gen_cfg.update(suppress_tokens=spec["suppress_tokens"])
        if position_ties:  # untimed check run: also return every step's logits
            gen_cfg.update(output_scores=True, return_dict_in_generate=True)
        t0 = time.perf_counter()
        with torch.inference_mode(), (position_tie_rule() if position_ties else contextlib.nullcontext()):
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_cfg,
                                 logits_processor=LogitsProcessorList([clock]))
        t1 = time.perf_counter()
        if position_ties:
            top2 = torch.stack(out.scores, 1).topk(2, dim=-1).values  # [B, n, 2]
            return {"tokens": out.sequences[:, L:].tolist(), "top2_gap": (top2[..., 0] - top2[..., 1]).tolist()}
        B = len(prompts)
        steps = len(clock.times) - 1
        if out.shape[1] - L != n or steps != n - 1:
            raise RuntimeError(f"HF generated {out.shape[1] - L} tokens in {steps + 1} steps, expected {n}")
        decode_s = clock.times[-1] - clock.times[0]
        return {"total_s": t1 - t0, "prefill_s": clock.times[0] - t0, "decode_s": decode_s,
                "decode_steps": steps, "decode_tokens": B * steps, "decode_tok_s": B * steps / decode_s,
                "step_ms": 1e3 * decode_s / steps, "tokens": out[:, L:].tolist()}

    for line in sys.stdin:
        req = json.loads(line)
        if req.get("setup"):
            res = {"torch": torch.__version__, "transformers": transformers.__version__,
                   "python": platform.python_version(), "torch_threads": torch.get_num_threads(),
                   "attn_implementation": model.config._attn_implementation}
        else:
            res = once(req["prompts"], req["new_tokens"], bool(req.get("position_ties")))
        proto.write(json.dumps(res) + "\n")
        proto.flush()
    return 0


def default_hf_python() -> str | None:
    if os.environ.get("HF_PYTHON"):
        return os.environ["HF_PYTHON"]
    probe = subprocess.run([sys.executable, "-c", "import torch, transformers"], capture_output=True)
    return sys.executable if probe.returncode == 0 else None


class HFClient:
    """The HF worker subprocess (see `hf_worker`), driven one request at a time."""

    def __init__(self, hf_python: str, spec: dict, out_dir: str):
        out_dir = os.path.abspath(out_dir)
        spec_path = os.path.join(out_dir, "hf_spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        self.cmd = [hf_python, os.path.abspath(__file__), "--hf-worker", spec_path]
        # Without the repository on its path: our `kernels` package would shadow the `kernels`
        # package transformers imports.
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     cwd=out_dir)

    def ask(self, req: dict) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"HF worker failed (exit {self.proc.wait()}): {' '.join(self.cmd)}")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


def bench(args, engine, hf: HFClient | None, batches: list[int], prompts: dict, lm=None) -> dict:
    """For each batch: one warm-up of each side, then `repeats` rounds of ours-then-jit-then-HF
    (the sides alternate, so all see the same background load), then one untimed HF run with the
    indexer's tie rule pinned to ours (tokens and top-2 logit gaps). `lm` (a `glm53.api` model):
    also time `api.generate_batch` (`run_jit_once`).
    → {B: {"ours": run, "jit": run, "hf": run, "pair_ratios": [...], "hf_ties": {"tokens", "top2_gap"}}}."""
    out = {}
    warm = min(4, args.new_tokens)
    for B in batches:
        run_ours_once(engine, prompts[B], warm, f"warm{B}")
        run_ours_once(engine, prompts[B], warm, f"awarm{B}", async_scheduling=True)
        if lm is not None:
            run_jit_once(lm, prompts[B], args.new_tokens)  # compiles both programs
        if hf:
            hf.ask({"prompts": prompts[B], "new_tokens": warm})
        ours_runs, async_runs, jit_runs, hf_runs = [], [], [], []
        for k in range(args.repeats):
            ours_runs.append(run_ours_once(engine, prompts[B], args.new_tokens, f"b{B}r{k}"))
            async_runs.append(run_ours_once(engine, prompts[B], args.new_tokens, f"a{B}r{k}", async_scheduling=True))
            if lm is not None:
                jit_runs.append(run_jit_once(lm, prompts[B], args.new_tokens))
            if hf:
                hf_runs.append(hf.ask({"prompts": prompts[B], "new_tokens": args.new_tokens}))
        out[B] = {"ours": median_run(ours_runs), "ours_async": median_run(async_runs),
                  "hf": median_run(hf_runs) if hf else None,
                  "jit": median_run(jit_runs) if jit_runs else None}
        if hf:
            out[B]["pair_ratios"] = [o["decode_tok_s"] / h["decode_tok_s"] for o, h in zip(ours_runs, hf_runs)]
            # Untimed: HF again with its indexer's top-k ties broken like ours (scripts/hf_tie_rule.py).
            out[B]["hf_ties"] = hf.ask({"prompts": prompts[B], "new_tokens": args.new_tokens, "position_ties": True})
        msg = (f"  batch {B:>3}: ours {out[B]['ours']['decode_tok_s']:10.1f} tok/s, "
               f"async {out[B]['ours_async']['decode_tok_s']:10.1f} tok/s")
        if out[B]["jit"]:
            msg += f", generate_batch {out[B]['jit']['decode_tok_s']:10.1f} tok/s"
        if hf:
            msg += f", HF {out[B]['hf']['decode_tok_s']:10.1f} tok/s"
        print(msg, flush=True)
    return out


# ----------------------------------------------------------------------------------- report
def check_tokens(ours: list[list[int]], hf: list[list[int]], k: int) -> tuple[int, int]:
    """Rows whose first k greedy tokens agree, out of all rows."""
    same = sum(1 for a, b in zip(ours, hf) if list(a[:k]) == list(b[:k]))
    return same, len(ours)


def first_divergence(ours: list[list[int]], hf: list[list[int]]) -> list[int | None]:
    """Per row, the index of the first generated token where the two differ (None: all equal)."""
    out = []
    for a, b in zip(ours, hf):
        out.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None))
    return out


def divergences(ours: list[list[int]], ref: list[list[int]], ref_top2_gap: list[list[float]],
                eps: float = NEAR_TIE_EPS) -> list[dict | None]:
    """docs/design.md §10's equality rule, per row: None when the greedy streams are identical, else the first
    differing token's index, the reference's top-1 minus top-2 logit gap there and whether that is a
    near-tie (gap < eps), the only acceptable kind of divergence."""
    out = []
    for i, t in enumerate(first_divergence(ours, ref)):
        if t is None:
            out.append(None)
        else:
            gap = float(ref_top2_gap[i][t])
            out.append({"token": t, "ref_top2_gap": gap, "near_tie": gap < eps})
    return out


def _cell(x: float | None, width: int, spec: str = ".1f", suffix: str = "") -> str:
    """`x` formatted to `width` columns, or "–" when it was not measured (e.g. --skip-hf, --skip-jit)."""
    return f"{x:{spec}}{suffix}".rjust(width) if x is not None else "–".rjust(width)


def async_table(rows: list[dict]) -> str:
    """Synchronous vs asynchronous scheduling, and both against generate_batch's loop."""
    head = (f"{'batch':>5} | {'sync tok/s':>10} | {'async tok/s':>11} | {'async/sync':>10} | {'gen_batch tok/s':>15} | "
            f"{'sync/gb':>7} | {'async/gb':>8} | {'sync host ms':>12} | {'async exposed ms':>16} | {'async step ms':>13} | "
            f"{'exposed %':>9} | {'streams equal':>13}")
    lines = [head, "-" * len(head)]
    for r in rows:
        o, a = r["ours"], r["ours_async"]
        gb = r.get("generate_batch", {}).get("decode_tok_s")
        lines.append(
            f"{r['batch']:>5} | {o['decode_tok_s']:>10.1f} | {a['decode_tok_s']:>11.1f} | "
            f"{a['decode_tok_s'] / o['decode_tok_s']:>9.2f}x | {_cell(gb, 15)} | "
            f"{_cell(o['decode_tok_s'] / gb if gb else None, 7, '.2f', 'x')} | "
            f"{_cell(a['decode_tok_s'] / gb if gb else None, 8, '.2f', 'x')} | {o['host_ms']:>12.2f} | "
            f"{a['host_ms']:>16.2f} | {a['step_ms']:>13.2f} | "
            f"{100 * a['host_share']:>8.1f}% | {str(r['async_rows_equal_sync']) + '/' + str(r['batch']):>13}")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    """Our engine against generate_batch's loop and HF transformers ("–" where one was skipped)."""
    head = (f"{'batch':>5} | {'ours tok/s':>10} | {'gen_batch tok/s':>15} | {'HF tok/s':>9} | {'ours/HF':>7} | {'step ms':>7} | "
            f"{'device ms':>9} | {'host ms':>7} | {'host %':>6} | {'ours prefill ms':>15} | {'HF prefill ms':>13}")
    lines = [head, "-" * len(head)]
    for r in rows:
        hf = r.get("hf")
        lines.append(
            f"{r['batch']:>5} | {r['ours']['decode_tok_s']:>10.1f} | "
            f"{_cell(r.get('generate_batch', {}).get('decode_tok_s'), 15)} | "
            f"{_cell(hf['decode_tok_s'] if hf else None, 9)} | {_cell(r.get('ratio'), 6, '.1f', 'x')} | "
            f"{r['ours']['step_ms']:>7.2f} | {r['ours']['device_ms']:>9.2f} | {r['ours']['host_ms']:>7.2f} | "
            f"{100 * r['ours']['host_share']:>5.1f}% | {1e3 * r['ours']['prefill_s']:>15.1f} | "
            f"{_cell(1e3 * hf['prefill_s'] if hf else None, 13)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="directory for bench_decode.json (required unless --hf-worker)")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded tiny checkpoint)")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--prompt-kind", choices=("random", "copy"), default="random",
                   help="random: uniform token ids; copy: the tail of a \"Repeat: …\" conversation (the task "
                   "the tiny-recall checkpoint was trained on: real MTP acceptance; needs a tokenizer)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="KV arena pages (default: the engine's sizing, 512 MiB on CPU)")
    p.add_argument("--check-tokens", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hf-python", default=None, help="interpreter with torch + transformers (default: $HF_PYTHON "
                   "or this one if it has them)")
    p.add_argument("--hf-attn-implementation", default=None, help="HF attention backend (default: HF's choice)")
    p.add_argument("--hf-threads", type=int, default=0,
                   help="torch intra-op threads for HF (0: torch's default; see the docstring)")
    p.add_argument("--skip-hf", action="store_true", help="measure only our engine (and generate_batch)")
    p.add_argument("--skip-jit", action="store_true", help="do not time glm53.api.generate_batch")
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="serve with N attention replicas + expert parallelism (serving/dp_engine.py); on CPU "
                   "it simulates N devices (XLA_FLAGS) unless XLA_FLAGS already sets a device count. The "
                   "batch is spread over the replicas (each gets max_num_seqs = the largest batch)")
    p.add_argument("--engine-args", default="{}",
                   help="more EngineArgs fields as JSON, e.g. '{\"attention_config\": {\"hisparse_config\": "
                   "{\"host_pool_gib\": 0.05}}, \"enable_prefix_caching\": true}' (with a small "
                   "--num-gpu-blocks-override: decode under HiSparse pressure)")
    p.add_argument("--hf-worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        p.error(f"--batches: comma-separated integers, got {args.batches!r}")
    if any(b < 1 for b in batches):
        p.error(f"--batches: each batch size must be at least 1, got {args.batches!r}")
    if args.data_parallel_size > 1 and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        if "jax" in sys.modules:
            p.error("--data-parallel-size: jax was imported before the simulated devices could be set")
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.data_parallel_size}").strip()

    if args.hf_worker:
        with open(args.hf_worker) as f:
            return hf_worker(json.load(f))
    if not args.out:
        p.error("--out is required")
    if args.new_tokens < 2:
        p.error("--new-tokens must be >= 2 (one prefill token + decode steps)")
    os.makedirs(args.out, exist_ok=True)
    sys.path.insert(0, REPO_ROOT)
    from glm53.tiny_checkpoint import default_model_dir

    model_dir = args.model or str(default_model_dir())
    with open(os.path.join(model_dir, "config.json")) as f:
        hf_cfg = json.load(f)
    pad = hf_cfg.get("pad_token_id")
    if pad is None:
        eos = hf_cfg.get("eos_token_id")
        pad = eos[0] if isinstance(eos, list) else (eos or 0)
    vocab = regular_vocab_size(model_dir) if os.path.exists(os.path.join(model_dir, "tokenizer.json")) \
        else hf_cfg["vocab_size"]
    if args.prompt_kind == "copy":
        prompts = {B: make_copy_prompts(B, args.prompt_len, model_dir, args.seed) for B in batches}
    else:
        prompts = {B: make_prompts(B, args.prompt_len, vocab, args.seed) for B in batches}

    hf_python = None if args.skip_hf else (args.hf_python or default_hf_python())
    if not args.skip_hf and hf_python is None:
        raise SystemExit("no interpreter with torch + transformers: pass --hf-python (see the docstring) "
                         "or --skip-hf")

    print(f"model {model_dir}; prompts {args.prompt_len} tokens, {args.new_tokens} new tokens, "
          f"batches {batches}, {args.repeats} repeats", flush=True)
    engine, ours_setup = build_engine(args, model_dir, batches)
    client = None
    if hf_python:
        client = HFClient(hf_python, {"model": model_dir, "pad_token_id": pad, "threads": args.hf_threads,
                                      "attn_implementation": args.hf_attn_implementation,
                                      "suppress_tokens": unreachable_ids(model_dir, hf_cfg["vocab_size"])}, args.out)
    try:
        from glm53 import api

        lm = None if args.skip_jit else api.load(model_dir)
        res = bench(args, engine, client, batches, prompts, lm)
        hf_setup = client.ask({"setup": True}) if client else None
    finally:
        if client:
            client.close()

    rows, sanity = [], []
    for B in batches:
        o, h = res[B]["ours"], res[B]["hf"]
        row = {"batch": B, "ours": {k: v for k, v in o.items() if k != "tokens"}}
        a = res[B]["ours_async"]
        row["ours_async"] = {k: v for k, v in a.items() if k != "tokens"}
        row["async_rows_equal_sync"] = sum(x == y for x, y in zip(a["tokens"], o["tokens"]))
        j = res[B]["jit"]
        if j:
            row["generate_batch"] = {k: v for k, v in j.items() if k != "tokens"}
            row["generate_batch"]["rows_equal_engine"] = sum(a == b for a, b in zip(j["tokens"], o["tokens"]))
            row["generate_batch_vs_engine"] = j["decode_tok_s"] / o["decode_tok_s"]
        if h:
            row["hf"] = {k: v for k, v in h.items() if k != "tokens"}
            row["ratio"] = o["decode_tok_s"] / h["decode_tok_s"]
            row["pair_ratios"] = res[B]["pair_ratios"]
            same, n = check_tokens(o["tokens"], h["tokens"], args.check_tokens)
            same_all, _ = check_tokens(o["tokens"], h["tokens"], args.new_tokens)
            row["greedy_match"] = {"first_k": args.check_tokens, "rows_equal_first_k": same,
                                   "rows_equal_all": same_all, "rows": n,
                                   "first_divergence": first_divergence(o["tokens"], h["tokens"]),
                                   "ours_row0": o["tokens"][0][:args.check_tokens],
                                   "hf_row0": h["tokens"][0][:args.check_tokens]}
            ties = res[B]["hf_ties"]
            div = divergences(o["tokens"], ties["tokens"], ties["top2_gap"])
            bad = [(r, d) for r, d in enumerate(div) if d is not None]
            row["parity"] = {"reference": "HF generate with the indexer's top-k ties broken by lower position "
                             "(scripts/hf_tie_rule.py), untimed", "rows_equal_all": div.count(None), "rows": n,
                             "divergences": div, "ok": all(d["near_tie"] for _, d in bad)}
            sanity.append(
                f"batch {B}: vs HF with our top-k tie rule: {div.count(None)}/{n} rows equal in all "
                f"{args.new_tokens} tokens"
                + "".join(f"; row {r} differs at token {d['token']} (HF top-2 gap {d['ref_top2_gap']:.2e}: "
                          f"{'near-tie' if d['near_tie'] else 'NOT a near-tie'})" for r, d in bad)
                + f" -> {'OK' if row['parity']['ok'] else 'MISMATCH'}. "
                f"vs HF as shipped (torch.topk tie order, differs once the context passes index_topk): "
                f"{same}/{n} rows equal in the first {args.check_tokens}, {same_all}/{n} in all; first "
                f"divergence per row {row['greedy_match']['first_divergence']}")
        rows.append(row)

    report = {
        "workload": {"model": model_dir, "batches": batches, "prompt_len": args.prompt_len,
                     "prompt_kind": args.prompt_kind,
                     "new_tokens": args.new_tokens, "repeats": args.repeats, "seed": args.seed,
                     "greedy": True, "ignore_eos": True},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "ours_setup": ours_setup, "hf_setup": hf_setup, "hf_python": hf_python,
        "rows": rows, "sanity": sanity,
        "definitions": {
            "decode_tok_s": "batch x decode steps / wall time of the steady decode phase",
            "step_ms": "mean wall time of one decode step (LLMEngine.step)",
            "device_ms": "ModelRunner.last.device_s: jitted step dispatch until sampled tokens are on the host "
                         "(ours_async: the time step() waited for them)",
            "host_ms": "LLMEngine.host_overhead_s per step: step wall time minus device time (ours_async: the "
                       "exposed host time, an upper bound of the device's idle time per step, "
                       "serving/async_scheduling.py)",
            "host_share": "host_ms / step_ms",
            "ours_async": "the same engine with asynchronous scheduling (--async-scheduling), run alternately "
                          "with the synchronous one; async_rows_equal_sync: rows whose tokens equal the "
                          "synchronous run's",
            "ratio": "ours decode_tok_s / HF decode_tok_s (median runs); pair_ratios: per interleaved round",
        },
    }
    path = os.path.join(args.out, "bench_decode.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    print()
    print(table(rows))
    print()
    print(async_table(rows))
    for s in sanity:
        print("sanity:", s)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
