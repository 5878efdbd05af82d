"""Structured outputs' step variants compiled in a background thread (`serving.runner_variants`).

The executables compiled ahead of time must be the programs the engine would have compiled on
first use: the constrained streams (greedy and seeded, synchronous and asynchronous scheduling,
logprobs) of an engine running them equal those of an engine that compiled its variants lazily,
and no constrained step of the precompiled engine compiled on the engine thread. The hand-off
between the thread and the engine thread (a variant not reached yet is taken by the engine, one
being compiled is waited for, a failed one falls back) is checked on stand-in functions.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from glm53.tokenizer import GlmTokenizer
from serving.engine import EngineArgs
from serving.engine_factory import build_engine
from serving.runner_variants import VariantPrecompileMixin, _Job
from serving.structured_outputs import StructuredOutputsParams
from serving.types import SamplingParams

# The tiny checkpoint's 7-layer twin (tests/helpers/shallow_model.py): the same code paths, faster steps.
pytestmark = pytest.mark.shallow_model

SCHEMA = {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                           "y": {"type": "boolean"}},
          "required": ["x", "y"], "additionalProperties": False}


def _engine():
    # The engine of tests/serving/test_structured_outputs.py: one token bucket (64).
    return build_engine(EngineArgs(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, cuda_graph_sizes=[],
                                   precompile_token_paddings=[], compile_progress=False, disable_log_stats=True))


def _requests(tok) -> dict:
    prompt = tok.encode("Give me a point:")
    out = {}
    for i in range(3):
        out[f"re{i}"] = (prompt, SamplingParams(temperature=0 if i == 0 else 1.0, seed=i, max_tokens=24, logprobs=2,
                                                structured_outputs=StructuredOutputsParams(regex=r"[a-z]{2,6}-[0-9]{2}")))
        out[f"js{i}"] = (prompt, SamplingParams(temperature=0 if i == 0 else 1.0, seed=10 + i, max_tokens=40,
                                                structured_outputs=StructuredOutputsParams(
                                                    json=SCHEMA, disable_any_whitespace=True)))
    out["free"] = (prompt, SamplingParams(temperature=0, max_tokens=12))  # an unconstrained neighbour
    return out


def _run(e, requests: dict, async_scheduling: bool):
    e.set_async_scheduling(async_scheduling)
    toks = {r: [] for r in requests}
    lps = {r: [] for r in requests}
    for rid, (prompt, params) in requests.items():
        e.add_request(rid, prompt, params)
    while e.has_unfinished_requests():
        for o in e.step():
            toks[o.request_id] += o.new_token_ids
            lps[o.request_id] += [[(lp.token_id, lp.logprob), *lp.top] for lp in (o.new_logprobs or [])]
        assert e.audit() == []
    e.set_async_scheduling(False)
    return toks, lps


@pytest.fixture(scope="module")
def lazy():
    """An engine that compiles its variants on the engine thread, on first use."""
    return _engine()


@pytest.fixture(scope="module")
def precompiled():
    e = _engine()
    n = e.runner.start_variant_precompile(-(-e._structured_vocab_size // 32), forward_only=True)
    assert e.runner.wait_variant_precompile(timeout=900)
    return e, n


def test_precompiled_variants_run_the_programs_first_use_compiles(precompiled, lazy):
    e, n = precompiled
    runner = e.runner
    # One bucket, one program: the forward pass alone, the masked step, the sampler with and without a
    # mask, and with the smallest list of penalties (serving/penalties.py), then the step with
    # prompt-logprob rows (serving/prompt_logprobs.py).
    assert n == 6 and set(runner.variant_compile_seconds) == {("forward-only", 64, True), ("masked", 64, True),
                                                              ("sample", True), ("sample", False),
                                                              ("sample", False, "penalized64"),
                                                              ("prompt-logprobs", 64, True)}
    assert all(j.compiled is not None for j in runner._variant_jobs.values())
    tok = GlmTokenizer.from_pretrained(e.model_path)
    reqs = _requests(tok)
    ref = lazy
    for async_scheduling in (False, True):
        calls = runner.num_precompiled_calls
        got = _run(e, reqs, async_scheduling)
        assert runner.num_precompiled_calls > calls, "the precompiled executables were not used"
        want = _run(ref, reqs, async_scheduling)
        assert got[0] == want[0]
        for rid in reqs:  # the same programs: logprobs equal to float rounding
            for a, b in zip(got[1][rid], want[1][rid]):
                assert [t for t, _ in a] == [t for t, _ in b]
                np.testing.assert_allclose([lp for _, lp in a], [lp for _, lp in b], atol=1e-6)
    # Penalties and a logit bias (under 64 entries) run the thread's forward pass and sampler too.
    pen = {"p": (tok.encode("Give me a point:"), SamplingParams(temperature=0, max_tokens=12, frequency_penalty=-1.0,
                                                                logit_bias={42: 1.5}))}
    for async_scheduling in (False, True):
        calls = runner.num_precompiled_calls
        got = _run(e, pen, async_scheduling)
        assert runner.num_precompiled_calls > calls and got[0] == _run(ref, pen, async_scheduling)[0]
    # A scoring request (prompt logprobs, serving/prompt_logprobs.py) runs the thread's step with its rows.

    def score(engine):
        engine.add_request("s", tok.encode("Score this text, please."),
                           SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
        plp = None
        while engine.has_unfinished_requests():
            for o in engine.step():
                plp = o.prompt_logprobs or plp
        return plp[1:]

    calls = runner.num_precompiled_calls
    got = score(e)
    assert runner.num_precompiled_calls > calls
    want = score(ref)
    assert [(x.token_id, x.rank) for x in got] == [(x.token_id, x.rank) for x in want]
    np.testing.assert_allclose([x.logprob for x in got], [x.logprob for x in want], atol=1e-6)
    # Every constrained, penalised or scoring step of the precompiled engine ran an executable of the thread's.
    assert runner.num_first_use_compiles == 0
    assert ref.runner.num_first_use_compiles >= 2
    assert e.pool.num_free == e.pool.num_usable_blocks and not e.structured.requests


class _Lowered:
    def __init__(self, fn):
        self.fn = fn

    def compile(self):
        return self.fn()


class _Fn:
    """A stand-in jitted function: `lower(...).compile()` runs `make` (which may block or fail)."""

    def __init__(self, make):
        self.make = make

    def lower(self, *args):
        return _Lowered(self.make)

    def __call__(self, *args):
        return ("jit", args)


class _Runner(VariantPrecompileMixin):
    kernel_mode = "auto"

    def __init__(self):
        self._first_use_programs = set()


def test_the_engine_takes_unreached_variants_waits_for_one_in_progress_and_falls_back_on_failure():
    r = _Runner()
    gate, started = threading.Event(), threading.Event()

    def slow():
        started.set()
        gate.wait(10)
        return lambda *a: ("aot", a)

    def fails():
        raise RuntimeError("no backend")

    # (Their "abstract arguments" are the call's own: one host value.)
    jobs = [_Job(("masked", 1, True), _Fn(slow), (7,)), _Job(("masked", 2, True), _Fn(fails), (7,)),
            _Job(("masked", 4, True), _Fn(lambda: (lambda *a: ("aot", a))), (7,))]
    r._variant_jobs = {j.key: j for j in jobs}
    r.variant_compile_seconds = {}
    r._variant_stop = threading.Event()
    r._variant_thread = threading.Thread(target=r._compile_variants, args=(jobs, r._variant_stop), daemon=True)
    r._variant_thread.start()
    assert started.wait(10)
    # Bucket 4 is still queued: the engine takes it (its jit compiles it), the thread then skips it.
    assert r.call_variant(("masked", 4, True), _Fn(None), 7) == ("jit", (7,))
    # Bucket 1 is being compiled: the engine waits for it and runs the executable.
    threading.Timer(0.2, gate.set).start()
    assert r.call_variant(("masked", 1, True), _Fn(None), 7) == ("aot", (7,))
    assert r.wait_variant_precompile(10)
    assert r._variant_jobs[("masked", 4, True)].state == "taken"
    # Bucket 2 failed in the thread: first use compiles it.
    assert r.call_variant(("masked", 2, True), _Fn(None), 7) == ("jit", (7,))
    # Not a variant the thread knows (e.g. a plain step): the jitted function.
    assert r.call_variant(("masked", 8, True), _Fn(None), 1) == ("jit", (1,))
    assert r.num_precompiled_calls == 1
    # Arguments placed otherwise than the executable was compiled for: the jit, and the executable is dropped.
    done = _Job(("masked", 16, True), _Fn(None), (7,))
    done.state, done.compiled = "done", (lambda *a: ("aot", a))
    done.done.set()
    r._variant_jobs[done.key] = done
    assert r.call_variant(done.key, _Fn(None), (7, 8)) == ("jit", ((7, 8),)) and done.compiled is None


def test_server_default_and_the_config_key():
    from serving.structured_outputs.config import (
        StructuredOutputsConfig,
        StructuredOutputsConfigError,
    )

    assert StructuredOutputsConfig.from_dict(None).precompile is None
    assert StructuredOutputsConfig.from_dict({"precompile": False}).precompile is False
    with pytest.raises(StructuredOutputsConfigError, match="precompile must be true or false"):
        StructuredOutputsConfig.from_dict({"precompile": "yes"})


def test_which_engines_start_the_background_compile(lazy):
    """The server asks for it by default (`default=True`), `LLM` does not; the config key wins both
    ways; an engine that leaves its buckets to first use leaves the variants too. (Last in the
    module: it starts the thread on the lazily compiling engine, whose variants are compiled by
    then.)"""
    e = lazy
    e.args.skip_precompile = True
    assert e.start_structured_precompile(default=True) == 0
    e.args.skip_precompile = False
    assert e.start_structured_precompile(default=False) == 0
    e.structured_config = type(e.structured_config).from_dict({"precompile": False})
    assert e.start_structured_precompile(default=True) == 0
    e.structured_config = type(e.structured_config).from_dict(None)
    # Synchronous scheduling, one bucket, no HiSparse: the masked step, and the split step that
    # penalties and logit biases run whatever the scheduling (the forward pass, the samplers).
    assert e.start_structured_precompile(default=True) == 6
    assert e.runner.wait_variant_precompile(timeout=900)
    assert [(k, j.compiled is not None) for k, j in e.runner._variant_jobs.items()] == [
        (("forward-only", 64, True), True), (("masked", 64, True), True), (("sample", True), True),
        (("sample", False), True), (("sample", False, "penalized64"), True), (("prompt-logprobs", 64, True), True)]


def test_arguments_in_host_memory_are_left_to_first_use():
    """On jax 0.11.2 an executable lowered from an abstract argument in pinned_host memory returns
    it in device memory and aborts the process when that argument is donated (what HiSparse's hot
    program does with its host pool): such variants are not compiled ahead of time."""
    import jax

    from serving.runner_variants import _device_only, abstract

    dev = jax.devices()[0]
    host = jax.device_put(np.zeros(4, np.uint32), jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host"))
    on_device = jax.device_put(np.zeros(4, np.uint32), dev)
    assert _device_only((abstract(on_device), abstract(np.zeros(3)), None))
    assert not _device_only((abstract(on_device), {"pool": abstract(host)}))
