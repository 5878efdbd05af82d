"""Capacity planner and roofline model (glm53.capacity): the reference figures of docs/design.md §3.4 and
§9 recomputed from the config, the concurrency formulas on hand-made budgets, the engine-unit
predictions against the arena layout, and a real engine filled with equal-length requests whose
number running at once must match the prediction."""

import json
import logging
import math
import struct

import pytest

from glm53 import capacity as cap
from glm53.config import GlmConfig, preset
from glm53.kv_layout import build_kv_layout

GLM53 = preset("glm-5.3")
TINY = preset("tiny")
MIB, GIB = 2**20, 2**30


# ----------------------------------------------------------------------------- reference figures

def test_per_token_kv_bytes_reference_54728():
    kv = cap.kv_bytes_per_token(GLM53, "fp8")
    assert kv.mla_row == 512 + 4 * 512 // 128 + 2 * 64 == 656
    assert kv.indexer_row == 128 + 4 == 132
    assert (kv.num_layers, kv.num_indexer_layers, kv.num_mtp_layers) == (78, 21, 1)
    assert kv.mtp == 656 + 132 == 788
    assert kv.total == 78 * 656 + 21 * 132 + 788 == 54_728
    assert kv.formula() == "78·656 + 21·132 + 788 = 54,728 B"
    # HiSparse split (docs/design.md §9): host 79 · 656, device indexer 22 · 132.
    assert kv.sparse_mla == 79 * 656 == 51_824 and kv.device_indexer == 22 * 132 == 2_904
    assert kv.sparse_mla + kv.device_indexer == kv.total
    assert cap.kv_bytes_per_token(GLM53, "fp8", with_mtp=False).total == 54_728 - 788


def test_other_kv_dtypes_and_aliases():
    bf16 = cap.kv_bytes_per_token(GLM53, "bf16")
    assert (bf16.mla_row, bf16.indexer_row) == (1152, 256)
    fp32 = cap.kv_bytes_per_token(GLM53, "float32")
    assert (fp32.mla_row, fp32.indexer_row) == (2304, 512)
    assert cap.normalize_kv_dtype("fp8_ds_mla") == "fp8" and cap.normalize_kv_dtype("auto") == "bf16"
    with pytest.raises(ValueError, match="unknown KV cache dtype"):
        cap.mla_row_bytes(GLM53, "int4")
    with pytest.raises(ValueError, match="multiple of 128"):
        cap.mla_row_bytes(GLM53.replace(kv_lora_rank=96), "fp8")


def test_million_token_request_53_4_gib_and_dcp8_6_7_gib():
    n = 1_048_576
    b = cap.request_kv_bytes(GLM53, n, "fp8")
    assert b == 54_728 * MIB  # 54,728 MiB (source)
    assert round(b / GIB, 1) == 53.4
    per_dev = cap.request_kv_bytes(GLM53, n, "fp8", dcp=8)
    assert per_dev * 8 == b and round(per_dev / GIB, 1) == 6.7


def test_roofline_26_and_191_flops_per_byte_and_h200_ridge_206():
    tp8 = cap.sparse_mla_roofline(GLM53, heads=8)
    pcp = cap.sparse_mla_roofline(GLM53, heads=64)
    assert tp8.row_bytes == 660 and tp8.head_bytes == 2_176 and tp8.flops_per_row_head == 2_176
    assert tp8.topk * tp8.row_bytes == 1_351_680  # ≈1.35 MB of rows per query (source)
    assert round(tp8.bytes / 1e6, 2) == 1.37 and round(tp8.flops / 1e6, 1) == 35.7
    assert round(pcp.bytes / 1e6, 2) == 1.49 and round(pcp.flops / 1e6) == 285
    assert round(tp8.intensity) == 26
    assert round(pcp.intensity) == 191
    assert round(cap.H200.ridge_point) == 206
    assert tp8.intensity < pcp.intensity < cap.H200.ridge_point


def test_indexer_crossover_counting_rule():
    tp8 = cap.indexer_crossover_tokens(GLM53, heads_per_device=8)
    pcp8 = cap.indexer_crossover_tokens(GLM53, heads_per_device=64)
    assert tp8 == 2048 * 2176 * 8 / (32 * 128) == 8704  # ≈8.7K (docs/design.md §9)
    assert pcp8 == 69_632 and pcp8 / tp8 == 8  # ≈70K; the 8× ratio of the source


