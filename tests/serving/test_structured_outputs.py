"""Structured outputs (`serving/structured_outputs/`) on the engine: JSON schemas, JSON objects,
regexes, choices and grammars enforced on the device.

The random-weight tiny model is the test's strength: unconstrained at temperature 1 it never writes
JSON (its streams are noise over 496 tokens), so every output that parses and validates — over
many seeds, against schemas with nested objects, arrays, enums, required keys and string patterns,
checked by the `jsonschema` library, and regexes checked by Python's `re` — comes from the mask.
Also checked: logprobs are over the allowed ids only (a position with one allowed id has logprob
0), unconstrained neighbours in the same steps are unaffected, asynchronous scheduling gives the
synchronous streams, MTP speculation never emits a forbidden token (forbidden drafts are rejected,
grammatical drafts accepted), and bad constraints are refused with the field named while the engine
keeps serving and leaks nothing.
"""

from __future__ import annotations

import json
import re

import jsonschema
import llguidance.numpy as lnp
import numpy as np
import pytest

from glm53.tokenizer import GlmTokenizer
from serving.engine import EngineArgs
from serving.engine_factory import build_engine
from serving.structured_outputs import StructuredOutputsError, StructuredOutputsParams
from serving.types import SamplingParams

# The tiny checkpoint's 7-layer twin (tests/helpers/shallow_model.py): the same code paths, faster steps.
pytestmark = pytest.mark.shallow_model

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        "address": {
            "type": "object",
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "ok": {"type": "boolean"}},
            "required": ["zip", "ok"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}
# No additionalProperties anywhere: closed by the disable_additional_properties option.
POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                          "y": {"type": "boolean"}},
         "required": ["x", "y"]}
REGEXES = [r"[a-z]{2,5}-[0-9]{3}", r"(yes|no|maybe)!", r"\(([0-9]{1,2}),([0-9]{1,2})\)"]
CHOICES = ["red", "green", "blue", "dark blue"]
MAX_TOKENS = 96
PROMPT = "Hello there! How are you today?"


def json_params(schema, **kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True, **kw)


@pytest.fixture(scope="module")
def engine():
    # One token bucket (the 64-token budget): the plain step and its masked variant.
    e = build_engine(EngineArgs(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, cuda_graph_sizes=[],
                                precompile_token_paddings=[], enable_prefix_caching=True, compile_progress=False,
                                disable_log_stats=True))
    yield e
    assert_clean(e)


def assert_clean(e) -> None:
    """Nothing left behind: no request, no matcher, no page."""
    assert not e.has_unfinished_requests() and e.audit() == []
    assert not e.structured.requests, "matchers of finished requests were kept"
    assert e.pool.num_free == e.pool.num_usable_blocks, "KV pages leaked"


@pytest.fixture(scope="module")
def tok(engine):
    return GlmTokenizer.from_pretrained(engine.model_path)


def run(e, requests: dict, async_scheduling: bool = False):
    """Run `requests` ({id: (prompt ids, SamplingParams)}) to the end, auditing every step.
    → ({id: tokens}, {id: finish reason}, {id: logprobs})."""
    switch = e.async_scheduling != async_scheduling
    if switch:
        e.set_async_scheduling(async_scheduling)
    toks, reasons, lps = {r: [] for r in requests}, {}, {r: [] for r in requests}
    for rid, (prompt, params) in requests.items():
        e.add_request(rid, prompt, params)
    while e.has_unfinished_requests():
        for o in e.step():
            assert o.request_id not in reasons
            toks[o.request_id] += o.new_token_ids
            lps[o.request_id] += o.new_logprobs or []
            if o.finished:
                reasons[o.request_id] = o.finish_reason
        assert e.audit() == []
    if switch:
        e.set_async_scheduling(not async_scheduling)
    return toks, reasons, lps


def text_of(tok, e, ids) -> str:
    return tok.decode([t for t in ids if t not in e.eos_token_ids])


