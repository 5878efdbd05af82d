"""Command-line flags of `python -m serving.run` (vLLM's flag names where the concept is the same).

`make_arg_parser()` builds the parser; `validate_args(args)` rejects combinations this build does
not support yet and parses the JSON flags (`--attention-config`, `--kv-transfer-config`,
`--speculative-config`) into dicts in place, and builds `args.distributed_config`
(a `sharding.distributed.DistributedConfig`) from the multi-process flags.
"""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

from serving.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS

logger = logging.getLogger(__name__)

JSON_FLAGS = ("attention_config", "kv_transfer_config", "speculative_config", "kv_events_config",
              "structured_outputs_config", "override_generation_config", "profiler_config")


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
        help="Checkpoint directory, Hugging Face hub id (e.g. zai-org/GLM-5.3; HF_HUB_OFFLINE=1 uses only the "
             "local HF cache), the preset 'tiny' (the embedded tiny model with random weights, the default) or "
             "'tiny-recall' (the trained tiny model: retrieval, copying, short answers). The 'glm-5.3' preset is a "
             "configuration without weights (scripts/capacity.py uses it).",
    )
    m.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="Model name(s) the API accepts and lists as `id`; with several, a request may name any and "
             "answers (and metrics) carry the first, as vLLM does (default: glm-5.3-tiny for the tiny "
             "preset, a checkpoint directory's name, or the hub id or preset name given to --model; "
             "`/v1/models` lists the --model value itself as `root`).",
    )
    m.add_argument(
        "--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
        help="Activations and the unquantised weights (embeddings, head, norms): auto = bfloat16 on a GPU, float32 "
             "on the CPU. FP8 weights stay FP8 whatever this says.",
    )
    m.add_argument(
        "--quantization", "-q", choices=["fp8"], default=None,  # glm53.quant.QUANTIZATION_METHODS (no jax import here)
        help="Weight quantisation. Default: the checkpoint's (an FP8 block-scaled checkpoint is served with its FP8 "
             "weights on the device). fp8: also quantise a bf16/fp32 checkpoint's linears at load to 128x128-block "
             "FP8 (online, as vLLM does).",
    )
    m.add_argument("--seed", type=int, default=0, help="Engine sampling seed.")
    m.add_argument(
        "--generation-config", default="auto",
        help="Default sampling of requests that leave it out: 'auto' (default) takes temperature, top_p, top_k, "
             "min_p and max_new_tokens from the checkpoint's generation_config.json, 'vllm' uses the OpenAI defaults, "
             "a directory its generation_config.json (vLLM's flag).",
    )
    m.add_argument(
        "--override-generation-config", default=None,
        help='JSON, e.g. {"temperature": 0.6}: generation-config keys set on top of --generation-config.',
    )
    m.add_argument(
        "--max-model-len", type=int, default=None, help="Prompt + output tokens at most."
    )

    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="Require 'Authorization: Bearer KEY' on /v1.")
    s.add_argument(
        "--shutdown-timeout", type=float, default=30.0,
        help="On SIGTERM / Ctrl-C: refuse new requests (503) and let running ones finish for at most "
             "this many seconds, then exit 0 (0: exit at once; a second signal always exits at once). "
             "vLLM's flag; its default is 0.",
    )
    s.add_argument(
        "--responses-store-size", type=int, default=1000,
        help="Responses kept in memory for the Responses API (previous_response_id, GET /v1/responses/{id}, "
             "background: true); least recently used first out. 0: keep none (stateless: store answered as false).",
    )
    s.add_argument(
        "--responses-store-max-mib", type=float, default=256.0,
        help="The stored responses' conversations (input and output items as JSON) at most, in MiB.",
    )
    s.add_argument(
        "--profiler-config", default=None,
        help='JSON, e.g. {"profiler": "jax", "profiler_dir": "/tmp/trace"}: serve POST /start_profile and '
             "/stop_profile, which take a jax.profiler trace of the engine steps between them (optional keys: "
             "create_perfetto_trace, default true; max_steps, end the trace after that many steps). vLLM's flag "
             "and routes (docs/gpu_deployment.md).",
    )
    s.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="No periodic engine statistics log line (/metrics is still served).",
    )
    s.add_argument(
        "--log-level",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        default="info",
    )

    sch = p.add_argument_group("scheduler and cache")
    sch.add_argument("--max-num-batched-tokens", type=int, default=None)
    sch.add_argument("--max-num-seqs", type=int, default=None)
    sch.add_argument(
        "--cuda-graph-sizes", type=int, nargs="*", default=None,
        help="Decode-sized step buckets (token counts) compiled at start-up besides the prefill buckets "
        "16*4^k: one value N = 1, 2, 4, ... up to N; several = exactly those; none = no decode buckets. "
        "Default: powers of two up to --max-num-seqs. Sizes above --max-num-batched-tokens are dropped.",
    )
    sch.add_argument(
        "--precompile-token-paddings", type=int, nargs="*", default=None,
        help="Prefill-sized step buckets (token counts, sglang-jax's flag) compiled at start-up besides the "
        "decode sizes; --max-num-batched-tokens is always one. Default: 16*4^k below the budget; none given = "
        "the budget alone (one program fewer per size: faster start-up, more padding).",
    )
    sch.add_argument(
        "--kv-cache-dtype", choices=["auto", "bfloat16", "fp8"], default="auto",
        help="KV cache format: auto (the model dtype), bfloat16, or fp8 (fp8_ds_mla latent + fp8 indexer keys).",
    )
    sch.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=False
    )
    sch.add_argument(
        "--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
        help="Schedule and dispatch step n+1 while step n runs, and read back and stream step n's tokens "
        "while step n+1 runs (docs/async_scheduling.md). Streams are unchanged. Default: on (every "
        "feature, MTP speculation and Hybrid HiSparse included). --no-async-scheduling: synchronous steps.",
    )
    sch.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="Fraction of device memory for weights + KV cache (the KV arena gets what is left).",
    )
    sch.add_argument(
        "--num-gpu-blocks-override",
        type=int,
        default=None,
        help="Exact number of KV arena pages (including the null block 0); overrides the sizing.",
    )
    sch.add_argument(
        "--max-logprobs",
        type=int,
        default=20,
        help="Most logprobs / top_logprobs a request may ask for.",
    )
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
        "--kv-events-config",
        default=None,
        help='JSON, e.g. {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558"}: KV cache events for prefix-aware routers (vLLM\'s format; '
        'docs/kv_events.md; vllm-router --policy kv_aware finds the sockets at GET /kv_event_sources). Needs '
        '--enable-prefix-caching.',
    )
    sch.add_argument(
        "--structured-outputs-config",
        default=None,
        help='JSON, e.g. {"disable_any_whitespace": true}: structured outputs settings (vLLM\'s keys backend, '
             'disable_any_whitespace, disable_additional_properties, enable_in_reasoning; docs/structured_outputs.md).',
    )
    sch.add_argument(
        "--speculative-config",
        default=None,
        help='JSON, e.g. {"method": "mtp", "num_speculative_tokens": 3}: MTP speculative decoding (k = 1…5; '
             'keys adaptive, adaptive_min_acceptance, disable_by_batch_size; docs/spec_decode.md).',
    )

    par = p.add_argument_group("parallelism")
    par.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                     help="devices each replica's attention heads and MLP columns are split over; must divide "
                          "the model's attention heads (and the FP8 scale blocks of an FP8 checkpoint)")
    par.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                     help="engine replicas, each with its own KV pool, scheduler and --max-num-seqs / "
                          "--max-num-batched-tokens (the X-data-parallel-rank header pins a request to one)")
    par.add_argument("--prefill-context-parallel-size", "-pcp", type=int, default=1,
                     help="devices a step's tokens are split over (load-balanced chunks); every token bucket, "
                          "the --max-num-batched-tokens budget (512) included, must be a multiple of 2 x this "
                          "size (default decode sizes that are not are left out; --cuda-graph-sizes and "
                          "--precompile-token-paddings given explicitly must be)")
    par.add_argument("--decode-context-parallel-size", "-dcp", type=int, default=1,
                     help="devices the KV cache of every request is split over by position (an engine page "
                          "spans 64 x N tokens); must equal --tensor-parallel-size, "
                          "--prefill-context-parallel-size or their product")
    par.add_argument("--dcp-comm-backend", choices=["ag_rs", "a2a"], default="ag_rs",
                     help="how DCP ranks merge their attention partials: all-gather + reduce-scatter "
                          "(ag_rs) or all-to-all (a2a)")
    par.add_argument("--dcp-kv-cache-interleave-size", type=int, default=1,
                     help="consecutive positions one DCP rank stores before the next rank's (I: position p "
                          "lives on rank (p // I) %% N); must divide 64")
    par.add_argument("--enable-expert-parallel", action="store_true",
                     help="split the routed experts over every device of the mesh (dp x pcp x tp, which must "
                          "divide the expert count) instead of their columns over TP")

    dist = p.add_argument_group(
        "multi-process (jax.distributed)",
        "One process per host (or per group of local devices), all running the same program over "
        "one global mesh; process 0 hosts the coordinator. See sharding/distributed.py.")
    dist.add_argument("--coordinator-address", default=None,
                      help="HOST:PORT of process 0's coordinator (JAX_COORDINATOR_ADDRESS also works).")
    dist.add_argument("--num-processes", "--nnodes", type=int, default=1, help="Total processes (default 1).")
    dist.add_argument("--process-id", "--node-rank", type=int, default=0, help="This process, in [0, N).")
    dist.add_argument("--local-device-ids", default=None,
                      help="Comma-separated local accelerator ids this process drives (default: all).")
    dist.add_argument("--distributed-timeout", type=int, default=300,
                      help="Seconds to wait for every process to join (default 300).")
    dist.add_argument("--headless", action="store_true",
                      help="Run without the HTTP server: a follower process (--process-id > 0) of a multi-process "
                           "engine, which runs the steps process 0 sends (docs/multihost.md).")
    dist.add_argument("--master-addr", default=None,
                      help="Address of process 0's step channel (default: the coordinator's host).")
    dist.add_argument("--master-port", type=int, default=None,
                      help="Port of process 0's step channel; it also listens on the next port for heartbeats "
                           "(default: the coordinator's port + 1).")
    dist.add_argument("--peer-timeout", type=float, default=10.0,
                      help="Seconds without a heartbeat after which a peer process counts as lost and the "
                           "whole engine stops (default 10).")

    out = p.add_argument_group("output parsing")
    out.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='Let the model call tools (tool_choice "auto"); needs --tool-call-parser.',
    )
    out.add_argument(
        "--tool-call-parser",
        default=None,
        help="Turn <tool_call> blocks into OpenAI tool_calls: glm47 (glm45 is an alias).",
    )
    out.add_argument(
        "--reasoning-parser",
        default=None,
        help="Return <think> text as reasoning_content: glm45.",
    )
    return p