# ----------------------------------------------------------------------------- concurrency formulas

def _dep(room: int, **kw) -> cap.Deployment:
    """A deployment whose KV room per device is exactly `room` bytes."""
    acc = cap.Accelerator("test", hbm_bytes=room + 10 * GIB, bf16_flops=1e15, hbm_bandwidth=1e12)
    base = dict(accelerator=acc, num_gpus=1, tp=1, gpu_memory_utilization=1.0, weight_bytes_per_gpu=10 * GIB,
                runtime_reserve_bytes=0, kv_cache_dtype="fp8", num_speculative_tokens=1)
    base.update(kw)
    return cap.Deployment(**base)


def test_device_resident_and_hisparse_formulas_match_design_section_9():
    room, L = 40 * GIB, 100_000
    dep = _dep(room, hot_buffer_multiplier=2, host_pool_bytes=300 * GIB, indexer_offload_bytes=64 * GIB)
    p = cap.capacity(GLM53, dep, L)
    assert p.kv_room_per_gpu == room
    assert p.device_resident == room // (L * 54_728)
    hot = 2 * 2048 * 656 * 79
    tail = 2 * 64 * 51_824
    assert (p.hot_bytes, p.tail_bytes) == (hot, tail)
    dev = 1 + (room - (L * 54_728 + hot)) // (L * 2_904 + hot + tail)
    assert p.hisparse_device_bound == dev
    pool = math.ceil(300 * GIB / (64 * 51_824)) * 64 * 51_824  # rounded up to whole host blocks
    assert p.hisparse_host_bound == pool // (L * 51_824)
    assert p.hisparse == min(dev, p.hisparse_host_bound)
    assert p.hybrid == max(p.device_resident, p.hisparse)
    assert p.min_host_pool_bytes >= dev * L * 51_824 > p.min_host_pool_bytes - 64 * 51_824
    assert p.indexer_offload_prefixes == 64 * GIB // (L * 2_904)
    # The hot-buffer default follows the speculation: (num_speculative_tokens + 2) × top-k rows.
    assert _dep(room, num_speculative_tokens=3).hot_multiplier == 5
    assert _dep(room, num_speculative_tokens=0).hot_multiplier == 2


def test_hisparse_needs_the_admitted_request_resident_and_short_contexts_favour_residency():
    dep = _dep(20 * GIB, hot_buffer_multiplier=2, host_pool_bytes=1 << 50)
    L = 1_048_576
    # Admitting it fully resident: 53.4 GiB do not fit 20 GiB, so nothing runs.
    long = cap.capacity(GLM53, dep.replace(prefill_window_tokens=L), L)
    assert long.device_resident == 0 and long.hisparse_device_bound == 0
    # The engine's rule: an in-flight window of two 32K chunks (all groups, 54,728 B/token with the
    # MTP layer), the rest of the context's indexer keys (22 x 132 B), and a prefill hot buffer of
    # 16 x 2048 rows of the 79 sparse-MLA layers (51,824 B per row); the others at their steady
    # footprint: indexer keys, a 2 x 2048-row lease and two tail pages.
    auto = cap.capacity(GLM53, dep, L)
    W = 2 * 32_768
    first = W * 54_728 + (L - W) * 2_904 + 16 * 2048 * 51_824
    steady = L * 2_904 + 2 * 2048 * 51_824 + 2 * 64 * 51_824
    assert auto.first_bytes == first and auto.steady_bytes == steady
    assert auto.hisparse_device_bound == 1 + (20 * GIB - first) // steady >= 4
    short = cap.capacity(GLM53, dep, 2_048)  # the fixed hot lease costs more than a short request
    assert short.device_resident > short.hisparse_device_bound
    mid = cap.capacity(GLM53, dep, 65_536)
    assert mid.hisparse_device_bound > mid.device_resident
    assert cap.capacity(GLM53, dep.replace(host_pool_bytes=0), 65_536).hisparse == 0


