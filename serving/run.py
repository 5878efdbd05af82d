"""`python -m serving.run [--model PATH] …`: the OpenAI-compatible server.

With no arguments it serves the embedded tiny GLM-5.3-structured checkpoint (generated on first
use under `$GLM53_HOME` or `~/.cache/glm53`) on http://127.0.0.1:8000. Flags follow vLLM's names;
unsupported combinations fail at start-up with a message naming the flag. `--model` takes an HF
safetensors directory or an orbax directory from scripts/convert_checkpoint.py. The multi-process
flags (`--coordinator-address`, `--num-processes`, `--process-id`, ...; sharding/distributed.py)
initialise `jax.distributed` before any JAX backend exists; process 0 then serves and schedules
and the others run `--headless` (serving/multihost, docs/multihost.md). SIGTERM / Ctrl-C drain the server
(`--shutdown-timeout`), and a dead engine makes the process exit 1 (`serving/lifecycle.py`).
"""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger("serving.run")


def _setup(args):
    """Join `jax.distributed` (before anything creates a JAX backend), enable the compilation
    cache, configure logging, resolve `--model` → the checkpoint path (None: the tiny one)."""
    from glm53.compile_cache import enable_compilation_cache
    from glm53.hub import ModelNotFoundError, resolve_model
    from sharding.distributed import initialize as init_distributed

    try:
        init_distributed(args.distributed_config)
    except RuntimeError as e:
        raise SystemExit(f"error: {e}") from e
    enable_compilation_cache()
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.multihost is not None:
        import jax

        n = args.parallel.num_devices if args.parallel is not None else 1
        if n != jax.device_count():
            raise SystemExit(f"error: the parallel layout ({n} devices: dp x pcp x tp) must cover all "
                             f"{jax.device_count()} devices of the {args.num_processes} processes "
                             f"({jax.local_device_count()} here); set --tensor-parallel-size / --data-parallel-size / "
                             "--prefill-context-parallel-size")
    try:
        return resolve_model(args.model)  # a directory, 'tiny' (None), or a hub id → its snapshot
    except ModelNotFoundError as e:
        raise SystemExit(f"error: {e}") from e


def engine_args(args, model):
    """Validated flags + the resolved model path → `EngineArgs`."""
    from serving.engine import EngineArgs
    from serving.step_buckets import cuda_graph_sizes

    return EngineArgs(
        model=model, dtype=args.dtype, quantization=args.quantization, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs or 32, max_num_batched_tokens=args.max_num_batched_tokens or 512,
        gpu_memory_utilization=args.gpu_memory_utilization, num_gpu_blocks_override=args.num_gpu_blocks_override,
        seed=args.seed, enable_prefix_caching=args.enable_prefix_caching, max_logprobs=args.max_logprobs,
        disable_log_stats=args.disable_log_stats, parallel=args.parallel,
        kv_cache_dtype=args.kv_cache_dtype, cuda_graph_sizes=cuda_graph_sizes(args.cuda_graph_sizes),
        precompile_token_paddings=args.precompile_token_paddings,
        attention_config=args.attention_config, kv_transfer_config=args.kv_transfer_config,
        speculative_config=args.speculative_config, kv_events_config=args.kv_events_config,
        structured_outputs_config=args.structured_outputs_config,
        async_scheduling=args.async_scheduling)


