"""Capacity calculator: device-resident vs Hybrid HiSparse concurrency across sequence lengths.

Prints, for GLM-5.3 (or any `glm_moe_dsa` config), the per-token KV bytes, the reference
per-request figures, the sparse-MLA roofline, the weight bytes per GPU of the FP8 model under TP8
and under DP8 + EP8 (from the model's real parameter tree and the partition rules,
`glm53.weight_bytes`, with the KV room each leaves), and one table per deployment (the source
documents' 8×H200 deployments by default) across sequence lengths 8K … 1M; with `--out DIR` it also writes
`DIR/capacity.png`: concurrency vs sequence length, device-resident vs HiSparse at several
hot-buffer sizes (host pool assumed not to be the bottleneck, as in the reference calculator's
plot). The model behind the numbers is `glm53.capacity` (docs/design.md §9).

    python scripts/capacity.py                         # table for the reference deployments
    python scripts/capacity.py > docs/results/capacity.txt   # the committed output (a test checks it)
    python scripts/capacity.py --out /tmp/capacity     # + /tmp/capacity/capacity.png
    python scripts/capacity.py --deployment tp8-hisparse --host-pool-gib 256 --hot-multipliers 2,5

Options: `--model` (a preset name or a checkpoint directory; default glm-5.3), `--deployment`
(repeatable), `--lengths` (comma-separated tokens, K/M suffixes allowed), `--kv-cache-dtype`,
`--gpu-memory-utilization`, `--runtime-reserve-gib`, `--host-pool-gib`, `--hot-multipliers`
(the plot's hot-buffer sizes, in units of index_topk), `--admission-window` (tokens of the
admitted request held fully resident in the "chunked admission" column; default 32768, the
reference's max_num_batched_tokens), `--out`.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from glm53 import capacity as cap  # noqa: E402
from glm53.config import PRESETS, GlmConfig, preset  # noqa: E402

DEFAULT_LENGTHS = tuple(2**k for k in range(13, 21))  # 8K … 1M
PLOT_LENGTHS = tuple(int(2 ** (k / 4)) for k in range(40, 81))  # 1K … 1M, 4 points per octave


def parse_tokens(text: str) -> int:
    """'8K' → 8192, '1M' → 1048576, '142000' → 142000. Raises ValueError for anything else or a
    length < 1 (argparse turns it into an `error:` line naming the flag)."""
    t = text.strip().upper()
    mult = {"K": 2**10, "M": 2**20}.get(t[-1:], 1)
    try:
        n = int(float(t[:-1] if mult > 1 else t) * mult)
    except ValueError:
        raise ValueError(f"not a token count: {text!r} (e.g. 8K, 1M, 142000)") from None
    if n < 1:
        raise ValueError(f"a token count must be at least 1, got {text!r}")
    return n


def fmt_tokens(n: int) -> str:
    """8192 → '8K', 1048576 → '1M', 142000 → '142,000'."""
    for unit, size in (("M", 2**20), ("K", 2**10)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return f"{n:,}"


def load_config(name: str) -> GlmConfig:
    if name in PRESETS:
        return preset(name)
    return GlmConfig.from_pretrained(name)


def header(cfg: GlmConfig, name: str, kv_dtype: str) -> list[str]:
    kv = cap.kv_bytes_per_token(cfg, kv_dtype, with_mtp=True)
    n = cfg.max_position_embeddings
    req = cap.request_kv_bytes(cfg, n, kv_dtype)
    req8 = cap.request_kv_bytes(cfg, n, kv_dtype, dcp=8)
    lines = [
        f"{name}: {cfg.num_hidden_layers} layers ({len(cfg.full_layers)} with an indexer) + "
        f"{cfg.num_mtp_layers} MTP layer; KV {kv.kv_dtype} (MLA row {kv.mla_row} B, indexer key {kv.indexer_row} B)",
        f"  KV per token (MTP layer counted): {kv.formula()}",
        f"    under HiSparse: host {kv.num_layers + kv.num_mtp_layers}·{kv.mla_row} = {kv.sparse_mla:,} B, "
        f"device indexer {kv.num_indexer_layers + kv.num_mtp_layers}·{kv.indexer_row} = {kv.device_indexer:,} B",
        f"  one {n:,}-token request: {req:,} B = {req / cap.MiB:,.0f} MiB = {req / cap.GiB:.1f} GiB; "
        f"with DCP8: {req8 / cap.GiB:.1f} GiB per GPU",
    ]
    ridge = cap.H200.ridge_point
    rl = [cap.sparse_mla_roofline(cfg, h, kv_dtype) for h in (8, 64)]
    lines.append(
        f"  sparse-MLA roofline (top-{rl[0].topk}, {rl[0].row_bytes} B/row, {rl[0].head_bytes:,} B and "
        f"{rl[0].flops_per_row_head:,} FLOPs/row per head): "
        + "; ".join(f"{r.heads} heads {r.bytes / 1e6:.2f} MB {r.flops / 1e6:.1f} MFLOP = {r.intensity:.1f} FLOPs/B"
                    for r in rl)
        + f"; H200 ridge {cap.H200.bf16_flops / 1e12:.0f} TFLOP/s / {cap.H200.hbm_bandwidth / 1e12:.1f} TB/s "
          f"= {ridge:.0f} FLOPs/B")
    x8, x64 = (cap.indexer_crossover_tokens(cfg, h) for h in (8, 64))
    lines.append(f"  prefill FLOPs: indexer overtakes sparse MLA at ≈{x8 / 1e3:.1f}K tokens under TP8, "
                 f"≈{x64 / 1e3:.1f}K under PCP8 (plain FLOP count; the source quotes ≈32K / ≈256K)")
    return lines


def weights_table(cfg: GlmConfig, layouts: dict[str, cap.Deployment]) -> list[str]:
    """Weight bytes per GPU of each layout from the model's parameter tree (`cap.weight_bytes_per_gpu`,
    glm53.weight_bytes), split by kind (FP8 codes, their fp32 block scales, unquantised weights) and
    by part of the model, and the KV room each leaves (`cap.kv_room_per_gpu`). Sizes in GiB."""
    first = next(iter(layouts.values()))
    fmt = ("FP8 weights kept FP8 on the device (128×128 blocks; embeddings, head, norms, eh_proj in bf16, "
           "router and indexer weights_proj in fp32)" if first.checkpoint_dtype == "fp8" else "bf16 weights")
    out = [f"Weights per GPU from the model's parameter tree (glm53.weight_bytes, sharding/rules.py): {fmt}, "
           f"MTP layer {'counted' if first.with_mtp else 'not counted'}; "
           f"{first.num_gpus}×{first.accelerator.name}, util {first.gpu_memory_utilization:g}, "
           f"runtime reserve {first.runtime_reserve_bytes / cap.GiB:.1f} GiB (GiB per GPU unless marked)"]
    cols = ["layout", "weights", "fp8", "scales MiB", "unquant", "|", "experts", "attention", "mlp", "emb+head",
            "other", "|", "HBM×util", "KV room"]
    widths = [10, 8, 7, 10, 7, 1, 7, 9, 5, 8, 5, 1, 8, 7]
    out.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cols, widths))))
    g = lambda b: f"{b / cap.GiB:.2f}"  # noqa: E731
    for name, dep in layouts.items():
        try:
            total = cap.weight_bytes_per_gpu(cfg, dep.replace(weight_bytes_per_gpu=None))
            kind = cap.weight_bytes_breakdown_per_gpu(cfg, dep, by="kind")
            part = cap.weight_bytes_breakdown_per_gpu(cfg, dep, by="part")
        except ValueError as e:  # a layout this model's shapes or FP8 blocks cannot take
            out.append(f"{name:<12}  not shardable: {e}")
            continue
        room = cap.kv_room_per_gpu(cfg, dep.replace(weight_bytes_per_gpu=None))
        row = [name, g(total), g(kind["fp8"]), f"{kind['fp8_scales'] / cap.MiB:.1f}", g(kind["unquantised"]), "|",
               g(part["routed_experts"]), g(part["attention"]), g(part["mlp"]), g(part["embed_head"]),
               g(part["other"]), "|", g(dep.accelerator.hbm_bytes * dep.gpu_memory_utilization), g(room)]
        out.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
    out.append("fp8: float8_e4m3fn codes; scales MiB: their fp32 weight_scale_inv grids; unquant: weights kept in "
               "bf16/fp32; experts: routed experts; attention: MLA + indexer; mlp: dense MLP, shared experts, router. "
               "KV room = HBM × util − weights − runtime reserve. DP8 + EP8 splits the experts 8 ways like TP8 "
               "but replicates attention, dense/shared MLP and embeddings on every GPU.")
    return out


def table(cfg: GlmConfig, dep: cap.Deployment, lengths: list[int], window: int) -> list[str]:
    w = cap.weight_bytes_per_gpu(cfg, dep)
    p0 = cap.capacity(cfg, dep, lengths[0])
    hot_rows = p0.hot_bytes // cap.kv_bytes_per_token(cfg, dep.kv_cache_dtype, dep.with_mtp).sparse_mla
    lines = [
        f"== {dep.name}: {dep.describe()}",
        f"   per GPU: {dep.accelerator.hbm_bytes / cap.GiB:.1f} GiB HBM × {dep.gpu_memory_utilization:g} − weights "
        f"{w / cap.GiB:.1f} GiB ({dep.checkpoint_dtype} checkpoint) − runtime {dep.runtime_reserve_bytes / cap.GiB:.1f} "
        f"GiB = KV room {p0.kv_room_per_gpu / cap.GiB:.1f} GiB",
    ]
    has_host = dep.host_pool_bytes > 0
    if has_host:
        lines.append(f"   HiSparse per request: hot lease {hot_rows} rows = {p0.hot_bytes / cap.MiB:.1f} MiB, "
                     f"tail {cap.TAIL_PAGES} pages = {p0.tail_bytes / cap.MiB:.1f} MiB, + indexer; "
                     f"host pool {cap.host_pool_rounded(cfg, dep) / cap.GiB:.1f} GiB/replica")
    cols = ["seq len", "KV/req GiB", "KV/GPU GiB", "resident"]
    if has_host:
        cols += ["HS dev-bound", "HS host-bound", "HiSparse", "min host GiB", f"HS win {fmt_tokens(window)}"]
    if dep.indexer_offload_bytes:
        cols += ["idx-offload prefixes"]
    widths = [max(len(c), 8) for c in cols]
    lines.append("   " + "  ".join(c.rjust(wd) for c, wd in zip(cols, widths)))
    for n in lengths:
        p = cap.capacity(cfg, dep, n)
        row = [fmt_tokens(n), f"{p.request_bytes / cap.GiB:.2f}", f"{p.request_bytes_per_gpu / cap.GiB:.2f}",
               str(p.device_resident)]
        if has_host:
            pw = cap.capacity(cfg, dep.replace(prefill_window_tokens=window), n)
            row += [str(p.hisparse_device_bound), str(p.hisparse_host_bound), str(p.hisparse),
                    f"{p.min_host_pool_bytes * dep.dp / cap.GiB:.0f}", str(pw.hisparse)]
        if dep.indexer_offload_bytes:
            row += [str(p.indexer_offload_prefixes)]
        mark = " *" if n > dep.max_model_len else ""
        lines.append("   " + "  ".join(c.rjust(wd) for c, wd in zip(row, widths)) + mark)
    if any(n > dep.max_model_len for n in lengths):
        lines.append(f"   * beyond this deployment's --max-model-len {dep.max_model_len:,}")
    note = "   counts are requests per deployment (all DP replicas)"
    if has_host:
        note += ("; min host GiB: HiSparse pool (all replicas) that keeps the host from limiting; "
                 f"HS win {fmt_tokens(window)}: HiSparse when only that admission window of the new request "
                 "must be resident")
    lines.append(note)
    return lines


def plot(cfg: GlmConfig, deps: list[cap.Deployment], multipliers: list[int], window: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    fig, axes = plt.subplots(1, len(deps), figsize=(7.5 * len(deps), 5.6), squeeze=False)
    colors = plt.get_cmap("viridis")
    for ax, dep in zip(axes[0], deps):
        xs = list(PLOT_LENGTHS)

        def series(d, attr):
            ys = [getattr(cap.capacity(cfg, d, n), attr) for n in xs]
            return [y if y > 0 else float("nan") for y in ys]

        ax.plot(xs, series(dep, "device_resident"), color="black", lw=2.5, label="device-resident")
        for i, m in enumerate(multipliers):
            d = dep.replace(hot_buffer_multiplier=m)
            c = colors(0.15 + 0.7 * i / max(1, len(multipliers) - 1))
            ax.plot(xs, series(d, "hisparse_device_bound"), color=c, lw=2,
                    label=f"HiSparse, hot {m}×top-k ({m * (dep.index_topk or cfg.index_topk):,} rows)")
        d2 = dep.replace(hot_buffer_multiplier=2, prefill_window_tokens=window)
        ax.plot(xs, series(d2, "hisparse_device_bound"), color=colors(0.15 + 0.7 * (
            multipliers.index(2) / max(1, len(multipliers) - 1) if 2 in multipliers else 0)), lw=1.5, ls="--",
                label=f"HiSparse, hot 2×top-k, admission window {fmt_tokens(window)}")
        if dep.max_model_len < xs[-1]:
            ax.axvline(dep.max_model_len, color="grey", lw=1, ls=":")
            ax.text(dep.max_model_len, 0.98, f" max-model-len {fmt_tokens(dep.max_model_len)}", color="grey",
                    transform=ax.get_xaxis_transform(), va="top", fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ticks = [2**k for k in range(10, 21)]
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: fmt_tokens(int(v))))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xlabel("sequence length (tokens per request)")
        ax.set_ylabel("concurrent requests (whole deployment)")
        room = cap.kv_room_per_gpu(cfg, dep) / cap.GiB
        ax.set_title(f"{dep.name}: {dep.num_gpus}×{dep.accelerator.name}, KV room {room:.1f} GiB/GPU\n"
                     f"{cap.kv_bytes_per_token(cfg, dep.kv_cache_dtype, dep.with_mtp).total:,} B/token "
                     f"({cap.normalize_kv_dtype(dep.kv_cache_dtype)}); host pool not limiting", fontsize=11)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=9, loc="lower left", framealpha=0.9)
    fig.suptitle("GLM-5.3 concurrency: device-resident vs Hybrid HiSparse (glm53.capacity, docs/design.md §9); "
                 "a line ends where not even one request fits", fontsize=13)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def layouts_table(cfg: GlmConfig, seq_len: int, changes: dict | None = None) -> list[str]:
    """Hybrid HiSparse on one 8×H200 node three ways (`glm53.capacity.hisparse_layouts`) at
    `seq_len`-token contexts: KV room, per-device footprints and the requests each bound allows.
    `changes`: the user's `Deployment` fields (KV dtype, utilisation, reserve, host pool per
    replica) applied to every layout; none = the reference sizes."""
    layouts = {name: d.replace(**(changes or {})) for name, d in cap.hisparse_layouts(seq_len).items()}
    first = next(iter(layouts.values()))
    sizes = (f"FP8 weights, {cap.normalize_kv_dtype(first.kv_cache_dtype)} KV, MTP{first.num_speculative_tokens}, "
             f"util {first.gpu_memory_utilization:g}" + (", the flags given" if changes else ", reference sizes"))
    out = [f"Hybrid HiSparse across layouts, {fmt_tokens(seq_len)}-token contexts, one 8×H200 node "
           f"({sizes}, hot lease 2 × top-k; planner, glm53.capacity.capacity)",
           f"{'layout':<24}{'KV room/GPU':>12}{'resident':>9}{'first/GPU':>11}{'steady/GPU':>11}{'hot/GPU':>9}"
           f"{'dev-bound':>10}{'host pool':>11}{'host-bound':>11}{'HiSparse':>9}{'pool for dev-bound':>20}"]
    for name, d in layouts.items():
        try:
            p = cap.capacity(cfg, d, seq_len)
        except ValueError as e:  # the model's shapes or FP8 blocks do not fit this layout
            out.append(f"{name:<24}not shardable: {e}")
            continue
        gib = lambda b: f"{b / cap.GiB:.2f}G"  # noqa: E731
        out.append(f"{name:<24}{gib(p.kv_room_per_gpu):>12}{p.device_resident:>9}{gib(p.first_bytes):>11}"
                   f"{gib(p.steady_bytes):>11}{gib(p.hot_bytes):>9}{p.hisparse_device_bound:>10}"
                   f"{gib(d.host_pool_bytes) + ('/rep' if d.dp > 1 else ''):>11}{p.hisparse_host_bound:>11}"
                   f"{p.hisparse:>9}{gib(p.min_host_pool_bytes) + ('/rep' if d.dp > 1 else ''):>20}")
    out.append("first/steady/hot: bytes per device of the admitted request and of each other request; under DCP a "
               "rank holds 1/8 of every context but a whole hot buffer (any rank may own a request's whole "
               "top-k). Counts are for the node (DP: 8 replicas).")
    return out


def _kv_dtype_arg(text: str) -> str:
    try:
        return cap.normalize_kv_dtype(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="glm-5.3",
                    help=f"preset name ({', '.join(sorted(PRESETS))}) or checkpoint directory (default glm-5.3)")
    refs = cap.reference_deployments()
    ap.add_argument("--deployment", action="append", choices=sorted(refs),
                    help="reference deployment(s) to show (default: all)")
    ap.add_argument("--lengths", default=None, help="comma-separated sequence lengths (default 8K,16K,…,1M)")
    ap.add_argument("--kv-cache-dtype", default=None, type=_kv_dtype_arg,
                    help="fp8 (default), bf16 or fp32; the server's spellings (bfloat16, float32, auto = bf16, "
                         "fp8_ds_mla) are accepted too")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None)
    ap.add_argument("--runtime-reserve-gib", type=float, default=None)
    ap.add_argument("--host-pool-gib", type=float, default=None, help="HiSparse host pool per DP replica")
    ap.add_argument("--hot-multipliers", default="1,2,3,5", help="plot's hot-buffer sizes in units of index_topk")
    ap.add_argument("--admission-window", type=parse_tokens, default=32768)
    ap.add_argument("--out", default=None, help="directory for capacity.png")
    ap.add_argument("--layouts-length", type=parse_tokens, default=1_048_576,
                    help="context length of the HiSparse-across-layouts table (default 1M)")
    args = ap.parse_args(argv)
    try:
        return _run(args, refs)
    except (ValueError, OSError) as e:  # a bad flag value, a missing checkpoint or output directory
        ap.error(str(e))


def _run(args, refs) -> int:
    if args.model not in PRESETS and not os.path.isfile(os.path.join(args.model, "config.json")):
        raise ValueError(f"--model {args.model!r}: not a preset ({', '.join(sorted(PRESETS))}) or a checkpoint "
                         "directory with a config.json")
    try:
        lengths = sorted({parse_tokens(x) for x in args.lengths.split(",")} if args.lengths else set(DEFAULT_LENGTHS))
        multipliers = [int(m) for m in args.hot_multipliers.split(",")]
    except ValueError as e:
        raise ValueError(f"--lengths / --hot-multipliers: {e}") from None
    if any(m < 1 for m in multipliers):
        raise ValueError(f"--hot-multipliers must be positive integers, got {args.hot_multipliers!r}")
    cfg = load_config(args.model)
    names = args.deployment or list(refs)
    changes = {}
    if args.kv_cache_dtype:
        changes["kv_cache_dtype"] = args.kv_cache_dtype
    if args.gpu_memory_utilization is not None:
        changes["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.runtime_reserve_gib is not None:
        changes["runtime_reserve_bytes"] = int(args.runtime_reserve_gib * cap.GiB)
    if args.host_pool_gib is not None:
        changes["host_pool_bytes"] = int(args.host_pool_gib * cap.GiB)
    try:
        deps = [refs[name].replace(**changes) for name in names]
    except ValueError as e:  # the planner's own check of the sizes
        raise ValueError(f"--gpu-memory-utilization / --runtime-reserve-gib / --host-pool-gib: {e}") from None
    kv_dtype = args.kv_cache_dtype or "fp8"

    out = header(cfg, args.model, kv_dtype)
    out += [""] + weights_table(cfg, {"TP8": refs["tp8-hisparse"].replace(**changes),
                                      "DP8 + EP8": refs["dp8-decode"].replace(**changes)})
    for d in deps:
        rows = sorted(set(lengths) | ({d.max_model_len} if d.max_model_len < lengths[-1] else set()))
        try:
            out += [""] + table(cfg, d, rows, args.admission_window)
        except ValueError as e:  # the model's shapes or FP8 blocks do not fit this layout
            out += ["", f"== {d.name}: {d.describe()}", f"   not shardable: {e}"]
    out += [""] + layouts_table(cfg, args.layouts_length, changes)
    print("\n".join(out))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "capacity.png")
        plot_deps = [d for d in deps if d.host_pool_bytes > 0] or deps
        plot(cfg, plot_deps, multipliers, args.admission_window, path)
        print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