def _parse_json_flag(flag: str, value: Any) -> dict[str, Any] | None:
    if not isinstance(value, str):  # None, a dict, or already parsed (validated args validated again)
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


def parallel_config(args: argparse.Namespace):
    """The `sharding.mesh.ParallelConfig` of the parallelism flags (ArgumentError naming the flag)."""
    from sharding.mesh import ParallelConfig

    try:
        return ParallelConfig(
            tensor_parallel_size=args.tensor_parallel_size, data_parallel_size=args.data_parallel_size,
            prefill_context_parallel_size=args.prefill_context_parallel_size,
            decode_context_parallel_size=args.decode_context_parallel_size,
            enable_expert_parallel=args.enable_expert_parallel, dcp_comm_backend=args.dcp_comm_backend,
            dcp_kv_cache_interleave_size=args.dcp_kv_cache_interleave_size)
    except ValueError as e:
        raise ArgumentError(str(e)) from None


def validate_args(args: argparse.Namespace) -> None:
    """Raise `ArgumentError` naming the flag for values this build cannot serve.

    Also replaces the JSON flag strings on `args` by the parsed dicts and sets `args.parallel`
    (a `ParallelConfig`).
    """
    for name in JSON_FLAGS:
        flag = "--" + name.replace("_", "-")
        setattr(args, name, _parse_json_flag(flag, getattr(args, name)))

    for name, lo in (
        ("port", 0),
        ("max_model_len", 1),
        ("max_num_batched_tokens", 1),
        ("max_num_seqs", 1),
        ("num_gpu_blocks_override", 2),
        ("max_logprobs", 0),
        ("tensor_parallel_size", 1),
        ("prefill_context_parallel_size", 1),
        ("decode_context_parallel_size", 1),
        ("data_parallel_size", 1),
        ("dcp_kv_cache_interleave_size", 1),
        ("shutdown_timeout", 0),
        ("responses_store_size", 0),
    ):
        value = getattr(args, name)
        if value is not None and value < lo:
            raise ArgumentError(f"--{name.replace('_', '-')} must be >= {lo}, got {value}")
    if isinstance(args.profiler_config, dict):
        from serving.profiling import ProfilerConfig

        try:
            args.profiler_config = ProfilerConfig.from_dict(args.profiler_config)
        except (ValueError, TypeError) as e:
            raise ArgumentError(f"--profiler-config: {e}") from None
    if not 1.0 / (1 << 20) <= args.responses_store_max_mib < float("inf"):  # NaN fails too
        raise ArgumentError(f"--responses-store-max-mib must be a finite number of MiB, at least one byte "
                            f"(1/1048576), got {args.responses_store_max_mib}")
    from sharding.distributed import DistributedConfig, parse_device_ids

    try:
        args.distributed_config = DistributedConfig(
            args.coordinator_address, num_processes=args.num_processes, process_id=args.process_id,
            local_device_ids=parse_device_ids(args.local_device_ids), timeout_s=args.distributed_timeout)
        args.distributed_config.validate()
    except ValueError as e:
        raise ArgumentError(str(e)) from None
    _check_multihost(args)
    if args.port > 65535:
        raise ArgumentError(f"--port must be <= 65535, got {args.port}")
    if not 0.0 < args.gpu_memory_utilization <= 1.0:
        raise ArgumentError(
            f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}"
        )

    if args.cuda_graph_sizes is not None and any(v < 1 for v in args.cuda_graph_sizes):
        raise ArgumentError(f"--cuda-graph-sizes must be >= 1, got {args.cuda_graph_sizes}")
    if args.precompile_token_paddings is not None and any(v < 1 for v in args.precompile_token_paddings):
        raise ArgumentError(f"--precompile-token-paddings must be >= 1, got {args.precompile_token_paddings}")
    args.parallel = parallel_config(args)
    _check_speculative_config(args)
    _check_kv_transfer_config(args)
    _check_kv_events_config(args)
    _check_structured_outputs_config(args)
    _check_generation_config(args)
    _check_attention_config(args.attention_config, args)
    _check_output_parsers(args)