def sampled_requests(tok, n_seeds: int, logprobs=None):
    """The mixed workload: per seed a schema, a closed-by-option schema, a regex and a choice
    request, at temperature 1."""
    prompt = tok.encode(PROMPT)
    reqs, checks = {}, {}
    for s in range(n_seeds):
        sp = {"temperature": 1.0, "seed": s, "max_tokens": MAX_TOKENS, "logprobs": logprobs}
        reqs[f"person{s}"] = (prompt, SamplingParams(**sp, structured_outputs=json_params(PERSON)))
        checks[f"person{s}"] = ("json", PERSON)
        reqs[f"point{s}"] = (prompt, SamplingParams(**sp, structured_outputs=json_params(
            POINT, disable_additional_properties=True)))
        checks[f"point{s}"] = ("json", {**POINT, "additionalProperties": False})
        rx = REGEXES[s % len(REGEXES)]
        reqs[f"regex{s}"] = (prompt, SamplingParams(**sp, structured_outputs=StructuredOutputsParams(regex=rx)))
        checks[f"regex{s}"] = ("regex", rx)
        reqs[f"choice{s}"] = (prompt, SamplingParams(**sp, structured_outputs=StructuredOutputsParams(choice=CHOICES)))
        checks[f"choice{s}"] = ("choice", CHOICES)
    return reqs, checks


def check_output(kind, spec, text):
    if kind == "json":
        jsonschema.validate(json.loads(text), spec)
    elif kind == "regex":
        assert re.fullmatch(spec, text), (spec, text)
    else:
        assert text in spec, text


def test_every_constrained_output_validates_over_many_seeds(engine, tok):
    reqs, checks = sampled_requests(tok, 8)
    toks, reasons, _ = run(engine, reqs)
    for rid, (kind, spec) in checks.items():
        assert reasons[rid] == "stop", (rid, reasons[rid], text_of(tok, engine, toks[rid]))
        assert toks[rid][-1] in engine.eos_token_ids  # the grammar ended: only EOS was allowed
        check_output(kind, spec, text_of(tok, engine, toks[rid]))
    # Different seeds, different outputs (the mask constrains, it does not decide).
    assert len({tuple(toks[f"person{s}"]) for s in range(8)}) > 4
    assert engine.structured.num_requests_total >= len(reqs)


def test_unconstrained_output_is_not_json(engine, tok):
    """The baseline the test above needs: without the mask the model writes no JSON."""
    prompt = tok.encode(PROMPT)
    toks, _, _ = run(engine, {f"u{s}": (prompt, SamplingParams(temperature=1.0, seed=s, max_tokens=32))
                              for s in range(8)})
    for ids in toks.values():
        text = text_of(tok, engine, ids)
        with pytest.raises(json.JSONDecodeError):
            json.loads(text)


def test_logprobs_are_over_the_allowed_ids_only(engine, tok):
    """Replaying each stream through a fresh matcher: the sampled token and every reported
    alternative are allowed at their position, and where one id is allowed its logprob is 0
    (the distribution was renormalised over the allowed ids)."""
    reqs, _ = sampled_requests(tok, 2, logprobs=5)
    toks, _, lps = run(engine, reqs)
    backend = engine.structured.backend
    forced = 0
    for rid, (prompt, params) in reqs.items():
        m = backend.matcher(params.structured_outputs)
        mask = np.full((1, backend.bitmask_words), -1, np.int32)
        assert len(lps[rid]) == len(toks[rid])
        for t, lp in zip(toks[rid], lps[rid]):
            lnp.fill_next_token_bitmask(m, mask, 0)
            allowed = set(np.flatnonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little")).tolist())
            assert lp.token_id == t and t in allowed
            assert {i for i, _ in lp.top} <= allowed
            assert len(lp.top) == min(5, len(allowed & set(range(engine.runner.sampling_vocab_size))))
            if len(allowed) == 1:
                forced += 1
                assert lp.logprob == pytest.approx(0.0, abs=1e-5)
            assert m.consume_token(t)
    assert forced > 0  # the choices' later characters and the schemas' fixed keys


def test_unconstrained_neighbours_are_unaffected(engine, tok):
    """Greedy unconstrained requests give the same tokens alone and beside constrained ones."""
    prompt = tok.encode(PROMPT)
    plain = {f"g{i}": (prompt[: 3 + i], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2))
             for i in range(3)}
    alone, _, alone_lp = run(engine, plain)
    reqs, _ = sampled_requests(tok, 1)
    together, _, together_lp = run(engine, {**plain, **reqs})
    for rid in plain:
        assert together[rid] == alone[rid]
        for a, b in zip(alone_lp[rid], together_lp[rid]):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)


