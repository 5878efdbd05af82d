"""`--model` resolution: a checkpoint directory, a preset name, or a Hugging Face hub id.

* A directory: used as is (HF safetensors layout or an orbax checkpoint, `glm53.loader`).
* `tiny` (or no `--model`): the embedded tiny checkpoint (random weights), generated on first use.
* `tiny-recall`: the trained tiny checkpoint shipped in `glm53/checkpoints/tiny-recall`
  (scripts/train_tiny.py; it answers retrieval, copy and short questions, docs/tiny_recall.md).
* A hub id such as `zai-org/GLM-5.3`, as vLLM and SGLang take it: resolved with `huggingface_hub`
  (`snapshot_download` of the config, tokenizer, chat template and safetensors files, with its
  progress bars). With `HF_HUB_OFFLINE=1` only the local HF cache (`HF_HOME` / `HF_HUB_CACHE`) is
  used. GLM-5.3's FP8 checkpoint is about 750 GB: download it ahead of time
  (`huggingface-cli download zai-org/GLM-5.3`) on a machine with the disk for it.
* Other preset names (`glm-5.3`) are configurations without weights: refused with a hint.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from glm53.config import PRESETS

# The files a checkpoint needs (weights, config, tokenizer, chat template); other files of a hub
# repository (READMEs, images, original-format weights) are not downloaded.
HUB_PATTERNS = ("*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt")
# Presets with weights shipped in the package: name → checkpoint directory.
SHIPPED = {"tiny-recall": Path(__file__).with_name("checkpoints") / "tiny-recall"}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


class ModelNotFoundError(FileNotFoundError):
    """`--model` names nothing that can be loaded (the message says what was tried)."""


def is_hub_id(name: str) -> bool:
    """True for `org/name` strings that are not an existing path."""
    return bool(_HUB_ID.match(name)) and not os.path.exists(name)


def resolve_model(name: str | None, revision: str | None = None) -> str | None:
    """`--model` → a local checkpoint directory, or None for the embedded tiny checkpoint.

    Raises ModelNotFoundError: a missing directory, a preset without weights, a hub id that is not
    in the local cache while offline, or one the hub does not have (or cannot be reached for)."""
    if name is None or name == "tiny":
        return None
    if os.path.isdir(name):
        return name
    if name in SHIPPED:
        d = SHIPPED[name]
        if not (d / "model.safetensors").is_file():
            raise ModelNotFoundError(f"--model {name}: the shipped checkpoint is missing from {d} (an incomplete "
                                     "install?); scripts/train_tiny.py --out DIR rebuilds it")
        return str(d)
    if name in PRESETS:
        raise ModelNotFoundError(f"--model {name}: the preset {name!r} is a configuration without weights; pass a "
                                 "checkpoint directory or a hub id (e.g. zai-org/GLM-5.3), 'tiny' or 'tiny-recall'")
    if not is_hub_id(name):
        raise ModelNotFoundError(f"--model {name}: not a directory, a preset ({', '.join(sorted(PRESETS))}) or a "
                                 "Hugging Face hub id (org/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")
    try:
        return snapshot_download(name, revision=revision, allow_patterns=list(HUB_PATTERNS),
                                 local_files_only=offline, cache_dir=os.environ.get("HF_HUB_CACHE") or None)
    except LocalEntryNotFoundError as e:
        where = "HF_HUB_OFFLINE is set and it is not" if offline else "the hub could not be reached and it is not"
        raise ModelNotFoundError(f"--model {name}: {where} in the local Hugging Face cache "
                                 f"({os.environ.get('HF_HUB_CACHE') or os.environ.get('HF_HOME') or '~/.cache/huggingface'}); "
                                 f"download it first (huggingface-cli download {name})") from e
    except RepositoryNotFoundError as e:
        raise ModelNotFoundError(f"--model {name}: no such repository on the Hugging Face hub (or it needs a token: "
                                 "set HF_TOKEN)") from e
    except HfHubHTTPError as e:
        raise ModelNotFoundError(f"--model {name}: the Hugging Face hub answered {e}") from e