def build_server(argv: list[str] | None = None, args=None):
    """Parse flags (or take validated `args`), load the model, compile, and return
    (app, args, async_engine). In a multi-process engine this is process 0 (the leader): it
    waits for the followers before returning (`async_engine.multihost_channel`)."""
    from glm53.tokenizer import GlmTokenizer
    from serving.async_engine import AsyncEngine
    from serving.cli_args import make_arg_parser, validate_args
    from serving.engine_factory import build_engine
    from serving.metrics import PrometheusStatLogger

    if args is None:
        args = make_arg_parser().parse_args(argv)
        validate_args(args)
    model = _setup(args)
    tokenizer = None
    if model is not None:  # the tokenizer before minutes of weight loading and compiling
        try:
            tokenizer = GlmTokenizer.from_pretrained(model)
        except (FileNotFoundError, ValueError) as e:
            raise SystemExit(f"error: {e} (the server needs the checkpoint's tokenizer)") from e
    channel, holder = None, {}
    if args.multihost is not None:
        from serving.multihost.leader import open_leader_channel

        try:
            channel = open_leader_channel(args.multihost, on_lost=lambda reason: _peer_lost(holder, reason))
        except ValueError as e:
            raise SystemExit(f"error: {e}") from e
        holder["channel"] = channel
    before_compile = None
    if channel is not None:
        from serving.multihost.leader import attach_leader, handshake

        def before_compile(engine):
            handshake(engine, channel, args.multihost)
    try:
        engine = build_engine(engine_args(args, model), before_compile=before_compile)
        if channel is not None:
            attach_leader(engine, channel)
        engine.start_structured_precompile(default=True)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        if channel is not None:
            _exit_now(channel, f"error: {e}", f"the leader failed to start: {e}")
        raise SystemExit(f"error: {e}") from e
    if tokenizer is None:  # the tiny preset, generated by the engine's start-up
        tokenizer = GlmTokenizer.from_pretrained(engine.model_path)
    if tokenizer.chat_template is None:
        logger.warning("%s has no chat template (neither chat_template.jinja nor a chat_template entry in "
                       "tokenizer_config.json): /v1/chat/completions will answer 400; /v1/completions serves",
                       engine.model_path)
    if args.served_model_name:
        name = args.served_model_name[0]  # answers and metrics carry the first; requests may name any
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
    async_engine.multihost_channel = channel
    if args.profiler_config is not None:
        from serving.profiling import EngineProfiler

        async_engine.profiler = EngineProfiler(args.profiler_config, step_sink=engine.runner.step_sink,
                                               num_processes=args.multihost.num_processes if args.multihost else 1)
    if channel is not None:
        holder["engine"] = async_engine
        if channel.lost is not None:
            _peer_lost(holder, channel.lost)
    app = build_api(args, async_engine, tokenizer, metrics)
    return app, args, async_engine


def _peer_lost(holder: dict, reason: str) -> None:
    """The leader's channel lost a follower: the engine is dead (503, open requests fail, exit 1)."""
    from serving.faults import EngineDeadError

    engine = holder.get("engine")
    if engine is not None:
        engine.fail(EngineDeadError(f"a process of the multi-process engine was lost: {reason}"))
    else:  # still starting (compiling, perhaps blocked in a collective with the lost process)
        _exit_now(holder["channel"], f"error: a process of the multi-process engine was lost during start-up: "
                                     f"{reason}", "the engine could not start")