def test_parallel_layout_dcp_shards_and_dp_replicates():
    room, L = 16 * GIB, 262_144
    one = cap.capacity(GLM53, _dep(room), L)
    dcp8 = cap.capacity(GLM53, _dep(room, num_gpus=8, tp=1, pcp=8, dcp=8), L)
    assert dcp8.request_bytes_per_gpu * 8 == one.request_bytes_per_gpu == L * 54_728
    assert dcp8.device_resident == room // (L // 8 * 54_728)
    dp8 = cap.capacity(GLM53, _dep(room, num_gpus=8, tp=1, dp=8), L)
    assert dp8.device_resident == 8 * one.device_resident
    with pytest.raises(ValueError, match="num_gpus"):
        _dep(room, num_gpus=8, tp=4)
    with pytest.raises(ValueError, match="dcp"):
        _dep(room, num_gpus=8, tp=8, dcp=3)


def test_hisparse_under_dcp_keeps_a_whole_hot_buffer_per_rank():
    """The combined formula (bytes per device): under DCP N a request's KV per device shrinks N×
    but every rank keeps a whole hot buffer (any rank may own a request's whole top-k), so the
    steady footprint is ⌈L/N⌉·B_idx + hot + tail with hot and tail unchanged; the host bound is
    per replica and does not change. At 1M tokens on the reference node TP8 × DCP8 admits more
    requests on the device than TP8, and the layouts table shows all three."""
    L = 1_048_576
    lay = cap.hisparse_layouts(L)
    tp8, dcp8, dp8 = (cap.capacity(GLM53, d, L) for d in lay.values())
    kv = cap.kv_bytes_per_token(GLM53, "fp8", with_mtp=True)
    assert dcp8.hot_bytes == tp8.hot_bytes == 4096 * kv.sparse_mla  # 2 × top-k rows, not divided by 8
    assert dcp8.steady_bytes == math.ceil(L / 8) * kv.device_indexer + dcp8.hot_bytes + dcp8.tail_bytes
    assert tp8.steady_bytes == L * kv.device_indexer + tp8.hot_bytes + tp8.tail_bytes
    assert dcp8.hisparse_device_bound > 4 * tp8.hisparse_device_bound
    assert dcp8.hisparse_host_bound == tp8.hisparse_host_bound  # the same 384 GiB pool per replica
    assert dcp8.hisparse == min(dcp8.hisparse_device_bound, dcp8.hisparse_host_bound)
    assert dp8.hisparse_host_bound == 0  # 48 GiB per replica holds no 1M-token request


@pytest.mark.parametrize("dcp", [1, 2, 4])
def test_engine_unit_hisparse_lease_under_dcp_matches_the_policy(dcp):
    """Engine units: under DCP a leased engine page is a 64-row page on each rank, so a lease of
    `device_buffer_size` rows per rank is ⌈rows / 64⌉ engine pages — the policy's `dec_pages` —
    and the planner (`hot_tokens_per_page=64`) counts the same."""
    from serving.block_pool import BlockPool
    from serving.hisparse import HiSparseConfig, HiSparsePolicy
    from serving.hisparse.host_pool import HostPool
    from serving.kv_cache import KVCacheGroupSpec, KVCacheManager

    lay = build_kv_layout(TINY, "float32", with_mtp=False)
    kv = KVCacheManager(BlockPool(64), [KVCacheGroupSpec(g.name, g.tokens_per_page * dcp) for g in lay.groups])
    resolved = HiSparseConfig(1.0, device_buffer_size=192).resolve(index_topk=64, tokens_per_page=64)
    policy = HiSparsePolicy(kv, HostPool(100), resolved, 64, hot_tpp=64)
    plan = cap.predict_hisparse_requests(kv, 64, 2048, 192, hot_tokens_per_page=64)
    assert policy.dec_pages == plan.hot_pages == 3
    assert plan.steady_pages == math.ceil(2048 / (768 * dcp)) + 3 + cap.TAIL_PAGES


