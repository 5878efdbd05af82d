"""The tiny default checkpoint: determinism, complete key/shape/dtype coverage, config round trip."""

import hashlib
import json
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

from glm53 import tiny_checkpoint
from glm53.checkpoint_keys import expected_checkpoint_shapes
from glm53.config import TINY_HF_CONFIG, GlmConfig
from glm53.tiny_checkpoint import default_model_dir, write_tiny_checkpoint
from glm53.tokenizer import GlmTokenizer

FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "model.safetensors",
)
_ST_DTYPES = {"BF16": "bfloat16", "F32": "float32"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def _digests(d):
    return {f: hashlib.sha256((d / f).read_bytes()).hexdigest() for f in FILES}


def test_deterministic(ckpt, tmp_path):
    again = write_tiny_checkpoint(tmp_path / "again")
    assert _digests(again) == _digests(ckpt)
    other_seed = write_tiny_checkpoint(tmp_path / "seed1", seed=1)
    d1 = _digests(other_seed)
    assert d1["model.safetensors"] != _digests(ckpt)["model.safetensors"]
    assert d1["tokenizer.json"] == _digests(ckpt)["tokenizer.json"]


def test_tokenizer_training_deterministic_across_processes():
    code = (
        "import hashlib; from glm53.tiny_checkpoint import build_tiny_tokenizer; "
        "print(hashlib.sha256(build_tiny_tokenizer().to_str().encode()).hexdigest())"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    outs = {
        subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True).stdout
        for _ in range(2)
    }
    assert len(outs) == 1


def test_config(ckpt):
    cfg = GlmConfig.from_pretrained(ckpt)
    tok = GlmTokenizer.from_pretrained(ckpt)
    assert cfg.vocab_size % 64 == 0 and tok.vocab_size <= cfg.vocab_size < tok.vocab_size + 64
    assert cfg.eos_token_id == tuple(tok.token_to_id(t) for t in ("<|endoftext|>", "<|user|>", "<|observation|>"))
    assert cfg.pad_token_id == tok.token_to_id("<|endoftext|>")
    for k in ("hidden_size", "num_hidden_layers", "n_routed_experts", "index_topk", "kv_lora_rank"):
        assert getattr(cfg, k) == TINY_HF_CONFIG[k]
    gen = json.loads((ckpt / "generation_config.json").read_text())
    assert tuple(gen["eos_token_id"]) == cfg.eos_token_id
    tc = json.loads((ckpt / "tokenizer_config.json").read_text())
    assert "chat_template" not in tc and tc["eos_token"] == "<|endoftext|>"
    assert (ckpt / "chat_template.jinja").read_bytes() == tiny_checkpoint.CHAT_TEMPLATE_PATH.read_bytes()


def test_tensors_match_expected_layout(ckpt):
    cfg = GlmConfig.from_pretrained(ckpt)
    want = expected_checkpoint_shapes(cfg)
    with safe_open(str(ckpt / "model.safetensors"), framework="numpy") as f:
        got = {k: (tuple(f.get_slice(k).get_shape()), _ST_DTYPES[f.get_slice(k).get_dtype()]) for k in f.keys()}
        assert f.metadata() == {"format": "pt"}
    assert set(got) == set(want)
    assert got == want
    n = cfg.num_hidden_layers
    # Indexer on full layers (and the MTP layer) only; dense MLP on the first layers only.
    for layer in range(n + 1):
        has_idx = f"model.layers.{layer}.self_attn.indexer.wk.weight" in got
        assert has_idx == (layer == n or cfg.indexer_types[layer] == "full")
        dense = f"model.layers.{layer}.mlp.gate_proj.weight" in got
        assert dense == (layer < cfg.first_k_dense_replace)
    assert got[f"model.layers.{n}.eh_proj.weight"] == ((cfg.hidden_size, 2 * cfg.hidden_size), "bfloat16")
    assert got["model.layers.3.mlp.gate.weight"] == ((cfg.n_routed_experts, cfg.hidden_size), "float32")
    assert got["model.layers.3.mlp.gate.e_score_correction_bias"] == ((cfg.n_routed_experts,), "float32")


def test_weights_are_sane(ckpt):
    with safe_open(str(ckpt / "model.safetensors"), framework="numpy") as f:
        emb = f.get_tensor("model.embed_tokens.weight").astype(np.float32)
        head = f.get_tensor("lm_head.weight").astype(np.float32)
        norm = f.get_tensor("model.norm.weight")
        wq = f.get_tensor("model.layers.0.self_attn.q_a_proj.weight")
    assert norm.dtype == ml_dtypes.bfloat16 and wq.dtype == ml_dtypes.bfloat16
    assert 0.8 < float(norm.astype(np.float32).mean()) < 1.2
    assert abs(float(wq.astype(np.float32).std()) * np.sqrt(wq.shape[1]) - 1.0) < 0.1
    h = emb[:32] / np.sqrt((emb[:32] ** 2).mean(-1, keepdims=True) + 1e-6) * norm.astype(np.float32)
    logits = h @ head.T
    assert np.isfinite(logits).all()
    assert 0.5 < logits.std() < 2.0
    assert len(set(logits.argmax(-1).tolist())) > 16  # not collapsed onto one token


def test_default_model_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("GLM53_HOME", str(tmp_path))
    d = default_model_dir()
    assert d == tmp_path / "tiny-glm-5.3"
    assert all((d / f).is_file() for f in FILES)
    stamp = (d / "model.safetensors").stat().st_mtime_ns
    assert default_model_dir() == d and (d / "model.safetensors").stat().st_mtime_ns == stamp
    (d / tiny_checkpoint.FINGERPRINT_FILE).write_text("stale\n")
    assert default_model_dir() == d
    assert (d / tiny_checkpoint.FINGERPRINT_FILE).read_text().strip() == tiny_checkpoint.generator_fingerprint(0)
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-glm-5.3"]  # no temp dirs left behind
