"""Per-step time of the parallel layouts on simulated devices, in one run, as ratios to one device.

    PYTHONPATH=. python scripts/parallel_step_times.py [--out DIR] [--repeats 5]

Model: the tiny preset with 8 attention heads and 10 layers (as in tests/sharding), fp32, random
weights. Two step shapes, each carrying the same total work in every layout:
* prefill: 256 new tokens at positions 0..255 (under DP8: 8 replicas × 32 tokens of their own
  request);
* decode: 16 requests × 1 token at position 383 (384-token contexts; under DP8 two per replica).
The first call compiles and is not timed; the median of `--repeats` timed calls is reported.

What the numbers mean: `--xla_force_host_platform_device_count=8` runs 8 XLA CPU "devices" on
this machine's cores, so a layout cannot be faster than one device by parallelism; the ratios
show the cost of the layout's extra collectives, gathers and per-shard kernel calls on this
host, not a GPU speed-up. Writes `parallel_step_times.json` to `--out`.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from glm53.config import TINY_HF_CONFIG, GlmConfig  # noqa: E402
from glm53.kv_layout import build_kv_layout  # noqa: E402
from glm53.loader import load_weights  # noqa: E402
from glm53.model import GlmForCausalLM  # noqa: E402
from glm53.parallel_batch import empty_parallel_arena, replica_batch, shard_batch, stack_replicas  # noqa: E402
from glm53.safetensors_reader import InMemoryCheckpoint  # noqa: E402
from glm53.tiny_checkpoint import tiny_weights  # noqa: E402
from sharding.mesh import ParallelConfig, ParallelLayout  # noqa: E402
from sharding.rules import shard_params  # noqa: E402

LAYOUTS = {
    "one device": None,
    "TP8": ParallelConfig(tensor_parallel_size=8),
    "DP8 + EP8": ParallelConfig(data_parallel_size=8, enable_expert_parallel=True),
    "TP8 + DCP8 ag_rs": ParallelConfig(tensor_parallel_size=8, decode_context_parallel_size=8),
    "TP8 + DCP8 a2a": ParallelConfig(tensor_parallel_size=8, decode_context_parallel_size=8, dcp_comm_backend="a2a"),
    "PCP8 + EP8": ParallelConfig(prefill_context_parallel_size=8, enable_expert_parallel=True),
    "PCP8 x DCP8 + EP8": ParallelConfig(prefill_context_parallel_size=8, decode_context_parallel_size=8,
                                        enable_expert_parallel=True),
}
CONTEXT = 384


def build_model():
    cfg = GlmConfig.from_hf_config({**TINY_HF_CONFIG, "num_attention_heads": 8, "num_hidden_layers": 10,
                                    "first_k_dense_replace": 1})
    model = load_weights(GlmForCausalLM(cfg), InMemoryCheckpoint(tiny_weights(cfg, seed=1)), progress=False)
    return cfg, model


def step_inputs(layout, par, shape: str):
    """Global batch for the step shape; each request has its own pages."""
    dp = par.dp if par is not None else 1
    dcp = par.dcp if par is not None else 1
    nxt = 1
    reps = []
    n_req = 1 if shape == "prefill" else 16 // dp
    for _ in range(dp):
        reqs = []
        for _ in range(max(n_req, 1)):
            blocks = {}
            for g in layout.groups:
                n = -(-CONTEXT // (g.tokens_per_page * dcp))
                blocks[g.name] = list(range(nxt, nxt + n))
                nxt += n
            if shape == "prefill":
                reqs.append((np.arange(256 // dp) % 500 + 4, 0, blocks))
            else:
                reqs.append(([7], CONTEXT - 1, blocks))
        T = 256 // dp if shape == "prefill" else 16 // dp
        reps.append(replica_batch(layout, reqs, T, len(reqs) + 1, dcp))
    return reps, nxt


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/parallel_step_times")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    cfg, model = build_model()
    layout = build_kv_layout(cfg, "float32", with_mtp=False)
    graphdef, state = nnx.split(model)
    rows = []
    for name, pc in LAYOUTS.items():
        par = ParallelLayout.create(pc) if pc is not None else None
        st = shard_params(state, par) if par is not None else state
        step = jax.jit(lambda s, b, ar, par=par: nnx.merge(graphdef, s)(b, ar, layout, par)[0])
        res = {"layout": name}
        for shape in ("prefill", "decode"):
            reps, nb = step_inputs(layout, par, shape)
            if par is None:
                batch, arena = jax.tree.map(jnp.asarray, reps[0]), layout.empty_arena(nb)
            else:
                batch = shard_batch(stack_replicas(reps, par.pcp), par)
                arena = empty_parallel_arena(layout, nb, par)
            t0 = time.perf_counter()
            step(st, batch, arena).block_until_ready()
            compile_s = time.perf_counter() - t0
            times = []
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                step(st, batch, arena).block_until_ready()
                times.append(time.perf_counter() - t0)
            res[f"{shape}_ms"] = 1e3 * statistics.median(times)
            res[f"{shape}_first_call_s"] = compile_s
        rows.append(res)
        print(f"{name:22s} prefill {res['prefill_ms']:8.1f} ms   decode {res['decode_ms']:8.1f} ms", flush=True)
    base = rows[0]
    print(f"\n{'layout':22s} {'prefill ms':>11s} {'ratio':>7s} {'decode ms':>10s} {'ratio':>7s}")
    for r in rows:
        r["prefill_ratio"] = r["prefill_ms"] / base["prefill_ms"]
        r["decode_ratio"] = r["decode_ms"] / base["decode_ms"]
        print(f"{r['layout']:22s} {r['prefill_ms']:11.1f} {r['prefill_ratio']:7.2f} {r['decode_ms']:10.1f} "
              f"{r['decode_ratio']:7.2f}")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "parallel_step_times.json"), "w") as f:
        json.dump({"devices": jax.device_count(), "cpu_count": os.cpu_count(), "repeats": a.repeats,
                   "rows": rows}, f, indent=2)
    print(f"\nwrote {os.path.join(a.out, 'parallel_step_times.json')}")


if __name__ == "__main__":
    main()
