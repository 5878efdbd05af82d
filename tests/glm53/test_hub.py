"""`--model` as a Hugging Face hub id, offline against a hub cache laid out as `huggingface_hub`
lays it out (`models--org--name/{refs/main, snapshots/<commit>/…}`); presets and bad names."""

from __future__ import annotations

import shutil

import pytest

from glm53.hub import ModelNotFoundError, is_hub_id, resolve_model
from glm53.tiny_checkpoint import default_model_dir

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    repo = tmp_path / "hub" / "models--zai-org--GLM-5.3-tiny"
    shutil.copytree(default_model_dir(), repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return repo / "snapshots" / COMMIT


def test_hub_id_resolves_to_the_cached_snapshot_and_serves(hub_cache):
    from serving.engine import EngineArgs
    from serving.engine_factory import build_engine
    from serving.types import SamplingParams

    assert resolve_model("zai-org/GLM-5.3-tiny") == str(hub_cache)
    e = build_engine(EngineArgs(model="zai-org/GLM-5.3-tiny", max_model_len=64, max_num_seqs=2,
                                       max_num_batched_tokens=32, cuda_graph_sizes=[], precompile_token_paddings=[], compile_progress=False,
                                       disable_log_stats=True))
    assert e.model_path == str(hub_cache)
    e.add_request("r", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    out = []
    while e.has_unfinished_requests():
        out += [t for o in e.step() for t in o.new_token_ids]
    assert len(out) == 3


def test_a_hub_id_missing_from_the_offline_cache_says_so(hub_cache):
    with pytest.raises(ModelNotFoundError, match="HF_HUB_OFFLINE is set and it is not in the local Hugging Face cache"):
        resolve_model("zai-org/Not-There")


def test_presets_and_bad_names(tmp_path):
    assert resolve_model(None) is None and resolve_model("tiny") is None
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ModelNotFoundError, match="configuration without weights"):
        resolve_model("glm-5.3")
    with pytest.raises(ModelNotFoundError, match="not a directory, a preset"):
        resolve_model(str(tmp_path / "missing" / "dir" / "x"))
    assert is_hub_id("zai-org/GLM-5.3") and not is_hub_id("./x/y") and not is_hub_id("/abs/path")


def test_the_shipped_trained_preset(tmp_path, monkeypatch):
    import glm53.hub as hub
    from glm53.config import GlmConfig

    path = resolve_model("tiny-recall")
    cfg = GlmConfig.from_pretrained(path)
    assert path.endswith("checkpoints/tiny-recall") and cfg.index_topk == 64 and cfg.num_mtp_layers == 1
    monkeypatch.setitem(hub.SHIPPED, "tiny-recall", tmp_path / "gone")
    with pytest.raises(ModelNotFoundError, match="shipped checkpoint is missing"):
        resolve_model("tiny-recall")
