"""A copy of the tiny checkpoint with some `config.json` fields changed (same weights and tokenizer)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def tiny_checkpoint_with(dest: Path, **config) -> Path:
    """Copy the tiny checkpoint (`glm53.tiny_checkpoint.default_model_dir`) to `dest` and set the
    given `config.json` fields → `dest`."""
    from glm53.tiny_checkpoint import default_model_dir

    shutil.copytree(default_model_dir(), dest)
    cfg = json.loads((dest / "config.json").read_text())
    cfg.update(config)
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest
