"""`python -m serving.run [--model PATH] …`: the OpenAI-compatible server.

With no arguments it serves the embedded tiny GLM-5.3-structured checkpoint (generated on first
use under `$GLM53_HOME` or `~/.cache/glm53`) on http://127.0.0.1:8000. Flags follow vLLM's names;
unsupported combinations fail at start-up with a message naming the flag.
"""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger("serving.run")


def _enable_compilation_cache() -> None:
    """Persist compiled steps across restarts under `$GLM53_HOME/jax-compilation-cache`
    (default `~/.cache/glm53/…`); set GLM53_COMPILATION_CACHE=off to disable."""
    import jax

    if os.environ.get("GLM53_COMPILATION_CACHE", "") == "off":
        return
    home = os.environ.get("GLM53_HOME", os.path.expanduser("~/.cache/glm53"))
    jax.config.update("jax_compilation_cache_dir", os.path.join(home, "jax-compilation-cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def build_server(argv: list[str] | None = None):
    """Parse flags, load the model, compile, and return (app, args, async_engine)."""
    from glm53.tokenizer import GlmTokenizer
    from serving.api import build_app
    from serving.async_engine import AsyncEngine
    from serving.cli_args import make_arg_parser, validate_args
    from serving.engine import EngineArgs, LLMEngine

    args = make_arg_parser().parse_args(argv)
    validate_args(args)
    _enable_compilation_cache()
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model = args.model
    if model is not None and not os.path.isdir(model):
        from glm53.config import PRESETS
        if model == "tiny":
            model = None
        elif model in PRESETS:
            raise SystemExit(f"--model {model}: presets other than 'tiny' have no weights here; "
                             "pass a checkpoint directory")
        else:
            raise SystemExit(f"--model {model}: not a directory")
    eargs = EngineArgs(
        model=model, dtype=args.dtype, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs or 32, max_num_batched_tokens=args.max_num_batched_tokens or 512,
        gpu_memory_utilization=args.gpu_memory_utilization, num_gpu_blocks_override=args.num_gpu_blocks_override,
        seed=args.seed, kv_cache_dtype=args.kv_cache_dtype)
    try:
        engine = LLMEngine.from_args(eargs)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from e
    tokenizer = GlmTokenizer.from_pretrained(engine.model_path)
    name = args.served_model_name or (os.path.basename(os.path.normpath(args.model)) if args.model else "glm-5.3-tiny")
    async_engine = AsyncEngine(engine, name)
    app = build_app(async_engine, tokenizer, name, api_key=args.api_key)
    return app, args, async_engine


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from serving.cli_args import ArgumentError

    try:
        app, args, engine = build_server(argv)
    except ArgumentError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    logger.info("serving %s on http://%s:%d", engine.model_name, args.host, args.port)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=str(args.log_level).lower())
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