def test_checkpoint_weight_bytes_match_the_tiny_checkpoint_on_disk():
    from glm53.tiny_checkpoint import default_model_dir

    d = default_model_dir()
    with open(d / "model.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    on_disk = sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
    w = cap.checkpoint_weight_bytes(GlmConfig.from_pretrained(d), "bf16")
    assert w.total == on_disk
    assert w.per_device(1, 1) == w.total


def test_reference_deployments_weights_and_kv_room():
    full_fp8 = cap.checkpoint_weight_bytes(GLM53, "fp8")
    assert 690 * GIB < full_fp8.total < 720 * GIB  # ~744B parameters at ~1 byte
    assert full_fp8.expert_sharded > 0.95 * full_fp8.total
    refs = cap.reference_deployments()
    prefill = refs["pcp8-dcp8-prefill"]
    room = cap.kv_room_per_gpu(GLM53, prefill)
    assert round(room / GIB) == 15  # "each GPU holds only about 15 GiB" (source)
    # A 1M-token request fits the PCP8 × DCP8 prefill engine only because DCP8 shards it.
    assert cap.capacity(GLM53, prefill, 1_048_576).device_resident >= 1
    assert cap.capacity(GLM53, prefill.replace(dcp=1), 1_048_576).device_resident == 0
    tp8 = refs["tp8-hisparse"]
    assert cap.weight_bytes_per_gpu(GLM53, tp8) < cap.weight_bytes_per_gpu(GLM53, prefill)  # attention TP-split
    # Per device from the model's parameter tree (tests/glm53/test_weight_bytes.py): FP8 kept on the
    # device, TP8 ≈ total / 8 + the replicated embeddings, latent projections, indexer and norms.
    assert 89 * GIB < cap.weight_bytes_per_gpu(GLM53, tp8) < 94 * GIB
    assert cap.weight_bytes_per_gpu(GLM53, refs["dp8-decode"]) == cap.weight_bytes_per_gpu(GLM53, prefill)
    p = cap.capacity(GLM53, tp8, tp8.max_model_len)
    assert p.hisparse > p.device_resident >= 1


def test_cli_prints_reference_figures_and_writes_png(tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "capacity.py"
    spec = importlib.util.spec_from_file_location("capacity_cli", path)
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    assert cli.main(["--out", str(tmp_path), "--hot-multipliers", "2,5"]) == 0
    out = capsys.readouterr().out
    assert "78·656 + 21·132 + 788 = 54,728 B" in out
    assert "53.4 GiB" in out and "6.7 GiB per GPU" in out
    assert "26.0 FLOPs/B" in out and "191.3 FLOPs/B" in out and "= 206 FLOPs/B" in out
    for name in cap.reference_deployments():
        assert f"== {name}:" in out
    # Weight bytes per GPU of the FP8 model under TP8 and DP8 + EP8, from the parameter tree.
    assert "Weights per GPU from the model's parameter tree" in out
    refs = cap.reference_deployments()
    for label, dep in (("TP8", refs["tp8-hisparse"]), ("DP8 + EP8", refs["dp8-decode"])):
        row = next(line for line in out.splitlines() if line.startswith(label + "  "))
        cells = row[len(label):].split()
        assert cells[0] == f"{cap.weight_bytes_per_gpu(GLM53, dep) / GIB:.2f}"
        assert cells[-1] == f"{cap.kv_room_per_gpu(GLM53, dep) / GIB:.2f}"
    png = tmp_path / "capacity.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Every table follows the flags, the HiSparse-across-layouts one included (it used to keep the
    # reference sizes whatever was given)
    assert cli.main(["--kv-cache-dtype", "bfloat16", "--gpu-memory-utilization", "0.85"]) == 0  # the server's spelling
    out = capsys.readouterr().out
    head = next(line for line in out.splitlines() if line.startswith("Hybrid HiSparse across layouts"))
    assert "bf16 KV" in head and "util 0.85, the flags given" in head, head
    row = next(line for line in out.splitlines() if line.startswith("TP8 + HiSparse "))
    tp8 = refs["tp8-hisparse"].replace(kv_cache_dtype="bf16", gpu_memory_utilization=0.85, max_model_len=2**20)
    assert row.split()[3] == f"{cap.kv_room_per_gpu(GLM53, tp8) / GIB:.2f}G", row
    # A user's mistakes are an argparse error naming the flag and exit 2, not a traceback
    for argv, words in ((["--model", str(tmp_path / "nope")], "not a preset (glm-5.3, tiny, tiny-recall)"),
                        (["--lengths", "8Q"], "not a token count: '8Q'"),
                        (["--lengths", "0,8K"], "at least 1"),
                        (["--hot-multipliers", "abc"], "--hot-multipliers"),
                        (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization must be in (0, 1]"),
                        (["--host-pool-gib", "-3"], "--host-pool-gib"),
                        (["--out", str(png / "sub")], "capacity.png"),
                        (["--kv-cache-dtype", "nope"], "unknown KV cache dtype 'nope'")):
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and "error:" in err and words in err and "Traceback" not in err, (argv, err)


# ----------------------------------------------------------------------------- engine units

def test_library_bytes_agree_with_the_arena_layout():
    for cfg in (TINY, GLM53):
        for row, kvd in (("float32", "fp32"), ("bfloat16", "bf16")):
            lay = build_kv_layout(cfg, row, with_mtp=True)
            kv = cap.kv_bytes_per_token(cfg, kvd, with_mtp=True)
            got = {g.name: g.bytes_per_token for g in lay.groups}
            assert got == {"mla": kv.mla + kv.mtp_mla, "indexer": kv.indexer + kv.mtp_indexer}
            assert sum(got.values()) == kv.total


def test_engine_unit_predictions():
    lay = build_kv_layout(TINY, "float32", with_mtp=False)
    tpp = {g.name: g.tokens_per_page for g in lay.groups}
    assert tpp["mla"] == 64 and tpp["indexer"] > 64
    assert cap.pages_per_request(lay, 161) == {"mla": 3, "indexer": 1}
    assert cap.predict_device_resident_requests(lay, 26, 161) == 25 // 4
    assert cap.predict_device_resident_requests(lay, 26, 384) == 25 // 7
    assert cap.predict_device_resident_requests(lay, 4, 384) == 0
    # HiSparse in pages: 2 hot pages (128 rows), 2 tail pages, indexer resident.
    plan = cap.predict_hisparse_requests(lay, 101, 384, hot_rows=128, host_blocks=30)
    assert (plan.first_pages, plan.steady_pages, plan.hot_pages) == (7 + 2, 1 + 2 + 2, 2)
    assert plan.device_bound == 1 + (100 - 9) // 5
    assert plan.host_bound == 30 // 6 and plan.requests == 5
    msg = cap.engine_capacity_summary(lay, 26, 384, max_num_seqs=2)
    assert "3 requests of 384 tokens" in msg and "= 2" in msg


@pytest.mark.parametrize("dcp, dp", [(2, 1), (4, 1), (1, 2), (2, 2)])
def test_capacity_line_uses_the_parallel_layout(dcp, dp):
    """Under DCP an engine page spans tpp × dcp tokens, and each DP replica has its own pool:
    the start-up line counts the requests a replica's real allocator (`KVCacheManager` with the
    engine's group specs, as `LLMEngine` builds them) admits one after another, times dp — not
    the single-device figure (which said "14 requests of 4096" under TP2 × DCP2)."""
    from serving.block_pool import BlockPool
    from serving.kv_cache import KVCacheGroupSpec, KVCacheManager

    lay = build_kv_layout(TINY, "float32", with_mtp=False)
    L, nblocks = 384, 26
    kv = KVCacheManager(BlockPool(nblocks), [KVCacheGroupSpec(g.name, g.tokens_per_page * dcp) for g in lay.groups])
    admitted = 0
    while kv.can_allocate(f"r{admitted}", L):
        kv.allocate_slots(f"r{admitted}", L)
        admitted += 1
    single = cap.predict_device_resident_requests(lay, nblocks, L)
    msg = cap.engine_capacity_summary(lay, nblocks, L, max_num_seqs=64, dcp=dcp, dp=dp)
    assert f"{admitted * dp} requests of {L} tokens" in msg, msg
    if dcp > 1:
        assert admitted > single and f"DCP {dcp}" in msg
    assert f"= {admitted * dp}" in msg


# ----------------------------------------------------------------------------- the real engine

class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def engine_and_log():
    from serving.engine import EngineArgs
    from serving.engine_factory import build_engine

    h = _Capture()
    lg = logging.getLogger("serving.engine")
    old = lg.level
    lg.setLevel(logging.INFO)
    lg.addHandler(h)
    try:
        engine = build_engine(EngineArgs(model=None, max_num_seqs=16, max_num_batched_tokens=64,
                                                cuda_graph_sizes=[], precompile_token_paddings=[], max_model_len=384, num_gpu_blocks_override=26,
                                                compile_progress=False))
    finally:
        lg.removeHandler(h)
        lg.setLevel(old)
    return engine, h.messages


def _fill(engine, tag: str, length: int, prompt_len: int, n: int) -> tuple[int, int]:
    """Submit n requests of prompt_len + max_tokens = length tokens, run them all; returns the
    most requests running at once before the first preemption, and the preemptions."""
    from serving.types import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=length - prompt_len, ignore_eos=True)
    for i in range(n):
        engine.add_request(f"{tag}-{i}", [(7 * i + j) % 400 + 10 for j in range(prompt_len)], sp)
    pre0 = engine.scheduler.num_preemptions_total
    most, finished = 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished += out.finished
        if engine.scheduler.num_preemptions_total == pre0:
            most = max(most, engine.scheduler.num_requests_running)
    assert finished == n
    return most, engine.scheduler.num_preemptions_total - pre0


@pytest.mark.parametrize(
    "length, prompt_len",
    [
        (161, 129),  # 3 MLA pages + 1 indexer page, the prompt already holds them all
        (384, 321),  # the engine's own --max-model-len: 6 + 1 pages
    ],
)
def test_engine_runs_as_many_equal_requests_as_predicted(engine_and_log, length, prompt_len):
    engine, messages = engine_and_log
    pool = engine.pool
    predicted = cap.predict_device_resident_requests(engine.layout, pool.num_blocks, length)
    assert 3 <= predicted < engine.args.max_num_seqs
    most, preemptions = _fill(engine, f"L{length}", length, prompt_len, predicted + 2)
    print(f"L={length}: predicted {predicted}, observed {most} running at once, {preemptions} preemptions")
    # Admission checks only a request's first prefill chunk, so one more request than fits may
    # start before the first preemption: hence ±1.
    assert abs(most - predicted) <= 1
    assert engine.audit() == []
    assert pool.num_free == pool.num_usable_blocks
    if length == engine.args.max_model_len:
        line = cap.engine_capacity_summary(engine.layout, pool.num_blocks, length, engine.args.max_num_seqs)
        assert line in messages and f"{predicted} requests of {length} tokens" in line


def test_hisparse_page_plan_admits_a_context_longer_than_the_pool_with_a_window():
    """Engine units (`predict_hisparse_requests`): a context whose pages exceed the whole pool
    gives 0 under full residency, and under the engine's in-flight window the window's MLA pages
    (two 64-token chunks), two tail pages, the larger of the decode and prefill hot buffers and the
    indexer pages of the whole context."""
    lay = build_kv_layout(TINY, "float32", with_mtp=False)
    L, nblocks = 20_000, 101  # 313 MLA + 27 indexer pages > 100 usable
    plain = cap.predict_hisparse_requests(lay, nblocks, L, hot_rows=128)
    assert plain.device_bound == 0
    win = cap.predict_hisparse_requests(lay, nblocks, L, hot_rows=128, window_tokens=128, prefill_hot_rows=1024)
    idx = -(-L // lay.group("indexer").tokens_per_page)
    assert win.first_pages == idx + 2 + 2 + 16
    assert win.steady_pages == idx + 2 + 2
    assert win.device_bound == 1 + (100 - win.first_pages) // win.steady_pages


def test_a_pool_smaller_than_one_request_warns_at_start_up(caplog):
    """Without HiSparse a pool that cannot hold one --max-model-len request shortens the context
    the server reports and checks; the start-up log says so, with the length it will serve and the
    flags that change it (HiSparse's own bound has its own warning: test_hisparse_policy.py)."""
    from serving.engine import EngineArgs
    from serving.engine_factory import build_engine

    with caplog.at_level(logging.WARNING, logger="serving.engine"):
        engine = build_engine(EngineArgs(max_num_seqs=4, max_num_batched_tokens=64, cuda_graph_sizes=[],
                                         precompile_token_paddings=[], max_model_len=1024, num_gpu_blocks_override=10,
                                         compile_progress=False, skip_precompile=True))
    eff = engine.effective_max_model_len
    assert eff < 1024
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"at most {eff} tokens" in m and "--max-model-len is 1024" in m and "--num-gpu-blocks-override" in m
               for m in warnings), warnings
