"""Load time of one ≥ 1 GiB checkpoint in both formats: HF safetensors through `glm53.loader`
versus the orbax checkpoint made from it by scripts/convert_checkpoint.py.

    PYTHONPATH=. python scripts/bench_checkpoint_load.py --out /tmp/ckpt_bench [--repeats 2] [--devices 8]

Writes under OUT: `hf/` (a synthetic checkpoint of the `tiny` structure scaled up to ≈1.1 GiB of
bf16: hidden 1024, 24 experts of 512, vocab 32768; random weights from
`glm53.tiny_checkpoint.tiny_weights`), `orbax/` (its conversion), and `results.json`; prints a
table. Never point OUT inside the repository.

Every load runs in a fresh Python process (no JAX state or compile cache shared) and is timed
from the `load_model` call to every parameter being ready (`block_until_ready`), model dtype
bfloat16 (the stored dtype, so neither path converts). The files were just written, so both
formats read from a warm page cache: the numbers compare the loaders, not the disks. With
`--devices N` (simulated CPU devices) a second pair of runs places the parameters on a
TP N/2 × EP 2 layout (tests/helpers/param_sharding.py): safetensors loads on one device then
moves, orbax reads each shard straight onto its device.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCALED = dict(vocab_size=32768, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
              num_attention_heads=8, q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32,
              v_head_dim=64, n_routed_experts=24, index_n_heads=8, index_head_dim=64)


def write_synthetic(path: str) -> float:
    """Write the scaled-up bf16 checkpoint (config.json + model.safetensors); returns its GiB."""
    from safetensors.numpy import save_file

    from glm53.config import TINY_HF_CONFIG, GlmConfig
    from glm53.tiny_checkpoint import tiny_weights

    raw = dict(TINY_HF_CONFIG, **SCALED)
    cfg = GlmConfig.from_hf_config(raw)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_hf_config(), f, indent=2)
    weights = tiny_weights(cfg, seed=0)
    save_file(weights, os.path.join(path, "model.safetensors"))
    return sum(w.nbytes for w in weights.values()) / 2**30


def _measure(path: str, devices: int) -> None:
    """Child process: load `path` (either format), print one JSON line with the seconds."""
    import jax
    import jax.numpy as jnp

    from glm53.loader import load_model
    from glm53.orbax_checkpoint import param_tree

    shardings = None
    if devices > 1:  # TP N/2 × EP 2: sharding/rules.py when present, else a stand-in rule
        from tests.helpers.param_sharding import layout_shardings

        shardings = layout_shardings(jax.devices(), tp=devices // 2, ep=2)
    jax.devices()  # backend start-up is not part of the load
    t0 = time.perf_counter()
    model = load_model(path, dtype=jnp.bfloat16, progress=False, shardings=shardings)
    jax.block_until_ready(param_tree(model))
    print(json.dumps({"seconds": time.perf_counter() - t0}))


def _run_child(path: str, devices: int) -> float:
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    if devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    proc = subprocess.run([sys.executable, __file__, "--measure", path, "--devices", str(devices)],
                          env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise RuntimeError(f"measuring {path} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["seconds"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="safetensors vs orbax load time of a ≥1 GiB checkpoint")
    p.add_argument("--out", help="work directory (outside the repository)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--devices", type=int, default=8, help="also time a sharded load on N simulated devices (0: skip)")
    p.add_argument("--measure", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.measure:
        _measure(args.measure, args.devices)
        return 0
    if not args.out:
        p.error("--out is required")
    out = os.path.abspath(args.out)
    if out.startswith(ROOT + os.sep):
        p.error("--out must be outside the repository (the checkpoint is over 1 GiB)")
    hf, ob = os.path.join(out, "hf"), os.path.join(out, "orbax")
    t0 = time.perf_counter()
    gib = write_synthetic(hf)
    t_write = time.perf_counter() - t0
    sys.path.insert(0, ROOT)
    from scripts.convert_checkpoint import main as convert

    t0 = time.perf_counter()
    if convert([hf, ob, "--overwrite", "--no-progress"]):
        return 1
    t_convert = time.perf_counter() - t0

    layouts = [1] + ([args.devices] if args.devices > 1 else [])
    results = {"checkpoint_gib": gib, "write_safetensors_s": t_write, "convert_s": t_convert,
               "cpus": os.cpu_count(), "load_average_at_start": os.getloadavg(), "runs": {}}
    for dev in layouts:
        for name, path in (("safetensors", hf), ("orbax", ob)):
            times = [_run_child(path, dev) for _ in range(args.repeats)]
            results["runs"][f"{name}/{dev}dev"] = {"seconds": times, "median_s": statistics.median(times),
                                                   "gib_per_s": gib / min(times)}
    print(f"checkpoint {gib:.2f} GiB bf16; wrote safetensors in {t_write:.1f}s, converted to orbax in {t_convert:.1f}s")
    print(f"{'format/devices':<20} {'runs (s)':<24} {'median s':>9} {'GiB/s (best)':>13}")
    for k, r in results["runs"].items():
        print(f"{k:<20} {', '.join(f'{t:.2f}' for t in r['seconds']):<24} {r['median_s']:>9.2f} {r['gib_per_s']:>13.2f}")
    print(f"{os.cpu_count()} CPUs; load average at start {results['load_average_at_start']}")
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    print(f"saved {os.path.join(out, 'results.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