def _parallel_flags_used(args: argparse.Namespace) -> list[str]:
    """The parallelism flags set above 1, as written on the command line (`--tensor-parallel-size 2`)."""
    return [f"--{n.replace('_', '-')} {getattr(args, n)}" for n in
            ("tensor_parallel_size", "data_parallel_size", "prefill_context_parallel_size",
             "decode_context_parallel_size") if getattr(args, n, 1) > 1]


def _check_speculative_config(args: argparse.Namespace) -> None:
    """`--speculative-config`: MTP speculation (`serving/spec_decode/config.py`), parsed here so a
    bad key fails at start-up naming it. It runs on one device and on every parallel layout (the
    checkpoint's lack of an MTP layer is found when it is loaded)."""
    from serving.spec_decode import SpeculativeConfig, SpeculativeConfigError

    if args.speculative_config is None:
        return
    try:
        SpeculativeConfig.from_dict(args.speculative_config)
    except SpeculativeConfigError as e:
        raise ArgumentError(str(e)) from None


def _check_multihost(args: argparse.Namespace) -> None:
    """A multi-process engine (serving/multihost): process 0 serves HTTP and schedules, the others
    run `--headless`. Sets `args.multihost` (a `serving.multihost.MultiHostConfig`, or None for one
    process). The host mechanism "callback" of HiSparse and the offloading connector is refused
    when the engine is built (`serving.runner.ModelRunner`): it keeps one numpy store per process."""
    args.multihost = None
    if args.headless and args.num_processes < 2:
        raise ArgumentError("--headless runs a follower of a multi-process engine: it needs --num-processes >= 2 "
                            "and --process-id > 0")
    if args.num_processes < 2:
        return
    if args.headless and args.process_id == 0:
        raise ArgumentError("--headless is for --process-id > 0: process 0 is the leader (it serves HTTP)")
    if not args.peer_timeout > 0:
        raise ArgumentError(f"--peer-timeout must be > 0, got {args.peer_timeout}")
    from serving.multihost import MultiHostConfig

    host, _, port = args.distributed_config.coordinator_address.rpartition(":")
    master_port = args.master_port if args.master_port is not None else int(port) + 1
    if not 0 < master_port < 65535:
        raise ArgumentError(f"--master-port must be in [1, 65534] (it and the next port are used), got {master_port}")
    args.multihost = MultiHostConfig(f"{args.master_addr or host}:{master_port}", args.num_processes,
                                     args.process_id, args.peer_timeout, args.distributed_timeout)


