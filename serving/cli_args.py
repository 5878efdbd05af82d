"""Command-line flags of `python -m serving.run` (vLLM's flag names where the concept is the same).

`make_arg_parser()` builds the parser; `validate_args(args)` rejects combinations this build does
not support yet and parses the JSON flags (`--attention-config`, `--kv-transfer-config`,
`--speculative-config`) into dicts in place.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

JSON_FLAGS = ("attention_config", "kv_transfer_config", "speculative_config")


class ArgumentError(ValueError):
    """An unsupported or invalid flag combination; the message names the flag."""


def make_arg_parser() -> argparse.ArgumentParser:
    """The argument parser of `python -m serving.run`."""
    p = argparse.ArgumentParser(
        prog="python -m serving.run",
        description="Serve GLM-5.3 with an OpenAI-compatible API.",
    )
    m = p.add_argument_group("model")
    m.add_argument(
        "--model",
        default=None,
        help="Checkpoint directory or preset name (default: the embedded tiny model).",
    )
    m.add_argument(
        "--served-model-name",
        default=None,
        help="Model name the API accepts and lists (default: the --model value).",
    )
    m.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto")
    m.add_argument("--seed", type=int, default=0, help="Engine sampling seed.")
    m.add_argument(
        "--max-model-len", type=int, default=None, help="Prompt + output tokens at most."
    )

    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="Require 'Authorization: Bearer KEY' on /v1.")
    s.add_argument(
        "--log-level",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        default="info",
    )

    sch = p.add_argument_group("scheduler and cache")
    sch.add_argument("--max-num-batched-tokens", type=int, default=None)
    sch.add_argument("--max-num-seqs", type=int, default=None)
    sch.add_argument(
        "--kv-cache-dtype", choices=["auto", "bfloat16", "fp8"], default="auto",
        help="KV cache format: auto (the model dtype), bfloat16, or fp8 (fp8_ds_mla latent + fp8 indexer keys).",
    )
    sch.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=False
    )
    sch.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    sch.add_argument("--num-gpu-blocks-override", type=int, default=None)
    sch.add_argument(
        "--attention-config",
        default=None,
        help='JSON, e.g. {"hisparse_config": {"host_pool_gib": 64}, "sparse_mla_force_mqa": true}.',
    )
    sch.add_argument(
        "--kv-transfer-config",
        default=None,
        help='JSON, e.g. {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": '
        '{"cpu_bytes_to_use": ...}}.',
    )
    sch.add_argument(
        "--speculative-config",
        default=None,
        help='JSON, e.g. {"method": "mtp", "num_speculative_tokens": 1}.',
    )

    par = p.add_argument_group("parallelism")
    par.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    par.add_argument("--prefill-context-parallel-size", "-pcp", type=int, default=1)
    par.add_argument("--decode-context-parallel-size", "-dcp", type=int, default=1)
    par.add_argument("--dcp-comm-backend", choices=["ag_rs", "a2a"], default="ag_rs")
    par.add_argument("--enable-expert-parallel", action="store_true")

    out = p.add_argument_group("output parsing")
    out.add_argument("--enable-auto-tool-choice", action="store_true")
    out.add_argument("--tool-call-parser", default=None, help="e.g. glm47")
    out.add_argument("--reasoning-parser", default=None, help="e.g. glm45")
    return p


def _parse_json_flag(flag: str, value: Any) -> dict[str, Any] | None:
    if value is None or isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise ArgumentError(f"{flag}: not valid JSON ({e}): {value!r}") from None
    if not isinstance(parsed, dict):
        raise ArgumentError(f"{flag}: expected a JSON object, got {value!r}")
    return parsed


def _not_yet(flag: str) -> ArgumentError:
    return ArgumentError(f"not supported yet in this build: {flag}")


def validate_args(args: argparse.Namespace) -> None:
    """Raise `ArgumentError` naming the flag for values this build cannot serve.

    Also replaces the JSON flag strings on `args` by the parsed dicts.
    """
    for name in JSON_FLAGS:
        flag = "--" + name.replace("_", "-")
        setattr(args, name, _parse_json_flag(flag, getattr(args, name)))

    for name, lo in (
        ("port", 0),
        ("max_model_len", 1),
        ("max_num_batched_tokens", 1),
        ("max_num_seqs", 1),
        ("num_gpu_blocks_override", 1),
        ("tensor_parallel_size", 1),
        ("prefill_context_parallel_size", 1),
        ("decode_context_parallel_size", 1),
    ):
        value = getattr(args, name)
        if value is not None and value < lo:
            raise ArgumentError(f"--{name.replace('_', '-')} must be >= {lo}, got {value}")
    if args.port > 65535:
        raise ArgumentError(f"--port must be <= 65535, got {args.port}")
    if not 0.0 < args.gpu_memory_utilization <= 1.0:
        raise ArgumentError(
            f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}"
        )

    for name in (
        "tensor_parallel_size",
        "prefill_context_parallel_size",
        "decode_context_parallel_size",
    ):
        value = getattr(args, name)
        if value != 1:
            raise _not_yet(f"--{name.replace('_', '-')} {value} (only 1)")
    if args.enable_expert_parallel:
        raise _not_yet("--enable-expert-parallel")
    if args.enable_prefix_caching:
        raise _not_yet("--enable-prefix-caching")
    if args.speculative_config is not None:
        raise _not_yet("--speculative-config")
    if args.kv_transfer_config is not None:
        raise _not_yet("--kv-transfer-config")
    if args.enable_auto_tool_choice:
        raise _not_yet("--enable-auto-tool-choice")
    if args.tool_call_parser is not None:
        raise _not_yet(f"--tool-call-parser {args.tool_call_parser}")
    if args.reasoning_parser is not None:
        raise _not_yet(f"--reasoning-parser {args.reasoning_parser}")
