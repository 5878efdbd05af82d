"""Build the engine a configuration asks for: the one place that knows both engine classes.

`serving.engine.LLMEngine` serves one device and the TP / EP / PCP / DCP layouts;
`serving.dp_engine.DataParallelEngine` (a subclass) serves `--data-parallel-size` > 1. The factory
sits above both, so neither module imports the other's subclass.

    from serving.engine import EngineArgs
    from serving.engine_factory import build_engine
    engine = build_engine(EngineArgs(model="/path/to/ckpt"))
"""

from __future__ import annotations

from serving.dp_engine import DataParallelEngine
from serving.engine import EngineArgs, LLMEngine


def build_engine(args: EngineArgs, eos_token_ids=None, before_compile=None) -> LLMEngine:
    """Load the checkpoint, size the KV arena, build the engine and compile its step buckets
    (`LLMEngine.from_args`), as a `DataParallelEngine` when `args.parallel.data_parallel_size` > 1.
    `before_compile(engine)` runs between building and compiling (a multi-process engine's
    handshake, before the first collective). Raises ValueError (or its subclasses naming the flag)
    for a configuration that cannot be served."""
    dp = args.parallel.data_parallel_size if args.parallel is not None else 1
    cls = DataParallelEngine if dp > 1 else LLMEngine
    return cls.from_args(args, eos_token_ids, before_compile=before_compile)