def _check_kv_transfer_config(args: argparse.Namespace) -> None:
    """`--kv-transfer-config`: the OffloadingConnector (`serving/offload/config.py`), parsed here
    so a bad key fails at start-up naming it. It keys the host store by the prefix cache's hashes,
    so it needs --enable-prefix-caching."""
    from serving.kv_transfer_config import KVTransferConfigError
    from serving.offload import OffloadConfigError, offload_config
    from serving.pd import pd_config

    if args.kv_transfer_config is None:
        return
    try:
        off = offload_config(args.kv_transfer_config)
        pd_config(args.kv_transfer_config)
    except (OffloadConfigError, KVTransferConfigError) as e:
        raise ArgumentError(str(e)) from None
    if off is None:
        return
    if not args.enable_prefix_caching:
        raise ArgumentError("--kv-transfer-config OffloadingConnector needs --enable-prefix-caching (the host store "
                            "is keyed by the prefix cache's block hashes)")


def _check_kv_events_config(args: argparse.Namespace) -> None:
    """`--kv-events-config` (serving/kv_events/config.py), parsed here so a bad key fails at
    start-up naming it; events report the prefix cache, so they need --enable-prefix-caching."""
    from serving.kv_events import KVEventsConfig, KVEventsConfigError

    try:
        config = KVEventsConfig.from_dict(getattr(args, "kv_events_config", None))
    except KVEventsConfigError as e:
        raise ArgumentError(str(e)) from None
    if config is not None and not args.enable_prefix_caching:
        raise ArgumentError("--kv-events-config needs --enable-prefix-caching (the events report the prefix cache)")


