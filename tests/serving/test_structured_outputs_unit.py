"""Structured outputs without the model: the device mask against llguidance's own numpy
reference, the glm47 tool-call grammar walked at random (every walk parses into arguments that
validate against the tool's schema), the speculative masks against a matcher stepped one token at
a time, and the `--structured-outputs-config` checks."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jax.numpy as jnp
import jsonschema
import llguidance.numpy as lnp
import numpy as np
import pytest

from glm53.sampling import apply_token_bitmask
from glm53.tiny_checkpoint import default_model_dir
from glm53.tokenizer import GlmTokenizer, eos_token_ids
from serving.cli_args import ArgumentError, make_arg_parser, validate_args
from serving.parsers.tool_calls import Glm47ToolCallParser
from serving.structured_outputs import (
    GuidanceBackend,
    StructuredOutputManager,
    StructuredOutputsParams,
)
from serving.structured_outputs.config import (
    StructuredOutputsConfig,
    StructuredOutputsConfigError,
)
from serving.structured_outputs.tool_grammar import tool_call_lark


def parse_args(argv):
    args = make_arg_parser().parse_args(argv)
    validate_args(args)
    return args

V = 512  # the tiny checkpoint's logits (496 tokenizer ids, padded)


@pytest.fixture(scope="module")
def backend():
    d = default_model_dir()
    return GuidanceBackend.from_model_dir(d, V, eos_token_ids(model_dir=d))


@pytest.fixture(scope="module")
def tok():
    return GlmTokenizer.from_pretrained(default_model_dir())


def allowed_ids(mask_row) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(mask_row.view(np.uint8), bitorder="little"))


@pytest.mark.parametrize("vocab, words", [(512, 16), (500, 16), (520, 16)])
def test_the_device_mask_equals_llguidances_numpy_reference(vocab, words):
    rng = np.random.default_rng(vocab)
    logits = rng.standard_normal((6, vocab)).astype(np.float32)
    mask = rng.integers(-(2**31), 2**31 - 1, (6, words), dtype=np.int64).astype(np.int32)
    mask[0] = -1  # all allowed
    mask[1] = 0  # nothing allowed
    ref = logits.copy()
    lnp.apply_token_bitmask_inplace(ref, mask)
    got = np.asarray(apply_token_bitmask(jnp.asarray(logits), jnp.asarray(mask)))
    np.testing.assert_array_equal(got, ref)
    # The [B, S, W] form of the speculative step is the same, row by row.
    got3 = np.asarray(apply_token_bitmask(jnp.asarray(logits).reshape(2, 3, vocab), jnp.asarray(mask).reshape(2, 3, words)))
    np.testing.assert_array_equal(got3.reshape(6, vocab), ref)


TOOLS = [
    {"type": "function", "function": {"name": "book", "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 5},
            "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "class": {"enum": ["eco", "biz"]},
            "seats": {"type": "integer", "minimum": 1, "maximum": 9},
            "window": {"type": "boolean"},
            "meal": {"type": "object", "properties": {"veg": {"type": "boolean"}}, "required": ["veg"],
                     "additionalProperties": False},
            "bags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 3}, "maxItems": 2},
        },
        "required": ["city", "code", "seats"]}}},
    {"type": "function", "function": {"name": "now"}},
]


@pytest.mark.parametrize("name, parallel", [(None, True), (None, False), ("book", False)])
def test_random_walks_of_the_tool_grammar_parse_into_valid_arguments(backend, tok, name, parallel):
    grammar = tool_call_lark(TOOLS, name, parallel)
    schemas = {"book": TOOLS[0]["function"]["parameters"], "now": {"type": "object", "properties": {}}}
    seen = set()
    for seed in range(12):
        m = backend.matcher(StructuredOutputsParams(grammar=grammar))
        mask = np.full((1, backend.bitmask_words), -1, np.int32)
        rng = np.random.default_rng(seed)
        out = []
        for _ in range(300):
            lnp.fill_next_token_bitmask(m, mask, 0)
            t = int(rng.choice(allowed_ids(mask[0])))
            assert m.consume_token(t)
            if t in backend.eos_token_ids:
                break
            out.append(t)
        else:
            pytest.fail("the walk did not end")
        events = Glm47ToolCallParser(TOOLS).parse(tok.decode(out))
        calls = [e for e in events if not isinstance(e, str)]
        assert calls and len(calls) == len(events), events  # calls only, no stray text
        if not parallel:
            assert len(calls) == 1
        for c in calls:
            assert name in (None, c.name)
            jsonschema.validate(c.arguments, schemas[c.name])
            seen.add(c.name)
    assert name is not None or seen == {"book", "now"}


def test_tool_grammar_refuses_unknown_names():
    with pytest.raises(ValueError, match="not among"):
        tool_call_lark(TOOLS, "fly")
    with pytest.raises(ValueError, match="at least one"):
        tool_call_lark([])


def test_speculative_masks_equal_a_matcher_stepped_token_by_token(backend, tok):
    """Row j of a request's masks is the grammar's mask after its first j drafts; rows after a
    forbidden draft stay all ones (never read); the matcher is left where it was."""
    so = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}},
                                       "required": ["a"], "additionalProperties": False},
                                 disable_any_whitespace=True)
    mgr = StructuredOutputManager(lambda: backend)
    mgr.add("r", so)
    good = tok.encode('{"a":1')
    bad = tok.encode('{"b')
    for drafts in (good[:3], bad[:3]):
        sr = SimpleNamespace(request_id="r", sample=True, num_spec_tokens=len(drafts), token_ids=[7] + drafts)
        got = mgr.bitmask(SimpleNamespace(scheduled=[sr]), 2, 4)
        ref = backend.matcher(so)
        row = np.full((1, backend.bitmask_words), -1, np.int32)
        for j in range(4):
            lnp.fill_next_token_bitmask(ref, row, 0)
            np.testing.assert_array_equal(got[0, j], row[0])
            if j == len(drafts) or not ref.validate_tokens([drafts[j]]):
                np.testing.assert_array_equal(got[0, j + 1:], -1)
                break
            ref.consume_token(drafts[j])
        assert (got[1] == -1).all()  # the padding row
    # The manager's matcher did not move: its mask is still the start mask.
    start = backend.matcher(so)
    row, ref_row = np.zeros((1, backend.bitmask_words), np.int32), np.zeros((1, backend.bitmask_words), np.int32)
    lnp.fill_next_token_bitmask(mgr.requests["r"].matcher, row, 0)
    lnp.fill_next_token_bitmask(start, ref_row, 0)
    np.testing.assert_array_equal(row, ref_row)
    assert mgr.accept("r", good) and not mgr.accept("r", tok.encode("]"))


def test_disable_additional_properties_closes_every_object(backend, tok):
    so = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "object", "properties": {}}}},
                                 disable_additional_properties=True, disable_any_whitespace=True)
    m = backend.matcher(so)
    assert m.validate_tokens(tok.encode('{"a":{}}')) == len(tok.encode('{"a":{}}'))
    assert backend.matcher(so).validate_tokens(tok.encode('{"b"')) < len(tok.encode('{"b"'))
    assert backend.matcher(so).validate_tokens(tok.encode('{"a":{"c"')) < len(tok.encode('{"a":{"c"'))


def test_structured_outputs_config():
    assert StructuredOutputsConfig.from_dict(None) == StructuredOutputsConfig()
    assert StructuredOutputsConfig.from_dict({"backend": "auto", "disable_any_whitespace": True}).disable_any_whitespace
    for bad, word in [({"backend": "xgrammar"}, "backend"), ({"whitespace": True}, "whitespace"),
                      ({"enable_in_reasoning": "yes"}, "enable_in_reasoning")]:
        with pytest.raises(StructuredOutputsConfigError, match=word):
            StructuredOutputsConfig.from_dict(bad)
    with pytest.raises(ArgumentError, match="xgrammar"):
        parse_args(["--structured-outputs-config", '{"backend": "xgrammar"}'])
    args = parse_args(["--structured-outputs-config", '{"disable_any_whitespace": true}'])
    assert args.structured_outputs_config == {"disable_any_whitespace": True}
    json.dumps(args.structured_outputs_config)


def test_pathological_constraints_compile_or_are_refused_without_crashing(backend):
    """A 5,000-rule chained Lark grammar overflowed a default thread stack inside llguidance (a
    segfault of the server): it compiles on the backend's large-stack thread. A 20,000-way choice
    (past llguidance's 2,000 alternatives per Lark rule) compiles as one regex. An unsatisfiable
    regex is refused. Tool parameters' `$defs` resolve inside each parameter's schema."""
    from serving.structured_outputs import StructuredOutputsError

    n = 5000
    chain = "start: r0\n" + "".join(f'r{i}: "x{i}" r{i + 1} | "y"\n' for i in range(n)) + f'r{n}: "z"\n'
    m = backend.matcher(StructuredOutputsParams(grammar=chain))
    mask = np.zeros((1, backend.bitmask_words), np.int32)
    lnp.fill_next_token_bitmask(m, mask, 0)
    assert m.consume_tokens(backend.tokenizer.tokenize_str("x0x1y")) and m.is_accepting()
    choices = [f"c{i}" for i in range(20000)] + ["a b", "x.y", "<q>", 'say "hi"', "é\\"]
    m = backend.matcher(StructuredOutputsParams(choice=choices))
    for c in ("c19999", "a b", "x.y", "<q>", 'say "hi"', "é\\"):
        m2 = backend.matcher(StructuredOutputsParams(choice=choices))
        assert m2.consume_tokens(backend.tokenizer.tokenize_str(c)) and m2.is_accepting(), c
    assert not backend.matcher(StructuredOutputsParams(choice=choices)).consume_tokens(
        backend.tokenizer.tokenize_str("c20000x"))
    with pytest.raises(StructuredOutputsError, match="admits no output"):
        backend.matcher(StructuredOutputsParams(regex=r"[^\s\S]"))
    defs_tool = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "$defs": {"P": {"type": "integer", "minimum": 1, "maximum": 3}},
        "properties": {"p": {"$ref": "#/$defs/P"}}, "required": ["p"]}}}]
    backend.matcher(StructuredOutputsParams(grammar=tool_call_lark(defs_tool)))
    with pytest.raises(ValueError, match="cannot be written"):
        tool_call_lark([{"type": "function", "function": {"name": "g", "parameters": {
            "type": "object", "properties": {"s": {"enum": ["a</arg_value>b", "c"]}}}}}])
