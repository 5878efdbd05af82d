"""Load time and peak host memory of a multi-GiB FP8 checkpoint: the loader before FP8 weights were
kept (dequantise every FP8 weight to bf16 on the host, build the whole model on one device, then
move it onto the layout) versus the streaming loader (FP8 kept, each device's shards read straight
from the memory-mapped files into their sharded arrays). A third row runs the streaming loader with
`quantization="none"` (dequantised to bf16 like the old one) to separate streaming from keeping FP8.

    PYTHONPATH=. python scripts/bench_checkpoint_load.py --out /tmp/ckpt_bench [--gib 2.5] [--devices 8]

Writes under OUT (never inside the repository): `fp8/` (a synthetic block-scaled FP8 checkpoint of
the GLM-5.3 structure scaled down — hidden 2048, 24 routed experts of 1024, 14 layers + MTP,
random e4m3 codes and scales; one safetensors file per layer with an index, like the real one),
`old/` (the old loader's source, `git archive` of `--old-rev`), and `results.json`; prints a table.

Every load runs in a fresh Python process and is timed from the `load_model` call to every
parameter being ready (`block_until_ready`), activations bfloat16. Peak RSS is the child's
`ru_maxrss` (it includes the memory-mapped checkpoint pages the process touched and, on the CPU
backend, the "device" arrays themselves, which live in host memory); `rss_before` is the RSS after
JAX start-up and `device_gib` the bytes of every addressable shard after loading, so
`peak − before − device` is the host staging the loader needed. The checkpoint is written into
`--out` unless one is already there, which is reused (`results.json`'s `checkpoint_reused` and the
printed summary say which); either way both loaders read it in turn after the write or an earlier
run, so they read a page cache as warm as the machine's memory allows: the numbers compare the
loaders, not the disks. With
`--devices N` (simulated CPU devices) both also load onto TP N/2 × DP 2 with the experts over all
N devices (EP N), the partition rules of sharding/rules.py.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OLD_REV = "93c5f03"  # the last commit whose loader dequantised FP8 checkpoints
SCALED = dict(vocab_size=32768, hidden_size=2048, intermediate_size=4096, moe_intermediate_size=1024,
              num_attention_heads=16, q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
              v_head_dim=128, n_routed_experts=24, index_n_heads=16, index_head_dim=128)


def write_synthetic(path: str) -> float:
    """Write the scaled FP8 checkpoint (config.json, one file per layer + index); returns its GiB."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    from glm53.checkpoint_keys import expected_checkpoint_shapes
    from glm53.config import TINY_HF_CONFIG, GlmConfig
    from glm53.quant import is_quantized_linear

    raw = dict(TINY_HF_CONFIG, **SCALED)
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    cfg = GlmConfig.from_hf_config(raw)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**cfg.to_hf_config(), "quantization_config": raw["quantization_config"]}, f, indent=2)
    rng = np.random.default_rng(0)
    files: dict[str, dict] = {}
    for key, (shape, dtype) in expected_checkpoint_shapes(cfg).items():
        parts = key.split(".")
        fname = f"model-{parts[2]}.safetensors" if parts[1] == "layers" else "model-top.safetensors"
        files.setdefault(fname, {})[key] = (shape, dtype)
    weight_map, total = {}, 0
    for fname, entries in files.items():
        tensors = {}
        for key, (shape, dtype) in entries.items():
            if is_quantized_linear(key, len(shape)):
                codes = rng.integers(0, 256, size=shape, dtype=np.uint8)
                codes[(codes & 0x7F) == 0x7F] = 0  # e4m3fn NaN codes
                tensors[key] = codes.view(ml_dtypes.float8_e4m3fn)
                tensors[key[: -len("weight")] + "weight_scale_inv"] = rng.uniform(
                    1e-4, 1e-3, (-(-shape[0] // 128), -(-shape[1] // 128))).astype(np.float32)
            else:
                dt = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
                tensors[key] = (rng.standard_normal(shape, np.float32) * 0.02).astype(dt)
        save_file(tensors, os.path.join(path, fname))
        for k, v in tensors.items():
            weight_map[k] = fname
            total += v.nbytes
        del tensors
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total / 2**30


def _rss_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def _measure(path: str, devices: int, quantization: str | None) -> None:
    """Child process (PYTHONPATH selects the loader): load `path`, print one JSON line."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from glm53.loader import load_model

    shardings = None
    if devices > 1:
        from sharding.mesh import ParallelConfig, ParallelLayout
        from sharding.rules import param_shardings

        layout = ParallelLayout.create(ParallelConfig(tensor_parallel_size=devices // 2, data_parallel_size=2,
                                                      enable_expert_parallel=True))
        # An orbax-style ShardingSpec (abstract pytree → NamedShardings): both loaders accept it.
        shardings = lambda target: param_shardings(target, layout)  # noqa: E731
    jax.devices()  # backend start-up is not part of the load
    before = _rss_gib()
    t0 = time.perf_counter()
    kw = {"quantization": quantization} if quantization else {}  # the old loader has no such argument
    model = load_model(path, dtype=jnp.bfloat16, progress=False, shardings=shardings, **kw)
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    jax.block_until_ready(leaves)
    secs = time.perf_counter() - t0
    device = sum(s.data.nbytes for x in leaves for s in x.addressable_shards)
    fp8 = sum(1 for x in leaves if x.dtype == jnp.float8_e4m3fn)
    print(json.dumps({"seconds": secs, "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                      "rss_before_gib": before, "device_gib": device / 2**30, "fp8_params": fp8,
                      "params": len(leaves)}))


def _run_child(code_root: str, path: str, devices: int, quantization: str | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{code_root}{os.pathsep}{ROOT}", JAX_PLATFORMS="cpu")
    if devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    script = os.path.join(ROOT, "scripts", "bench_checkpoint_load.py")
    extra = ["--quantization", quantization] if quantization else []
    proc = subprocess.run([sys.executable, script, "--measure", path, "--devices", str(devices), *extra], env=env,
                          capture_output=True, text=True, timeout=3600, cwd=code_root)
    if proc.returncode:
        raise RuntimeError(f"measuring {path} with {code_root} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _old_source(rev: str, dst: str) -> str:
    """The old loader's packages (glm53, kernels, sharding) from `git archive rev` into dst."""
    if not os.path.isdir(os.path.join(dst, "glm53")):
        os.makedirs(dst, exist_ok=True)
        archive = subprocess.run(["git", "-C", ROOT, "archive", rev, "glm53", "kernels", "sharding"],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", dst], input=archive, check=True)
    return dst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="old vs streaming loader on a multi-GiB FP8 checkpoint")
    p.add_argument("--out", help="work directory (outside the repository)")
    p.add_argument("--devices", type=int, default=8, help="also load onto N simulated devices (0: skip)")
    p.add_argument("--old-rev", default=OLD_REV, help="git revision of the old loader")
    p.add_argument("--measure", help=argparse.SUPPRESS)
    p.add_argument("--quantization", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.measure:
        _measure(args.measure, args.devices, args.quantization)
        return 0
    if not args.out:
        p.error("--out is required")
    out = os.path.abspath(args.out)
    if out.startswith(ROOT + os.sep):
        p.error("--out must be outside the repository (the checkpoint is several GiB)")
    ckpt = os.path.join(out, "fp8")
    sys.path.insert(0, ROOT)
    t0 = time.perf_counter()
    reused = os.path.exists(os.path.join(ckpt, "model.safetensors.index.json"))
    if reused:
        with open(os.path.join(ckpt, "model.safetensors.index.json")) as f:
            gib = json.load(f)["metadata"]["total_size"] / 2**30
    else:
        gib = write_synthetic(ckpt)
    t_write = time.perf_counter() - t0
    old = _old_source(args.old_rev, os.path.join(out, "old"))
    results = {"checkpoint_gib": gib, "checkpoint_reused": reused, "write_s": None if reused else t_write, "old_rev": args.old_rev, "cpus": os.cpu_count(),
               "load_average_at_start": os.getloadavg(), "runs": {}}
    for dev in [1] + ([args.devices] if args.devices > 1 else []):
        for name, code, q in (("old (dequantise, one device, then move)", old, None),
                              ("new, dequantised (streamed shards, bf16)", ROOT, "none"),
                              ("new (FP8 kept, streamed shards)", ROOT, None)):
            r = _run_child(code, ckpt, dev, q)
            results["runs"][f"{name} / {dev} dev"] = r
            print(f"  {name} / {dev} dev: {r}", flush=True)
    made = f"reused from {ckpt}" if reused else f"written in {t_write:.0f}s"
    print(f"\ncheckpoint {gib:.2f} GiB FP8 ({made}); {os.cpu_count()} CPUs, "
          f"load average at start {results['load_average_at_start']}")
    print(f"{'loader / devices':<52} {'load s':>7} {'GB/s':>6} {'peak RSS GiB':>13} {'RSS before':>11} "
          f"{'device GiB':>11} {'staging GiB':>12}")
    for k, r in results["runs"].items():
        staging = r["peak_rss_gib"] - r["rss_before_gib"] - r["device_gib"]
        print(f"{k:<52} {r['seconds']:>7.1f} {gib * 2**30 / 1e9 / r['seconds']:>6.2f} {r['peak_rss_gib']:>13.2f} "
              f"{r['rss_before_gib']:>11.2f} {r['device_gib']:>11.2f} {staging:>12.2f}")
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    print(f"saved {os.path.join(out, 'results.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
