"""One engine over several processes (hosts): a leader that schedules, followers that run the same
step (docs/multihost.md).

Every process joins `jax.distributed` (sharding/distributed.py) and builds the same engine over
one global mesh (the same flags: model, layout, limits; `engine_fingerprint` is compared at the
handshake). Process 0, the **leader**, runs the HTTP server, tokenizer, scheduler, block pools and
prefix cache. Before each step it sends the step's host inputs (`serving.step_inputs.StepInputs`:
token ids, positions, block tables, slot mappings, page copies, sampling parameters, MTP inputs)
to every **follower** over the engine's own channel (`channel.py`: ZMQ, with a sequence number
and a CRC32 per step); every process places them as the same replicated global arrays and runs the
same compiled step, whose sampled tokens come out replicated, so the leader reads them from its
own devices. Followers (`--headless`) hold no scheduler state: only the parameters and the KV
arena, updated by the same steps.

Fail-stop: a lost peer (killed, frozen past `--peer-timeout`, a corrupt step message, a failed
step after its inputs were sent) stops the whole engine — the leader's `/health` answers 503, open
requests get an error and every process exits non-zero.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MultiHostConfig:
    """address: "HOST:PORT" of the leader's step channel (PORT + 1: heartbeats). num_processes ≥ 2;
    process_id 0 is the leader. peer_timeout_s: silence after which a peer is lost. join_timeout_s:
    how long the leader waits for every follower to build its engine (--distributed-timeout)."""

    address: str
    num_processes: int
    process_id: int
    peer_timeout_s: float = 10.0
    join_timeout_s: float = 300.0

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0


def engine_fingerprint(engine) -> dict:
    """What must be equal on every process for the steps to be the same program over the same
    arena: limits, page count, token buckets, layout sizes, cache dtype, model configuration."""
    import dataclasses
    import hashlib

    args = engine.args
    par = args.parallel
    runner = engine.runner
    cfg = dataclasses.asdict(engine.config) if dataclasses.is_dataclass(engine.config) else vars(engine.config)
    return {
        "max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens, "num_blocks": runner.num_blocks,
        "buckets": list(runner.buckets), "kv_cache_dtype": str(args.kv_cache_dtype), "seed": args.seed,
        "parallel": None if par is None else [par.tensor_parallel_size, par.data_parallel_size,
                                              par.prefill_context_parallel_size, par.decode_context_parallel_size,
                                              bool(par.enable_expert_parallel)],
        "num_speculative_tokens": runner.spec_k,
        "model_config": hashlib.sha256(repr(sorted(cfg.items())).encode()).hexdigest()[:16],
    }