def test_asynchronous_scheduling_gives_the_synchronous_streams(engine, tok):
    """With constrained requests in flight the next step's forward pass is still dispatched before
    the step in flight is read back; its sampler runs after, with the masks of the tokens just
    applied. Streams, finish reasons and logprobs equal the synchronous ones, unconstrained
    neighbours included."""
    reqs, checks = sampled_requests(tok, 2, logprobs=2)
    prompt = tok.encode(PROMPT)
    # The unconstrained requests outlive the constrained ones: the step after the last constrained
    # one is sampled late without a mask.
    reqs.update({f"plain{i}": (prompt, SamplingParams(temperature=1.0, seed=i, max_tokens=MAX_TOKENS + 8,
                                                      ignore_eos=True, logprobs=2)) for i in range(2)})
    sync = run(engine, reqs, async_scheduling=False)
    r = engine.runner
    events, dispatch, finish = [], r.dispatch, r.finish

    def spy_dispatch(*a, **kw):
        step = dispatch(*a, **kw)
        events.append(("dispatch", step))
        return step

    def spy_finish(step, *a, **kw):
        events.append(("finish", step))
        return finish(step, *a, **kw)

    deferred = r.num_deferred_samples
    r.dispatch, r.finish = spy_dispatch, spy_finish
    try:
        asyn = run(engine, reqs, async_scheduling=True)
    finally:
        del r.dispatch, r.finish
    assert asyn[0] == sync[0] and asyn[1] == sync[1]
    for rid in reqs:
        assert [lp.token_id for lp in asyn[2][rid]] == [lp.token_id for lp in sync[2][rid]]
        for a, b in zip(asyn[2][rid], sync[2][rid]):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
    for rid, (kind, spec) in checks.items():
        check_output(kind, spec, text_of(tok, engine, asyn[0][rid]))
    # Overlap: every step is read back after the next one was dispatched, but at the tail (nothing
    # left to schedule); the steps that followed a constrained one were sampled late.
    finishes = [i for i, (kind, _) in enumerate(events) if kind == "finish"]
    overlapped = [i for i in finishes if events[i - 1][0] == "dispatch" and events[i - 1][1] is not events[i][1]]
    assert len(finishes) > 10 and len(overlapped) >= len(finishes) - 3, events
    assert r.num_deferred_samples - deferred > 10


def test_prefix_cached_prompt_gives_the_same_constrained_stream(engine, tok):
    """A second identical request hits the prefix cache; greedy constrained output is the same."""
    prompt = tok.encode(PROMPT * 6)  # more than one 64-token page: the full pages are cached
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=json_params(PERSON))
    first, _, _ = run(engine, {"a": (prompt, params)})
    hits = engine.prefix_cache.hits
    second, _, _ = run(engine, {"b": (prompt, params)})
    assert engine.prefix_cache.hits > hits
    assert second["b"] == first["a"]
    jsonschema.validate(json.loads(text_of(tok, engine, first["a"])), PERSON)


@pytest.mark.parametrize("so, param", [
    (StructuredOutputsParams(json={"type": "objekt"}), "structured_outputs.json"),
    (StructuredOutputsParams(json="{not json"), "structured_outputs.json"),
    (StructuredOutputsParams(regex="[a-"), "structured_outputs.regex"),
    (StructuredOutputsParams(grammar="start: undefined_rule"), "structured_outputs.grammar"),
    (StructuredOutputsParams(choice=[]), "structured_outputs.choice"),
    (StructuredOutputsParams(regex="a", choice=["b"]), "structured_outputs"),
    (StructuredOutputsParams(json={"type": "objekt"}, param="response_format"), "response_format"),
])
def test_bad_constraints_are_refused_naming_the_field_and_the_engine_serves_on(engine, tok, so, param):
    prompt = tok.encode(PROMPT)
    with pytest.raises(ValueError) as err:
        engine.add_request("bad", prompt, SamplingParams(max_tokens=8, structured_outputs=so))
    if isinstance(err.value, StructuredOutputsError):
        assert err.value.param == param
    assert "bad" not in engine.structured.requests and not engine.has_unfinished_requests()
    toks, _, _ = run(engine, {"ok": (prompt, SamplingParams(max_tokens=8, seed=0, structured_outputs=
                                                                  StructuredOutputsParams(choice=CHOICES)))})
    assert text_of(tok, engine, toks["ok"]) in CHOICES


def test_ignore_eos_is_refused_with_a_constraint(engine, tok):
    with pytest.raises(StructuredOutputsError) as err:
        engine.add_request("x", tok.encode(PROMPT), SamplingParams(
            max_tokens=8, ignore_eos=True, structured_outputs=StructuredOutputsParams(choice=CHOICES)))
    assert err.value.param == "ignore_eos"


