"""`python -m serving.run [--model PATH] …`: the OpenAI-compatible server.

With no arguments it serves the embedded tiny GLM-5.3-structured checkpoint (generated on first
use under `$GLM53_HOME` or `~/.cache/glm53`) on http://127.0.0.1:8000. Flags follow vLLM's names;
unsupported combinations fail at start-up with a message naming the flag. `--model` takes an HF
safetensors directory or an orbax directory from scripts/convert_checkpoint.py. The multi-process
flags (`--coordinator-address`, `--num-processes`, `--process-id`, ...; sharding/distributed.py)
initialise `jax.distributed` before any JAX backend exists. SIGTERM / Ctrl-C drain the server
(`--shutdown-timeout`), and a dead engine makes the process exit 1 (`serving/lifecycle.py`).
"""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger("serving.run")


def build_server(argv: list[str] | None = None):
    """Parse flags, load the model, compile, and return (app, args, async_engine)."""
    from glm53.compile_cache import enable_compilation_cache
    from glm53.tokenizer import GlmTokenizer
    from serving.async_engine import AsyncEngine
    from serving.cli_args import make_arg_parser, validate_args
    from serving.engine import EngineArgs
    from serving.engine_factory import build_engine
    from serving.metrics import PrometheusStatLogger
    from serving.step_buckets import cuda_graph_sizes

    from sharding.distributed import initialize as init_distributed

    args = make_arg_parser().parse_args(argv)
    validate_args(args)
    try:  # before anything creates a JAX backend
        init_distributed(args.distributed_config)
    except RuntimeError as e:
        raise SystemExit(f"error: {e}") from e
    enable_compilation_cache()
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from glm53.hub import ModelNotFoundError, resolve_model

    try:
        model = resolve_model(args.model)  # a directory, 'tiny' (None), or a hub id → its snapshot
    except ModelNotFoundError as e:
        raise SystemExit(f"error: {e}") from e
    eargs = EngineArgs(
        model=model, dtype=args.dtype, quantization=args.quantization, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs or 32, max_num_batched_tokens=args.max_num_batched_tokens or 512,
        gpu_memory_utilization=args.gpu_memory_utilization, num_gpu_blocks_override=args.num_gpu_blocks_override,
        seed=args.seed, enable_prefix_caching=args.enable_prefix_caching, max_logprobs=args.max_logprobs,
        disable_log_stats=args.disable_log_stats, parallel=args.parallel,
        kv_cache_dtype=args.kv_cache_dtype, cuda_graph_sizes=cuda_graph_sizes(args.cuda_graph_sizes),
        precompile_token_paddings=args.precompile_token_paddings,
        attention_config=args.attention_config, kv_transfer_config=args.kv_transfer_config,
        speculative_config=args.speculative_config, kv_events_config=args.kv_events_config)
    try:
        engine = build_engine(eargs)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from e
    tokenizer = GlmTokenizer.from_pretrained(engine.model_path)
    if args.served_model_name:
        name = args.served_model_name
    elif model is None:  # no --model, or --model tiny
        name = "glm-5.3-tiny"
    elif not os.path.isdir(args.model):  # a hub id: served under it, as vLLM does
        name = args.model
    else:
        name = os.path.basename(os.path.normpath(args.model))
    metrics = PrometheusStatLogger(name, engine.gauges)
    if getattr(engine, "pd", None) is not None:
        from serving.pd.metrics import PDCollector

        metrics.registry.register(PDCollector(engine.pd, name))
    engine.stat_loggers.append(metrics)
    async_engine = AsyncEngine(engine, name)
    app = build_api(args, async_engine, tokenizer, metrics)
    return app, args, async_engine


def build_api(args, async_engine, tokenizer, metrics=None):
    """The HTTP app for validated `args` over a running engine (API key, output parsers, and
    `/metrics` when a `PrometheusStatLogger` is given)."""
    from fastapi.responses import Response
    from prometheus_client import CONTENT_TYPE_LATEST

    from serving.api import build_app
    from serving.api.chat_output import ChatParsing

    async def prometheus_metrics(request) -> Response:
        """Prometheus text format, vLLM metric names (serving/metrics.py)."""
        # (through app.state, as build_app's routes: a closure would keep the engine alive)
        return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def add_metrics(app) -> None:
        app.add_route("/metrics", prometheus_metrics, methods=["GET"], include_in_schema=False)  # a plain Starlette route

    parsing = ChatParsing(reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
                          enable_auto_tool_choice=args.enable_auto_tool_choice)
    app = build_app(async_engine, tokenizer, async_engine.model_name, api_key=args.api_key, chat_parsing=parsing,
                    extra_routes=add_metrics if metrics is not None else None)
    app.state.metrics = metrics
    return app


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from serving.cli_args import ArgumentError

    try:
        app, args, engine = build_server(argv)
    except ArgumentError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    from serving.lifecycle import DrainMiddleware, GracefulServer

    logger.info("serving %s on http://%s:%d", engine.model_name, args.host, args.port)
    drain = DrainMiddleware(app)
    config = uvicorn.Config(drain, host=args.host, port=args.port, log_level=str(args.log_level).lower(),
                            timeout_graceful_shutdown=5)
    server = GracefulServer(config, engine, drain, args.shutdown_timeout)
    try:
        server.run()
    finally:
        engine.shutdown()
    if server.exit_code:
        raise SystemExit(server.exit_code)


if __name__ == "__main__":
    main()
