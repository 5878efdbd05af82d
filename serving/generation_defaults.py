"""Default sampling parameters from the checkpoint's `generation_config.json` (vLLM's
`--generation-config` / `--override-generation-config`).

A request that leaves `temperature`, `top_p`, `top_k` or `min_p` out gets the model creator's
value from `generation_config.json` instead of the OpenAI default, and one without `max_tokens`
is capped at its `max_new_tokens`; whatever a request sets wins. `--generation-config vllm` ignores
the file (the OpenAI defaults: temperature 1, top_p 1, no top-k / min-p, all the room left);
`--generation-config DIR` reads `DIR/generation_config.json` instead of the checkpoint's.
`--override-generation-config '{"temperature": 0.6}'` sets keys on top of either.

`repetition_penalty` is a default too (`serving.penalties`). A value out of range (`top_p` 0, say)
stops the start-up naming the file and the key.
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any

logger = logging.getLogger(__name__)

# generation_config.json key → `SamplingParams` field.
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "max_new_tokens": "max_tokens", "repetition_penalty": "repetition_penalty"}


class GenerationConfigError(ValueError):
    """A `--generation-config` that cannot be read or whose values are out of range."""


def _check(key: str, value: Any, source: str) -> Any:
    """`value` of `key`, checked as `SamplingParams.validate` would (GenerationConfigError)."""
    def bad(rule: str) -> GenerationConfigError:
        return GenerationConfigError(f"{source}: {key} must be {rule}, got {value!r}")

    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad("a number")
    if key == "temperature" and not (math.isfinite(value) and value >= 0):
        raise bad("a finite number >= 0")
    if key == "top_p" and not 0 < value <= 1:
        raise bad("in (0, 1]")
    if key == "min_p" and not 0 <= value <= 1:
        raise bad("in [0, 1]")
    if key == "top_k" and (int(value) != value or value < -1):
        raise bad("0 or -1 (disabled) or an integer >= 1")
    if key == "max_new_tokens" and (int(value) != value or value < 1):
        raise bad("an integer >= 1")
    if key == "repetition_penalty" and not (math.isfinite(value) and value > 0):
        raise bad("a finite number > 0")
    return int(value) if key in ("top_k", "max_new_tokens") else float(value)


def load_generation_defaults(generation_config: str, model_dir: str | None,
                             override: dict[str, Any] | None = None) -> dict[str, Any]:
    """The default `SamplingParams` fields for requests that leave them out.

    Args:
      generation_config: "auto" (the checkpoint's `generation_config.json`, if it has one), "vllm"
        (none), or a directory holding a `generation_config.json`.
      model_dir: the checkpoint directory ("auto" reads from it; None: nothing to read).
      override: `--override-generation-config`, generation-config keys set on top.

    Returns `{SamplingParams field: value}` for the keys given (e.g. `{"temperature": 1.0,
    "top_p": 0.95}`); empty when there is nothing to apply.

    Raises GenerationConfigError for a directory without the file, a file that is not a JSON
    object, or a value out of range (naming the file or flag and the key)."""
    raw: dict[str, Any] = {}
    source = "--override-generation-config"
    if generation_config not in ("auto", "vllm"):
        path = os.path.join(generation_config, "generation_config.json")
        if not os.path.isfile(path):
            raise GenerationConfigError(f"--generation-config {generation_config}: no generation_config.json there "
                                        "(give 'auto', 'vllm' or a directory holding one)")
        raw, source = _read(path), path
    elif generation_config == "auto" and model_dir is not None:
        path = os.path.join(model_dir, "generation_config.json")
        if os.path.isfile(path):
            raw, source = _read(path), path
    defaults: dict[str, Any] = {}
    for layer, where in ((raw, source), (override or {}, "--override-generation-config")):
        for key, value in layer.items():
            if key in SAMPLING_KEYS:
                defaults[SAMPLING_KEYS[key]] = _check(key, value, where)
            elif layer is override:
                raise GenerationConfigError(f"--override-generation-config: unknown key {key!r} (known: "
                                            f"{', '.join(SAMPLING_KEYS)})")
    return defaults


def _read(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise GenerationConfigError(f"{path}: cannot be read as JSON ({e})") from None
    if not isinstance(data, dict):
        raise GenerationConfigError(f"{path}: expected a JSON object")
    return data


def describe(defaults: dict[str, Any], generation_config: str) -> str:
    """The start-up log line for `defaults` (vLLM logs the same fact)."""
    if not defaults:
        return "default sampling parameters: the OpenAI defaults (no generation config applies)"
    return (f"default sampling parameters of requests that leave them out: {defaults} "
            f"(--generation-config {generation_config}; relaunch with --generation-config vllm for the OpenAI "
            "defaults)")