def test_a_duplicate_or_refused_request_leaves_the_live_matchers_alone(engine, tok):
    """A constrained request whose id is live is refused before its constraint compiles (the live
    request's matcher is not replaced: its output still matches its own regex); one refused after
    its constraint compiled (here: P/D parameters this engine's role cannot serve) leaves no
    matcher."""
    prompt = tok.encode(PROMPT)
    regex = StructuredOutputsParams(regex=REGEXES[0])
    engine.add_request("live", prompt, SamplingParams(temperature=1.0, seed=4, max_tokens=MAX_TOKENS,
                                                      structured_outputs=regex))
    out_toks = []
    for o in engine.step():
        out_toks += o.new_token_ids
    live = engine.structured.requests["live"]
    with pytest.raises(ValueError, match="duplicate request id"):
        engine.add_request("live", prompt, SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(
            choice=CHOICES)))
    assert engine.structured.requests["live"] is live
    with pytest.raises(ValueError, match="do_remote_decode needs a prefill engine"):
        engine.add_request("pd", prompt, SamplingParams(max_tokens=8, structured_outputs=regex,
                                                        kv_transfer_params={"do_remote_decode": True}))
    assert "pd" not in engine.structured.requests
    while engine.has_unfinished_requests():
        for o in engine.step():
            out_toks += o.new_token_ids
    assert re.fullmatch(REGEXES[0], text_of(tok, engine, out_toks)), text_of(tok, engine, out_toks)
    assert_clean(engine)


def test_abort_mid_stream_forgets_the_matcher(engine, tok):
    engine.add_request("ab", tok.encode(PROMPT), SamplingParams(
        temperature=1.0, seed=3, max_tokens=MAX_TOKENS, structured_outputs=json_params(PERSON)))
    engine.step()
    engine.step()
    assert "ab" in engine.structured.requests
    out = engine.abort("ab")
    assert out is not None and out.finish_reason == "abort"
    assert "ab" not in engine.structured.requests and not engine.has_unfinished_requests()


def test_the_constraint_starts_after_the_reasoning_end_token(engine, tok):
    """`reasoning_end_token_id`: tokens up to and including it are unconstrained, the rest follow
    the grammar. Greedy, with the end token chosen as the unconstrained stream's 3rd token: the
    constrained stream starts with the unconstrained one's first 3 tokens, then validates. With an
    end token that never comes, the stream is the unconstrained one."""
    prompt = tok.encode(PROMPT)
    free, _, _ = run(engine, {"free": (prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))})
    head = free["free"][:3]
    end = head[2]
    assert end not in head[:2], "pick a prompt whose greedy stream does not repeat early"
    so = json_params(PERSON, reasoning_end_token_id=end)
    toks, reasons, _ = run(engine, {"r": (prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                                 structured_outputs=so))})
    assert toks["r"][:3] == head and reasons["r"] == "stop"
    jsonschema.validate(json.loads(text_of(tok, engine, toks["r"][3:])), PERSON)
    never = json_params(PERSON, reasoning_end_token_id=tok.token_to_id("[MASK]"))
    toks, _, _ = run(engine, {"n": (prompt, SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=never))})
    assert toks["n"] == free["free"][: len(toks["n"])]


def test_metrics_count_constrained_requests_and_mask_time(engine, tok):
    from serving.metrics import PrometheusStatLogger

    pl = PrometheusStatLogger("tiny-so", engine.gauges)
    engine.stat_loggers.append(pl)
    prompt = tok.encode(PROMPT)
    counted = re.compile(r'vllm:structured_output_requests_total\{model_name="tiny-so"\} (\S+)')
    try:
        # The first record after the logger was attached carries the counts of the earlier tests.
        run(engine, {"p0": (prompt, SamplingParams(max_tokens=2, seed=0))})
        before = float(counted.search(pl.render().decode()).group(1))
        reqs = {f"c{i}": (prompt, SamplingParams(max_tokens=16, seed=i, structured_outputs=StructuredOutputsParams(
            choice=CHOICES))) for i in range(3)}
        reqs["plain"] = (prompt, SamplingParams(max_tokens=4, seed=0))
        run(engine, reqs)
        steps = engine.num_steps
        run(engine, {"p2": (prompt, SamplingParams(max_tokens=4, seed=0))})  # unconstrained steps: no mask time
        unconstrained_steps = engine.num_steps - steps
    finally:
        engine.stat_loggers.remove(pl)
    text = pl.render().decode()
    assert float(counted.search(text).group(1)) - before == 3
    masked = float(re.search(r'vllm:structured_output_mask_seconds_count\{model_name="tiny-so"\} (\S+)', text).group(1))
    host = float(re.search(r'vllm:step_exposed_host_seconds_count\{model_name="tiny-so"\} (\S+)', text).group(1))
    assert 0 < masked <= host - unconstrained_steps