def _exit_without_teardown(code: int) -> None:
    """Flush the logs and stdio, then end the process with `code` at once, skipping the
    interpreter's teardown and exit hooks: JAX's would wait for multi-process peers that may be
    gone, and tearing down under a background XLA compile crashes (SIGSEGV)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _exit_now(channel, message: str, abort_reason: str) -> None:
    """A multi-process leader that cannot start: tell the followers, print `message`, exit 1 now
    (JAX's exit hooks would wait for the other processes in its shutdown barrier)."""
    channel.stop(abort_reason=abort_reason)
    print(message, file=sys.stderr, flush=True)
    _exit_without_teardown(1)


def _follower_main(args) -> int:
    """`--headless` process of a multi-process engine → its exit status (serving/multihost)."""
    from serving.engine_factory import build_engine
    from serving.multihost.channel import FollowerChannel, StartRefused
    from serving.multihost.follower import hello, run_follower
    from sharding.distributed import shutdown

    model = _setup(args)
    mh = args.multihost
    logger.info("process %d of %d: headless follower; the leader's step channel is %s", mh.process_id,
                mh.num_processes, mh.address)
    channel = FollowerChannel(mh.address, mh.process_id, mh.peer_timeout_s)
    try:
        engine = build_engine(engine_args(args, model), before_compile=lambda e: hello(e, channel, mh.join_timeout_s))
    except StartRefused as e:
        logger.error("process %d: the leader refused to start the engine: %s", mh.process_id, e)
        return 1
    except Exception as e:  # noqa: BLE001
        logger.error("process %d could not build its engine: %s: %s", mh.process_id, type(e).__name__, e)
        channel.fatal(f"could not build its engine: {e}")
        return 1
    code = run_follower(engine, channel, mh)
    channel.close()
    if code == 0:
        shutdown()
    return code


def _leave_multihost(channel, exit_code: int) -> None:
    """The leader stops: tell the followers (STOP, or ABORT when the engine died), then leave
    `jax.distributed` cleanly, or exit at once with `exit_code` (a lost peer would make JAX's
    own shutdown wait for it)."""
    from sharding.distributed import shutdown

    channel.stop(abort_reason=None if exit_code == 0 else "the leader's engine died")
    if exit_code:
        _exit_without_teardown(exit_code)
    shutdown()


def build_api(args, async_engine, tokenizer, metrics=None):
    """The HTTP app for validated `args` over a running engine (API key, output parsers, the
    generation config's default sampling, and `/metrics` when a `PrometheusStatLogger` is given)."""
    from fastapi.responses import Response
    from prometheus_client import CONTENT_TYPE_LATEST

    from serving.api import build_app
    from serving.api.chat_output import ChatParsing
    from serving.api.profiler import add_profiler_routes
    from serving.generation_defaults import describe as describe_generation_defaults
    from serving.generation_defaults import load_generation_defaults

    async def prometheus_metrics(request) -> Response:
        """Prometheus text format, vLLM metric names (serving/metrics.py)."""
        # (through app.state, as build_app's routes: a closure would keep the engine alive)
        return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def add_routes(app) -> None:
        if metrics is not None:
            app.add_route("/metrics", prometheus_metrics, methods=["GET"], include_in_schema=False)  # a plain route
        if args.profiler_config is not None:
            add_profiler_routes(app)

    parsing = ChatParsing(reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
                          enable_auto_tool_choice=args.enable_auto_tool_choice)
    defaults = load_generation_defaults(args.generation_config, async_engine.engine.model_path,
                                        args.override_generation_config)
    logger.info(describe_generation_defaults(defaults, args.generation_config))
    app = build_app(async_engine, tokenizer, async_engine.model_name, api_key=args.api_key, chat_parsing=parsing,
                    model_aliases=args.served_model_name or (),
                    responses_store_size=args.responses_store_size,
                    responses_store_max_bytes=int(args.responses_store_max_mib * (1 << 20)),
                    extra_routes=add_routes, model_root=args.model or "tiny",
                    default_sampling=defaults)
    app.state.metrics = metrics
    return app


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from serving.cli_args import ArgumentError, make_arg_parser, validate_args

    try:
        args = make_arg_parser().parse_args(argv)
        validate_args(args)
    except ArgumentError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    if args.multihost is not None and not args.multihost.is_leader:
        _exit_without_teardown(_follower_main(args))  # JAX's exit hooks would wait for peers that may be gone
    app, args, engine = build_server(args=args)
    from serving.lifecycle import DrainMiddleware, GracefulServer

    logger.info("serving %s on http://%s:%d", engine.model_name, args.host, args.port)
    drain = DrainMiddleware(app)
    config = uvicorn.Config(drain, host=args.host, port=args.port, log_level=str(args.log_level).lower(),
                            timeout_graceful_shutdown=5)
    server = GracefulServer(config, engine, drain, args.shutdown_timeout)
    channel = engine.multihost_channel
    try:
        server.run()
    finally:
        # Every request has been answered: the engine thread only finishes its step. A step
        # compiled on first use may hold it for a minute, and a dead multi-process engine may
        # have it blocked on a lost peer: do not wait long for either.
        engine.shutdown(timeout=5 if channel is None or not server.exit_code else 2)
    if channel is not None:
        _leave_multihost(channel, server.exit_code)
    if engine.engine_thread_running():
        logger.info("exiting without waiting for the engine thread's step (still running after 5 s)")
        _exit_without_teardown(server.exit_code)
    if engine.background_compile_running():
        # The structured-output variants' compile thread is inside XLA (it stops after the variant
        # in progress, which may take a minute): exit now, as the drain promised.
        logger.info("exiting without waiting for the step variant being compiled in the background")
        _exit_without_teardown(server.exit_code)
    if server.exit_code:
        raise SystemExit(server.exit_code)


if __name__ == "__main__":
    main()
