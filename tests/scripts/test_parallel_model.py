"""scripts/parallel_model.py against hand arithmetic for GLM-5.3 (H 64, A 512, R 64, I 32,
Dk 128, K 2048) and the 8× PCP8/TP8 ratio the source's ≈32K / ≈256K imply."""

import json

import pytest

from glm53.config import preset
from scripts.parallel_model import build_tables, crossovers, dcp_comm_bytes, dcp_memory_per_device, main

CFG = preset("glm-5.3")


def test_crossover_ratio_is_eight_under_every_rule():
    c = crossovers(CFG)
    for rule in ("bf16_flops", "fp8_rate", "bf16_flops_pow2", "fp8_rate_pow2", "source"):
        assert c["PCP8"][rule] == pytest.approx(8 * c["TP8"][rule]), rule
    # S* = K · 2176 · heads / (I · Dk)
    assert c["TP8"]["bf16_flops"] == pytest.approx(2048 * 2176 * 8 / (32 * 128)) == 8704
    assert c["PCP8"]["fp8_rate"] == pytest.approx(2 * 2048 * 2176 * 64 / (32 * 128))
    # the FP8-rate count, on a power-of-two grid, lands on the source's figures
    assert (c["TP8"]["fp8_rate_pow2"], c["PCP8"]["fp8_rate_pow2"]) == (32768, 262144)


def test_dcp_comm_bytes_by_hand():
    b = dcp_comm_bytes(CFG, 8, tokens=1)
    assert b["q_allgather"] == 7 * 64 * 576 * 2 // 8 == 64512
    assert b["ag_rs"] == 64512 + 7 * 64 * 4 + 7 * 64 * 512 * 2 // 8
    assert b["a2a"] == 64512 + 7 * 64 * (1024 + 4) // 8
    assert b["indexer_topk"] == 7 * 2048 * 8
    assert dcp_comm_bytes(CFG, 8, tokens=4)["a2a"] == 4 * b["a2a"]
    assert dcp_comm_bytes(CFG, 1)["ag_rs"] == 0


def test_dcp_memory_matches_source():
    # 1M tokens × 54,728 B ≈ 53.4 GiB, ≈ 6.7 GiB per device under DCP8 (source)
    assert dcp_memory_per_device(CFG, 1, 1 << 20) == 54728 << 20
    assert dcp_memory_per_device(CFG, 8, 1 << 20) / 2**30 == pytest.approx(6.68, abs=0.01)


def test_script_saves_json_and_markdown(tmp_path, capsys):
    assert main(["--out", str(tmp_path / "pm")]) == 0
    t = json.loads((tmp_path / "pm.json").read_text())
    assert t["crossover_tokens"]["TP8"]["bf16_flops"] == 8704
    md = (tmp_path / "pm.md").read_text()
    assert "| TP8 | 8 | 8,704 | 16K | 17,408 | 32K | ≈32K |" in md and md in capsys.readouterr().out
    assert build_tables(CFG)["num_full_layers"] == 21
