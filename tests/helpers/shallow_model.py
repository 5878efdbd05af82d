"""The test suite's 7-layer twin of the tiny checkpoint, for the engine-heavy test modules.

Most of the suite's time is XLA compiling and running the tiny model's engine steps, and both grow
with its depth: one engine's step program compiles in 3.9 s and runs a small workload in 6.7 s at
14 layers, 3.1 s and 4.5 s at 7 (`scripts/probe_model_depth_compile.py`,
`docs/results/suite_time/model_depth_2026-12-06/`), and four engine-heavy modules ran in 28 % less
CPU time on the twin (`docs/results/suite_time/shallow_twin_2026-12-06.txt`). What the serving code
branches on is kept: dense and MoE layers, an IndexShare group of one layer, one mixing a dense and
an MoE layer, two identical groups stacked and scanned, the MTP layer, every cache group and page
format (only the number of layers in a page changes). The 14-layer checkpoint stays what the HF
goldens, the checkpoint and tokenizer tests, the scripts' results and the server's default use.

A test module opts in with `pytestmark = pytest.mark.shallow_model`: while it runs (tests/conftest.py),
everything that falls back to the embedded tiny checkpoint in that process — `EngineArgs(model=None)`,
`glm53.api.load()`, `LLM()` — gets the twin instead. Processes the module starts get it only if
given `--model shallow_model_dir()` (the twin's path) explicitly.
"""

from __future__ import annotations

from glm53 import tiny_checkpoint

# The tiny preset's fields that change (glm53.config.TINY_HF_CONFIG: 14 layers, 3 dense, IndexShare
# groups {0} {1} {2..5} and two stacked groups of 4): 7 layers, 2 dense, groups {0} {1, 2} and two
# stacked groups of 2. Every other size (heads, ranks, index_topk 64, experts) is the tiny model's.
SHALLOW_OVERRIDES = {
    "num_hidden_layers": 7,
    "first_k_dense_replace": 2,
    "indexer_types": ["full", "full", "shared", "full", "shared", "full", "shared"],
}
SHALLOW_NAME = "tiny-glm-5.3-7-layers"


def shallow_model_dir() -> str:
    """The twin's checkpoint directory (generated under GLM53_HOME on first use, like the tiny one)."""
    return str(tiny_checkpoint.default_model_dir(SHALLOW_NAME, SHALLOW_OVERRIDES))


def shallow_model_argv(served_model_name: str = "glm-5.3-tiny") -> list[str]:
    """Server arguments that start a process on the twin under the tiny model's served name (what
    the in-process fallback does for marked modules; a process needs it explicitly)."""
    return ["--model", shallow_model_dir(), "--served-model-name", served_model_name]
