"""Write the FP8 block-scaled copy of a bf16/fp32 HF checkpoint — the format GLM-5.3's own FP8
checkpoint has (docs/design.md §3.7), which `serving.run --model DST` then serves with its FP8 weights on
the device (docs/fp8_weights.md).

    PYTHONPATH=. python scripts/quantize_checkpoint.py SRC DST [--block 128 128] [--overwrite]

Every linear GLM-5.x FP8 checkpoints quantise (`glm53.quant.is_quantized_linear`: attention
projections, the indexer's wq_b/wk, dense MLP, shared and routed experts) becomes float8_e4m3fn
codes + an fp32 `weight_scale_inv` per block (`kernels.fp8_matmul.quantize_fp8_blocks_np`:
scale = amax / 448, codes rounded to nearest e4m3 — what `--quantization fp8` does at load); the
other tensors are copied as stored. One output file per input file (tensors in the same order),
`model.safetensors.index.json`, config.json with `quantization_config`, and the tokenizer, chat
template and generation config copied. Memory: one input file's worth at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", help="HF checkpoint directory (config.json + *.safetensors), bf16 or fp32")
    p.add_argument("dst", help="directory to create")
    p.add_argument("--block", type=int, nargs=2, default=[128, 128], metavar=("OUT", "IN"),
                   help="weight_block_size over HF [out, in] weights (default 128 128)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)

    from glm53.config import GlmConfig
    from glm53.loader import check_checkpoint, resolve_config
    from glm53.safetensors_reader import SafetensorsCheckpoint

    try:
        cfg = GlmConfig.from_pretrained(args.src)
        ckpt = SafetensorsCheckpoint(args.src)
        if not cfg.quantization_config:  # every tensor present, of its shape and a float dtype
            full = resolve_config(args.src, ckpt)
            check_checkpoint(full, ckpt, include_mtp=full.num_mtp_layers > 0)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cfg.quantization_config:
        print(f"error: {args.src} is already quantised ({cfg.quantization_config.get('quant_method')})",
              file=sys.stderr)
        return 2
    if min(args.block) < 1:
        print("error: --block sizes must be >= 1", file=sys.stderr)
        return 2
    from glm53.output_dir import check_output_dir
    from glm53.safetensors_reader import CheckpointError

    try:
        check_output_dir(args.src, args.dst, overwrite=args.overwrite)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # Written next to DST and moved into place at the end: a failed run leaves nothing behind, and
    # --overwrite removes the old DST only once the new one is complete.
    tmp = f"{os.path.normpath(args.dst)}.partial-{os.getpid()}"
    os.makedirs(tmp)
    try:
        total, quantised, files, block = _write(args, ckpt, tmp)
    except (CheckpointError, ValueError, OSError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.exists(args.dst):
        shutil.rmtree(args.dst)
    os.replace(tmp, args.dst)
    print(f"wrote {args.dst}: {quantised} linears in FP8 ({block[0]}x{block[1]} blocks), "
          f"{total / 2**30:.3f} GiB in {len(files)} file(s)")
    return 0


def _write(args, ckpt, out_dir: str) -> tuple[int, int, list[str], tuple[int, int]]:
    """Write the quantised checkpoint into `out_dir` → (bytes, linears quantised, source files,
    block). Raises CheckpointError / ValueError for a source tensor that cannot be read."""
    import numpy as np
    from safetensors.numpy import save_file
    from tqdm import tqdm

    from glm53.quant import is_quantized_linear
    from kernels.fp8_matmul import quantize_fp8_blocks_np

    umask = os.umask(0)
    os.umask(umask)
    block = tuple(args.block)
    by_file: dict[str, list[str]] = {}
    for key in ckpt.keys():
        by_file.setdefault(ckpt.infos[key].file, []).append(key)
    files = sorted(by_file)
    weight_map, total, quantised = {}, 0, 0
    size = sum(os.path.getsize(f) for f in files)
    with tqdm(total=size, desc="quantising", unit="B", unit_scale=True, unit_divisor=1024,
              disable=args.no_progress) as bar:
        for i, path in enumerate(files):
            name = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
            out = {}
            for key in by_file[path]:
                w = ckpt.get(key)
                if is_quantized_linear(key, w.ndim):
                    out[key], out[key[: -len("weight")] + "weight_scale_inv"] = quantize_fp8_blocks_np(
                        np.asarray(w, np.float32), block)
                    quantised += 1
                else:
                    out[key] = np.array(w)
            save_file(out, os.path.join(out_dir, name))
            os.chmod(os.path.join(out_dir, name), 0o666 & ~umask)  # as any other file written here
            for k, v in out.items():
                weight_map[k] = name
                total += v.nbytes
            del out
            ckpt.release()
            bar.update(os.path.getsize(path))
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(args.src, "config.json")) as f:
        raw = json.load(f)
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    for name in os.listdir(args.src):
        full = os.path.join(args.src, name)
        if os.path.isfile(full) and not name.endswith(".safetensors") and name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy(full, os.path.join(out_dir, name))
    return total, quantised, files, block


if __name__ == "__main__":
    sys.exit(main())
