"""Convert an HF safetensors checkpoint directory (bf16, fp32 or block-FP8) into a glm53 orbax
checkpoint that `python -m serving.run --model DST` and `glm53.loader.load_model` restore directly
onto any mesh.

    PYTHONPATH=. python scripts/convert_checkpoint.py SRC DST [--dtype bfloat16|float32] [--no-mtp] [--overwrite] [--compress]

The parameters are built in the model's layout by `glm53.loader` (FP8 blocks dequantised,
linears transposed, experts and IndexShare groups stacked, `kv_b_proj` split) and written with
orbax together with config.json (without `quantization_config`), the tokenizer, chat template and
generation config. FP8 sources are stored dequantised in `--dtype` (bf16 by default, which equals
loading the FP8 checkpoint into a bf16 model; float32 for bit-exact fp32 parity); see
`glm53/orbax_checkpoint.py` for why fp8 + scales are not kept.

Memory: the converted parameters are held in host memory once (the checkpoint's size in
`--dtype`), so converting the full GLM-5.3 needs a host that holds it.
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="HF checkpoint directory (config.json + *.safetensors)")
    p.add_argument("dst", help="orbax checkpoint directory to create")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="stored parameter dtype (default bfloat16)")
    p.add_argument("--no-mtp", action="store_true", help="leave the MTP layer out")
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    p.add_argument("--compress", action="store_true",
                   help="zstd-compress the stored chunks (smaller, slower to restore)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)

    import jax.numpy as jnp

    from glm53 import orbax_checkpoint
    from glm53.config import ConfigError
    from glm53.loader import load_model
    from glm53.output_dir import check_output_dir
    from glm53.safetensors_reader import CheckpointError

    try:
        check_output_dir(args.src, args.dst, overwrite=args.overwrite)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if orbax_checkpoint.is_orbax_checkpoint(args.src):
        print(f"error: {args.src} is already an orbax checkpoint", file=sys.stderr)
        return 2
    progress = not args.no_progress
    t0 = time.perf_counter()
    try:
        model = load_model(args.src, dtype=getattr(jnp, args.dtype), with_mtp=not args.no_mtp, progress=progress,
                           quantization="none")  # orbax checkpoints store dequantised weights
    except (FileNotFoundError, CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t1 = time.perf_counter()
    out = orbax_checkpoint.save(model, args.dst, source_dir=args.src, overwrite=args.overwrite,
                               compress=args.compress, progress=progress)
    t2 = time.perf_counter()
    manifest = orbax_checkpoint.read_manifest(out)
    print(f"wrote {out}: {manifest['num_parameters']:,} parameters, {manifest['bytes'] / 2**30:.3f} GiB "
          f"{manifest['dtype']} (read {t1 - t0:.1f}s, write {t2 - t1:.1f}s); copied {manifest['copied_files']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
