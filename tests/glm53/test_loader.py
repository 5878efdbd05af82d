"""Checkpoint loading: FP8 block-scaled weights, sharded/single files, and clear errors."""

import json
import os
import shutil

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy as stn

from glm53 import api
from glm53.loader import dequantize_fp8_block
from glm53.safetensors_reader import CheckpointError, SafetensorsCheckpoint
from tests.helpers.fp8_checkpoint import is_quantised

DENSE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf", "dense")


def _tensors(path):
    ck = SafetensorsCheckpoint(path)
    return {k: np.array(ck.get(k)) for k in ck.keys()}


def _write(dirpath, tensors, config_changes=None):
    os.makedirs(dirpath, exist_ok=True)
    with open(os.path.join(DENSE, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(config_changes or {})
    with open(os.path.join(dirpath, "config.json"), "w") as f:
        json.dump(cfg, f)
    stn.save_file(tensors, os.path.join(dirpath, "model.safetensors"))
    return dirpath


def test_fp8_block_scaled_checkpoint_loads_as_its_dequantised_values(tmp_path):
    """Quantise the fixture to e4m3 with 128x128 block scales; the model built from it must equal
    the model built from an fp32 checkpoint holding fp8 x scale computed here with numpy."""
    src = _tensors(DENSE)
    fp8, deq = {}, {}
    rng = np.random.default_rng(0)
    for k, w in src.items():
        if is_quantised(k, w):
            w32 = w.astype(np.float32)
            out, inn = w32.shape
            sb = np.zeros((-(-out // 128), -(-inn // 128)), np.float32)
            q = np.zeros_like(w32)
            for i in range(sb.shape[0]):
                for j in range(sb.shape[1]):
                    blk = w32[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
                    s = max(np.abs(blk).max() / 448.0, 1e-12) * (1 + rng.random())  # non-trivial scales
                    sb[i, j] = s
                    q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = blk / s
            q8 = q.astype(ml_dtypes.float8_e4m3fn)
            fp8[k], fp8[k[: -len("weight")] + "weight_scale_inv"] = q8, sb
            d = q8.astype(np.float32)
            for i in range(sb.shape[0]):
                for j in range(sb.shape[1]):
                    d[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] *= sb[i, j]
            deq[k] = d
        else:
            fp8[k] = w
            deq[k] = w.astype(np.float32) if w.dtype != np.float32 else w
    assert any(v.dtype == ml_dtypes.float8_e4m3fn for v in fp8.values())
    assert any(v.shape[0] > 128 for k, v in fp8.items() if k.endswith("scale_inv") is False and v.ndim == 2
               and v.dtype == ml_dtypes.float8_e4m3fn)  # some weights span several blocks
    qcfg = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}
    a = api.load(_write(str(tmp_path / "fp8"), fp8, qcfg))
    b = api.load(_write(str(tmp_path / "deq"), deq))
    ids = np.load(os.path.join(DENSE, "golden.npz"))["input_ids"][0][:12]
    np.testing.assert_array_equal(api.forward(a, ids), api.forward(b, ids))


def test_dequantize_crops_partial_blocks():
    w = np.ones((130, 3), np.float32).astype(ml_dtypes.float8_e4m3fn)
    s = np.array([[2.0], [3.0]], np.float32)
    d = dequantize_fp8_block(w, s)
    assert d.shape == (130, 3) and d[0, 0] == 2.0 and d[129, 2] == 3.0
    with pytest.raises(CheckpointError, match="weight_scale_inv"):
        dequantize_fp8_block(w, np.ones((1, 1), np.float32))


def _broken(tmp_path, mutate):
    t = _tensors(DENSE)
    mutate(t)
    return _write(str(tmp_path / "broken"), t)


def test_missing_tensor_names_key_and_shape(tmp_path):
    path = _broken(tmp_path, lambda t: t.pop("model.layers.4.self_attn.o_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.4\.self_attn\.o_proj\.weight "
                                              r"\(expected shape \[64, 128\]\)"):
        api.load(path)


def test_unexpected_tensor_is_named(tmp_path):
    # a shared layer must not carry indexer weights
    def add(t):
        t["model.layers.3.self_attn.indexer.wk.weight"] = t["model.layers.2.self_attn.indexer.wk.weight"]
    with pytest.raises(CheckpointError, match=r"unexpected tensor model\.layers\.3\.self_attn\.indexer\.wk\.weight"):
        api.load(_broken(tmp_path, add))


def test_misshaped_tensor_names_both_shapes(tmp_path):
    def bad(t):
        t["model.norm.weight"] = np.ones(63, np.float32)
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight has shape \[63\], expected \[64\]"):
        api.load(_broken(tmp_path, bad))


def test_sharded_index_pointing_at_missing_file(tmp_path):
    sparse = os.path.join(os.path.dirname(DENSE), "sparse")
    dst = tmp_path / "sharded"
    shutil.copytree(sparse, dst)
    os.remove(dst / "model-00002-of-00003.safetensors")
    with pytest.raises(FileNotFoundError, match="model-00002-of-00003"):
        SafetensorsCheckpoint(str(dst))


# ---------------------------------------------------------------- damaged files and stored dtypes
Q_B = "model.layers.2.self_attn.q_b_proj.weight"  # a quantisable linear of the fixture


def test_tensors_stored_in_a_dtype_that_would_load_wrong_are_refused_by_name(tmp_path):
    """An integer tensor would be converted by value, FP8 codes without their scale read as real
    values, e5m2 codes decoded as e4m3: each used to load and serve wrong tokens."""
    w = _tensors(DENSE)[Q_B]
    cases = {
        "int": (lambda t: t.update({Q_B: w.astype(np.int16)}),
                (rf"{Q_B} has dtype I16; it must be one of F32, BF16, F16, F64, or F8_E4M3 with a weight_scale_inv")),
        "fp8_no_scale": (lambda t: t.update({Q_B: w.astype(ml_dtypes.float8_e4m3fn)}),
                         rf"{Q_B} is stored as F8_E4M3 but its .*weight_scale_inv is missing"),
        "e5m2": (lambda t: t.update({Q_B: w.astype(ml_dtypes.float8_e5m2)}), rf"{Q_B} has dtype F8_E5M2"),
        "scale_for_bf16": (lambda t: t.update({Q_B[: -len("weight")] + "weight_scale_inv": np.ones((2, 1), np.float32)}),
                           r"weight_scale_inv is given for .*q_b_proj\.weight, which is stored as BF16"),
        "int_norm": (lambda t: t.update({"model.norm.weight": np.ones(64, np.int32)}),
                     r"model\.norm\.weight has dtype I32; it must be one of F32, BF16, F16, F64(?!, or)"),
    }
    for name, (mutate, match) in cases.items():
        t = _tensors(DENSE)
        mutate(t)
        with pytest.raises(CheckpointError, match=match):
            api.load(_write(str(tmp_path / name), t))
    t = _tensors(DENSE)  # F16 for a BF16 weight is a float: accepted
    t[Q_B] = w.astype(np.float16)
    api.load(_write(str(tmp_path / "f16"), t))


def test_truncated_and_corrupt_files_are_named_with_the_tensor(tmp_path):
    path = _write(str(tmp_path / "trunc"), _tensors(DENSE))
    f = os.path.join(path, "model.safetensors")
    size = os.path.getsize(f)
    with open(f, "r+b") as fh:
        fh.truncate(size - 16)
    with pytest.raises(CheckpointError, match=r"model\.safetensors is truncated: tensor \S+ needs bytes up to "
                                              rf"{size:,} and the file has {size - 16:,}"):
        SafetensorsCheckpoint(path)
    with open(f, "r+b") as fh:
        fh.truncate(300)  # inside the JSON header
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a safetensors file, or truncated"):
        SafetensorsCheckpoint(path)
    with open(f, "wb") as fh:
        fh.write(os.urandom(4096))  # random bytes: a header length far past the file
    with pytest.raises(CheckpointError, match=r"not a safetensors file, or truncated: its header length"):
        SafetensorsCheckpoint(path)
    idx = tmp_path / "idx"
    shutil.copytree(os.path.join(os.path.dirname(DENSE), "sparse"), idx)
    (idx / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: not a safetensors index"):
        SafetensorsCheckpoint(str(idx))


def test_a_tensor_in_two_files_without_an_index_is_refused(tmp_path):
    t = _tensors(DENSE)
    path = _write(str(tmp_path / "dup"), t)
    stn.save_file({"model.norm.weight": np.full(64, np.nan, np.float32)}, os.path.join(path, "stale.safetensors"))
    with pytest.raises(CheckpointError, match=r"tensor model\.norm\.weight is in both .*model\.safetensors and "
                                              r".*stale\.safetensors"):
        SafetensorsCheckpoint(path)


def test_config_errors_name_the_file_and_the_field(tmp_path, caplog):
    from glm53.config import ConfigError, GlmConfig

    d = tmp_path / "cfg"
    d.mkdir()
    with open(os.path.join(DENSE, "config.json")) as f:
        cfg = json.load(f)
    for text, match in [("{bad", r"config\.json is not valid JSON"),
                        ("[]", r"config\.json: config\.json must be a JSON object, got list"),
                        (json.dumps({**cfg, "num_attention_heads": "4"}), r"num_attention_heads: expected int, got '4'"),
                        (json.dumps({**cfg, "index_topk": 0}), r"index_topk: must be >= 1, got 0"),
                        (json.dumps({**cfg, "rms_norm_eps": True}), r"rms_norm_eps: expected float, got True")]:
        (d / "config.json").write_text(text)
        with pytest.raises(ConfigError, match=match):
            GlmConfig.from_pretrained(str(d))
    (d / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k not in ("rope_theta", "rope_parameters", "rope_scaling", "hidden_size")}))
    with caplog.at_level("WARNING", logger="glm53.config"):
        GlmConfig.from_pretrained(str(d))
    assert "does not set hidden_size, rope_theta: using GLM-5.3's hidden_size=6144, rope_theta=1000000.0" in caplog.text


def test_an_output_directory_over_its_source_is_refused(tmp_path):
    from glm53.output_dir import check_output_dir

    src = tmp_path / "a" / "src"
    src.mkdir(parents=True)
    (tmp_path / "link").symlink_to(src)
    for dst in (src, tmp_path / "a", tmp_path, src / "out", tmp_path / "link", tmp_path / "a" / "." / "src"):
        with pytest.raises(ValueError, match="output directory"):
            check_output_dir(src, dst)
    check_output_dir(src, tmp_path / "a" / "src2")  # a sibling whose name starts the same: fine