def _check_generation_config(args: argparse.Namespace) -> None:
    """`--generation-config DIR` and `--override-generation-config`, read here so a missing file or
    a bad value fails at start-up (the checkpoint's own file is read once the engine has it)."""
    from serving.generation_defaults import (
        GenerationConfigError,
        load_generation_defaults,
    )

    try:
        load_generation_defaults(args.generation_config, None, args.override_generation_config)
    except GenerationConfigError as e:
        raise ArgumentError(str(e)) from None


def _check_structured_outputs_config(args: argparse.Namespace) -> None:
    """`--structured-outputs-config`, parsed here so a bad key fails at start-up naming it."""
    from serving.structured_outputs.config import (
        StructuredOutputsConfig,
        StructuredOutputsConfigError,
    )

    try:
        StructuredOutputsConfig.from_dict(getattr(args, "structured_outputs_config", None))
    except StructuredOutputsConfigError as e:
        raise ArgumentError(str(e)) from None


def _check_attention_config(config: dict | None, args: argparse.Namespace | None = None) -> None:
    """`--attention-config`: `sparse_mla_force_mqa: true` is what this build always does (prompts
    no longer than index_topk stay on the sparse MLA op; there is no dense-MHA prefill path), so it
    is accepted with a start-up warning naming the key; `false` and unknown keys are refused naming the key. `hisparse_config` (Hybrid
    HiSparse, `serving/hisparse/config.py`) is parsed here so a bad key fails at start-up; it runs
    on every parallel layout (docs/hisparse.md)."""
    from serving.hisparse import HiSparseConfigError, hisparse_config

    for key, value in (config or {}).items():
        if key == "sparse_mla_force_mqa":
            if value is not True:
                raise _not_yet(f"--attention-config sparse_mla_force_mqa={json.dumps(value)} "
                               "(only true: short prompts always take the sparse MLA path)")
            logger.warning("--attention-config sparse_mla_force_mqa=true changes nothing here: this build "
                           "always runs short prompts through the sparse MLA op (there is no dense-MHA path)")
        elif key == "hisparse_config":
            try:
                hisparse_config(config)
            except HiSparseConfigError as e:
                raise ArgumentError(str(e)) from None
        else:
            raise ArgumentError(f"--attention-config: unknown key {key!r} "
                                "(known: sparse_mla_force_mqa, hisparse_config)")


def _check_output_parsers(args: argparse.Namespace) -> None:
    if args.reasoning_parser is not None and args.reasoning_parser not in REASONING_PARSERS:
        raise ArgumentError(
            f"--reasoning-parser {args.reasoning_parser}: unknown (supported: {', '.join(REASONING_PARSERS)})"
        )
    if args.tool_call_parser is not None and args.tool_call_parser not in TOOL_CALL_PARSERS:
        raise ArgumentError(
            f"--tool-call-parser {args.tool_call_parser}: unknown (supported: {', '.join(TOOL_CALL_PARSERS)})"
        )
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ArgumentError("--enable-auto-tool-choice requires --tool-call-parser (e.g. glm47)")
