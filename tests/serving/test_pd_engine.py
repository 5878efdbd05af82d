"""P/D disaggregation between two engines in one process (the connector's engine path, without
HTTP): a prefill engine computes each prompt's KV and keeps it, a decode engine pulls it over
`jax.experimental.transfer` and the side channel, lands it in its own pages and generates.
Greedy streams must equal the colocated engine's under the equality rule of glm53/equality.py,
the decode engine must compute only the last prompt token, and both sides must audit clean."""

from __future__ import annotations

import time

import numpy as np
import pytest

from glm53.equality import compare_streams
from serving.async_engine import AsyncEngine
from serving.engine import EngineArgs, LLMEngine
from serving.engine_factory import build_engine
from serving.structured_outputs import StructuredOutputsParams
from serving.types import SamplingParams

# The tiny checkpoint's 7-layer twin (tests/helpers/shallow_model.py): the same code paths, faster steps.
pytestmark = pytest.mark.shallow_model

PROMPTS = {"a": [(7 * i) % 300 + 4 for i in range(70)], "b": [(13 * i) % 400 + 4 for i in range(150)],
           "c": list(range(5, 25))}
MAX_TOKENS = 6


def connector(role: str, **extra) -> dict:
    return {"kv_connector": "JaxTransferConnector", "kv_role": role, "kv_connector_extra_config": extra}


def build(kv_transfer_config=None, **kw) -> LLMEngine:
    args = dict(dtype="float32", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
                num_gpu_blocks_override=48, compile_progress=False, cuda_graph_sizes=[], precompile_token_paddings=[], disable_log_stats=True,
                kv_transfer_config=kv_transfer_config)
    return build_engine(EngineArgs(**{**args, **kw}))


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True, **kw)


def drain(*engines, streams=None, outs=None):
    """Step every engine until none has work; collect streams and final outputs of the last one."""
    streams = {} if streams is None else streams
    outs = {} if outs is None else outs
    while any(e.has_unfinished_requests() for e in engines):
        for e in engines:
            for out in e.step():
                streams.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finished:
                    outs[out.request_id] = out
    return streams, outs


def prefill_all(prefill: LLMEngine, prompts: dict) -> dict[str, dict]:
    """Run every prompt as a P/D prefill request; → request id → the response's kv_transfer_params."""
    for rid, p in prompts.items():
        prefill.add_request(rid, p, greedy(max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    _, outs = drain(prefill)
    assert not prefill.audit()
    return {rid: outs[rid].kv_transfer_params for rid in prompts}


def decode_all(prefill: LLMEngine, decode: LLMEngine, prompts: dict, params: dict, max_tokens=MAX_TOKENS):
    for rid, p in prompts.items():
        decode.add_request(rid, p, greedy(max_tokens=max_tokens, logprobs=2, kv_transfer_params=params[rid]))
    return drain_with(prefill, decode, audit=True)


def drain_with(prefill: LLMEngine, decode: LLMEngine, audit: bool = False):
    """Step the decode engine until it has no work, and the prefill engine beside it (it answers
    the side channel's stage requests); → (streams, final outputs) of the decode engine."""
    streams, outs = {}, {}
    while decode.has_unfinished_requests():
        prefill.step()
        for out in decode.step():
            streams.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                outs[out.request_id] = out
        if audit:
            assert not decode.audit()
    return streams, outs


def _colocated(prompts, setup=None, **kw):
    """One engine without P/D: (engine, greedy streams, their logprobs) of `prompts`; `setup(engine)`
    runs before the requests are added (None: nothing)."""
    eng = build(**kw)
    if setup is not None:
        setup(eng)
    for rid, p in prompts.items():
        eng.add_request(rid, p, greedy(max_tokens=MAX_TOKENS, logprobs=2))
    streams, lps = {}, {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            streams.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.new_logprobs:
                lps.setdefault(out.request_id, []).extend(out.new_logprobs)
    return eng, streams, lps


@pytest.fixture(scope="module")
def reference():
    _, streams, lps = _colocated(PROMPTS)
    return streams, lps


CHUNK = 64  # the pair's decode engine pulls in chunks of one MLA page (prompt "b": 149 tokens, 3 chunks)


@pytest.fixture(scope="module")
def pair():
    """A prefill engine and a decode engine that pulls long prompts in chunks (`transfer_chunk_tokens`;
    the fault pair and the variants below pull in one piece, the default for these prompts)."""
    prefill, decode = build(connector("kv_producer")), build(connector("kv_consumer", transfer_chunk_tokens=CHUNK))
    prefill.runner.max_pages_per_program = 2  # page reads and writes of more than 2 rows run in pieces
    decode.runner.max_pages_per_program = 2
    return prefill, decode


def test_pd_streams_equal_colocated_and_decode_computes_only_the_last_prompt_token(pair, reference):
    prefill, decode = pair
    params = prefill_all(prefill, PROMPTS)
    for rid, p in PROMPTS.items():
        kp = params[rid]
        assert kp["do_remote_prefill"] is True and kp["remote_num_tokens"] == len(p)
        assert kp["remote_port"] == prefill.pd.producer.side_channel.port
    assert len(prefill.pd.producer.held) == len(PROMPTS)
    assert prefill.audit() == []
    computed = []
    orig = decode.runner.execute

    def spy(sched, kv):
        computed.extend((sr.request_id, sr.num_new_tokens) for sr in sched.scheduled)
        return orig(sched, kv)

    decode.runner.execute = spy
    staged = prefill.pd.producer.num_staged
    try:
        streams, outs = decode_all(prefill, decode, PROMPTS, params)
    finally:
        decode.runner.execute = orig
    # Chunked pulls: each prompt's len − 1 tokens came in ceil(n / 64) staged pieces (2 + 3 + 1).
    assert prefill.pd.producer.num_staged - staged == sum(-(-(len(p) - 1) // CHUNK) for p in PROMPTS.values())
    ref, ref_lp = reference
    compare_streams(ref, streams, ref_lp, PROMPTS)
    for rid, p in PROMPTS.items():
        assert outs[rid].num_cached_tokens == len(p) - 1
        first = next(n for r, n in computed if r == rid)
        assert first == 1, f"{rid}: the decode engine computed {first} tokens in its first step, not 1"
    c = decode.pd.consumer
    assert c.num_transfers == len(PROMPTS) and c.num_failed_transfers == 0
    # The prefill side released everything once staged; both pools are back to empty.
    prefill.step()
    assert prefill.pd.producer.held == {} and prefill.audit() == []
    assert prefill.pool.num_free == prefill.pool.num_usable_blocks
    assert decode.pool.num_free == decode.pool.num_usable_blocks


def test_pd_with_asynchronous_scheduling_on_both_sides(pair, reference):
    """`--async-scheduling` on the prefill and the decode engine (serving/async_scheduling.py): the
    prefill side stages pages over the arena the step in flight returns, the decode side lands
    pulled pages before the step it dispatches; the colocated streams, one computed prompt token
    on the decode side, audits clean after every step, nothing held or leaked."""
    prefill, decode = pair
    for e in pair:
        e.set_async_scheduling(True)
    try:
        prompts = {f"{rid}-async": p for rid, p in PROMPTS.items()}
        params = prefill_all(prefill, prompts)
        computed = []
        orig = decode.runner.dispatch

        def spy(sched, kv, *args, **kw):
            computed.extend((sr.request_id, sr.num_new_tokens) for sr in sched.scheduled)
            return orig(sched, kv, *args, **kw)

        decode.runner.dispatch = spy
        try:
            streams, outs = decode_all(prefill, decode, prompts, params)
        finally:
            decode.runner.dispatch = orig
        prefill.step()
    finally:
        for e in pair:
            e.set_async_scheduling(False)
    ref, ref_lp = reference
    compare_streams(ref, {rid[:-len("-async")]: s for rid, s in streams.items()}, ref_lp, PROMPTS)
    for rid, p in prompts.items():
        assert outs[rid].num_cached_tokens == len(p) - 1
        assert next(n for r, n in computed if r == rid) == 1
    assert prefill.pd.producer.held == {} and prefill.audit() == [] and decode.audit() == []
    assert prefill.pool.num_free == prefill.pool.num_usable_blocks
    assert decode.pool.num_free == decode.pool.num_usable_blocks


def test_chunk_size_is_whole_engine_pages_and_logged(pair):
    """`transfer_chunk_tokens` rounds down to whole 64-token pages, at least one; the start-up
    summary gives the size used."""
    from serving.pd.config import PDConfig
    from serving.pd.consumer import KVConsumer

    _, decode = pair
    sizes = {n: KVConsumer(PDConfig("kv_consumer", transfer_chunk_tokens=n), None, decode.layout, {}, 1, 1, 8).chunk_tokens
             for n in (1, 32, 64, 100, 130, 16384)}
    assert sizes == {1: 64, 32: 64, 64: 64, 100: 64, 130: 128, 16384: 16384}
    assert KVConsumer(PDConfig("kv_consumer", transfer_chunk_tokens=130), None, decode.layout, {}, 2, 1, 8).chunks(
        0, 300) == [(0, 128), (128, 256), (256, 300)]  # DCP 2: an engine page holds 128 tokens
    assert f"pulls in chunks of {CHUNK} tokens" in decode.pd.summary()


def test_landed_pages_equal_an_independent_relayout_of_the_prefill_pages(pair):
    """Byte-exact: the decode engine's pages of a landed request hold the prefill engine's rows."""
    prefill, decode = pair
    rid, prompt = "b", PROMPTS["b"]
    params = prefill_all(prefill, {rid: prompt})
    held = prefill.pd.producer.held[rid]
    p_arena = np.asarray(prefill.runner.kv_arena)
    decode.add_request(rid, prompt, greedy(max_tokens=2, kv_transfer_params=params[rid]))
    tables = {}
    orig = decode.runner.execute

    def grab(sched, kv):  # the decode tables right after admission (before the request finishes)
        if kv.has_request(rid) and not tables:
            tables.update({g.name: kv.block_table(rid, g.name) for g in decode.layout.groups})
            tables["arena"] = np.asarray(decode.runner.kv_arena)
        return orig(sched, kv)

    decode.runner.execute = grab
    try:
        while decode.has_unfinished_requests():
            prefill.step()
            decode.step()
    finally:
        decode.runner.execute = orig
    d_arena = tables["arena"]
    n = len(prompt) - 1
    for g in decode.layout.groups:
        tpp = g.tokens_per_page
        for t in range(n):  # token by token, word offsets straight from kernels/paged/layout.py
            base = 0
            for c in g.components:
                for layer in range(c.num_layers):
                    seg_off = 0
                    for sw in c.segments:
                        off = base + layer * tpp * c.row_words + tpp * seg_off + (t % tpp) * sw
                        src = p_arena[held.blocks[g.name][t // tpp], off:off + sw]
                        dst = d_arena[tables[g.name][t // tpp], off:off + sw]
                        assert np.array_equal(src, dst), (g.name, t, c.name, layer)
                        seg_off += sw
                base += c.num_layers * tpp * c.row_words
    assert not decode.audit() and not prefill.audit()


# ---------------------------------------------------------------------------------------- faults
@pytest.fixture(scope="module")
def fault_pair():
    """A prefill engine that holds KV for at most 0.5 s, and decode engines with each failure policy."""
    prefill = build(connector("kv_producer", abort_request_timeout=0.5))
    fail = build(connector("kv_consumer", kv_load_timeout=1.0))
    recompute = build({**connector("kv_consumer", kv_load_timeout=1.0), "kv_load_failure_policy": "recompute"})
    return prefill, fail, recompute


def _clean(*engines):
    for e in engines:
        assert e.audit() == []
        assert e.pool.num_free == e.pool.num_usable_blocks, "leaked pages"


def test_prefill_releases_kv_nobody_pulls_within_abort_request_timeout(fault_pair):
    """Decode died (or the router never sent the decode request): the prefill side's pages go back."""
    prefill, fail, _ = fault_pair
    params = prefill_all(prefill, {"a": PROMPTS["a"]})
    assert prefill.pd.producer.held and prefill.pool.num_free < prefill.pool.num_usable_blocks
    time.sleep(0.6)
    prefill.step()
    assert prefill.pd.producer.held == {} and prefill.pd.producer.num_expired == 1
    _clean(prefill)
    # A decode request arriving after that fails by policy ("fail": an error, nothing leaked).
    fail.add_request("late", PROMPTS["a"], greedy(max_tokens=2, kv_transfer_params=params["a"]))
    _, outs = drain_with(prefill, fail)
    assert outs["late"].finish_reason == "error" and "holds no KV" in outs["late"].error
    assert fail.pd.consumer.num_failed_transfers == 1
    _clean(prefill, fail)


def test_an_idle_prefill_server_releases_kv_at_the_deadline(fault_pair):
    """The server's driver (AsyncEngine) with nothing to do sleeps only until the earliest hold's
    deadline: the pages of a request nobody pulled go back although no other request comes."""
    prefill = fault_pair[0]
    prefill_all(prefill, {"a": PROMPTS["a"]})
    expired = prefill.pd.producer.num_expired
    assert prefill.pd.producer.held
    driver = AsyncEngine(prefill, "tiny")
    try:
        deadline = time.monotonic() + 10
        while prefill.pd.producer.held and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        driver.shutdown(close=False)  # the module's engines go on
        prefill.pd.set_wake(None)
    assert prefill.pd.producer.held == {} and prefill.pd.producer.num_expired == expired + 1
    _clean(prefill)


def test_staged_kv_the_decode_side_never_pulls_is_deleted_at_the_deadline(fault_pair):
    """Decode died mid-pull (after asking to stage): the prefill side's pages went back when it
    staged, and the staged copy is deleted after abort_request_timeout."""
    prefill, fail, _ = fault_pair
    prefill_all(prefill, {"a": PROMPTS["a"]})
    reply = prefill.pd.producer.stage({"request_id": "a", "start": 0, "num_tokens": len(PROMPTS["a"]) - 1,
                                       "groups": [g.name for g in prefill.layout.groups],
                                       "kv_layout": prefill.pd.producer.descriptor})
    assert reply["ok"] and prefill.pd.producer.held == {}
    _clean(prefill)  # the staged copy owns the bytes; the pages are free
    staged = prefill.pd.producer.staged[reply["uuid"]].arrays
    time.sleep(0.6)
    prefill.step()
    assert prefill.pd.producer.staged == {} and all(a.is_deleted() for a in staged)


def test_unreachable_prefill_fails_or_recomputes_by_policy(fault_pair, reference):
    """Prefill died after answering: nothing listens on its side channel. The pull fails at once
    (the refused connection, not `kv_load_timeout`); "fail" ends the request with an error naming
    it, "recompute" prefills it on the decode engine and the stream equals the colocated one."""
    prefill, fail, recompute = fault_pair
    params = prefill_all(prefill, {"b": PROMPTS["b"]})
    dead = {**params["b"], "remote_port": _closed_port()}
    fail.add_request("b", PROMPTS["b"], greedy(max_tokens=MAX_TOKENS, kv_transfer_params=dead))
    recompute.add_request("b", PROMPTS["b"], greedy(max_tokens=MAX_TOKENS, kv_transfer_params=dead))
    _, outs = drain_with(prefill, fail)
    err = outs["b"].error
    assert outs["b"].finish_reason == "error" and "refused the connection" in err, err
    streams, outs = drain_with(prefill, recompute)
    assert streams["b"] == reference[0]["b"] and outs["b"].num_cached_tokens == 0
    assert recompute.pd.consumer.num_failed_transfers == 1
    time.sleep(0.6)
    prefill.step()  # the held KV expires on the prefill side
    _clean(prefill, fail, recompute)


def test_kv_transfer_params_of_another_prefill_engine_are_refused(fault_pair):
    """`remote_engine_id` names the prefill engine that answered: a pull from an engine with
    another id (the parameters came from elsewhere, or the engine restarted on the same port) fails
    by policy, as NIXL's handshake refuses it; the prefill side keeps the KV for its own decode
    request, which still gets it."""
    prefill, fail, _ = fault_pair
    params = prefill_all(prefill, {"a": PROMPTS["a"]})
    fail.add_request("wrong", PROMPTS["a"], greedy(max_tokens=2, kv_transfer_params={
        **params["a"], "remote_engine_id": "deadbeef"}))
    _, outs = drain_with(prefill, fail)
    err = outs["wrong"].error
    assert outs["wrong"].finish_reason == "error" and "remote_engine_id 'deadbeef'" in err, err
    assert prefill.pd.producer.held  # not released: its own decode request may still come
    fail.add_request("right", PROMPTS["a"], greedy(max_tokens=2, kv_transfer_params=params["a"]))
    _, outs = drain_with(prefill, fail)
    assert outs["right"].finish_reason == "length" and outs["right"].num_cached_tokens > 0
    _clean(prefill, fail)


def test_abort_while_the_kv_is_in_flight_leaks_nothing(fault_pair):
    prefill, fail, _ = fault_pair
    params = prefill_all(prefill, {"c": PROMPTS["c"]})
    fail.add_request("c", PROMPTS["c"], greedy(max_tokens=MAX_TOKENS, kv_transfer_params=params["c"]))
    assert fail.has_unfinished_requests()
    out = fail.abort("c")
    assert out.finished and out.finish_reason == "abort" and not fail.has_unfinished_requests()
    # The release reaches the prefill side, which frees the pages, or (if the stage request won the
    # race) deletes the staged rows nobody will pull.
    deadline = time.monotonic() + 5
    while (prefill.pd.producer.held or prefill.pd.producer.staged) and time.monotonic() < deadline:
        prefill.step()
        time.sleep(0.01)
    assert prefill.pd.producer.held == {} and prefill.pd.producer.staged == {}
    _clean(prefill, fail)


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_engine_refuses_roles_and_configs_it_cannot_serve():
    from serving.kv_transfer_config import KVTransferConfigError
    from serving.pd import pd_config

    with pytest.raises(KVTransferConfigError, match="kv_role"):
        pd_config({"kv_connector": "JaxTransferConnector", "kv_role": "kv_sender"})
    with pytest.raises(KVTransferConfigError, match="unknown key"):
        pd_config(connector("kv_producer", side_chanel_port=1))
    for bad in (0, -64, 1.5, True):
        with pytest.raises(KVTransferConfigError, match="transfer_chunk_tokens"):
            pd_config(connector("kv_consumer", transfer_chunk_tokens=bad))
    with pytest.raises(KVTransferConfigError, match="kv_connector"):
        pd_config({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"})
    with pytest.raises(KVTransferConfigError, match="second"):
        pd_config({"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": [
            connector("kv_producer"), connector("kv_consumer")]}})
    multi = pd_config({"kv_connector": "MultiConnector", "kv_role": "kv_producer", "kv_connector_extra_config": {
        "connectors": [{"kv_connector": "NixlConnector", "kv_role": "kv_producer"},
                       {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                        "kv_connector_extra_config": {"cpu_bytes_to_use": 2**20}}]}})
    assert multi.is_producer and not multi.is_consumer and multi.connector == "NixlConnector"


# ---------------------------------------------------------------------------------------- variants
@pytest.mark.parametrize("kv_cache_dtype", ["fp8"])  # bf16 rows: tests/serving/test_pd_relayout.py
def test_pd_with_fp8_cache(kv_cache_dtype):
    """The production row formats (fp8_ds_mla tiles with scales, fp8 keys with a scale segment)
    move byte-exactly: streams equal the colocated engine with the same cache dtype."""
    _, ref, ref_lp = _colocated(PROMPTS, kv_cache_dtype=kv_cache_dtype)
    prefill = build(connector("kv_producer"), kv_cache_dtype=kv_cache_dtype)
    decode = build(connector("kv_consumer"), kv_cache_dtype=kv_cache_dtype)
    params = prefill_all(prefill, PROMPTS)
    streams, outs = decode_all(prefill, decode, PROMPTS, params)
    compare_streams(ref, streams, ref_lp, PROMPTS)
    assert all(outs[r].num_cached_tokens == len(p) - 1 for r, p in PROMPTS.items())
    # A decode engine with another cache dtype refuses the params before anything moves.
    other = build(connector("kv_consumer"), kv_cache_dtype="float32" if kv_cache_dtype == "fp8" else "fp8")
    more = prefill_all(prefill, {"c": PROMPTS["c"]})
    with pytest.raises(ValueError, match="kv-cache-dtype"):
        other.add_request("c", PROMPTS["c"], greedy(max_tokens=2, kv_transfer_params=more["c"]))
    assert not other.has_unfinished_requests()


def test_pd_with_mtp_speculation_on_both_sides():
    """MTP k = 2 on both engines: the MTP layer's rows (one more layer of each group) move too, and the decode engine's
    drafts are verified as in the colocated run (greedy streams equal; drafts accepted)."""
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    colocated, ref, ref_lp = _colocated(PROMPTS, speculative_config=spec)
    prefill = build(connector("kv_producer"), speculative_config=spec)
    decode = build(connector("kv_consumer"), speculative_config=spec)
    params = prefill_all(prefill, PROMPTS)
    groups = params["a"]["kv_layout"]["groups"]  # the MTP layer: one more layer of each group
    assert set(groups) == {"mla", "indexer"} and groups["mla"][0][1] == decode.config.num_hidden_layers + 1
    streams, outs = decode_all(prefill, decode, PROMPTS, params)
    compare_streams(ref, streams, ref_lp, PROMPTS)
    # The same drafts verified and accepted as colocated (the random tiny model accepts few).
    assert decode.spec_stats.num_draft_tokens > 0
    assert decode.spec_stats.num_accepted_tokens == colocated.spec_stats.num_accepted_tokens
    # Without MTP on the prefill side, a decode engine with MTP cannot get the MTP layer's rows: refused.
    plain = build(connector("kv_producer"))
    more = prefill_all(plain, {"c": PROMPTS["c"]})
    with pytest.raises(ValueError, match="speculative-config"):
        decode.add_request("c2", PROMPTS["c"], greedy(max_tokens=2, kv_transfer_params=more["c"]))


# A choice, a regex and a JSON schema (fresh params per request: the engine fills in server defaults).
CONSTRAINTS = {
    "a": lambda: StructuredOutputsParams(choice=["red", "green", "dark blue"]),
    "b": lambda: StructuredOutputsParams(regex=r"[a-z]{2,5}-[0-9]{3}"),
    "c": lambda: StructuredOutputsParams(json={"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
        "required": ["x", "ok"], "additionalProperties": False}, disable_any_whitespace=True),
}


def constrained(rid: str, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, structured_outputs=CONSTRAINTS[rid](), **kw)


def test_pd_with_structured_outputs(pair, fault_pair):
    """Constrained requests through P/D: the prefill engine masks its one token, and the decode
    engine, which samples the first output token itself from the recomputed last prompt token,
    masks every token from the start of the grammar — the decode streams equal the colocated
    constrained run's (equality rule) and every output validates. A constrained request whose pull
    fails (policy fail) drops its grammar state. No engine keeps a matcher."""
    import json
    import re

    import jsonschema

    from glm53.tokenizer import GlmTokenizer

    prefill, decode = pair
    colocated = build()
    ref, ref_lp = {}, {}
    for rid, p in PROMPTS.items():
        colocated.add_request(rid, p, constrained(rid, max_tokens=40, logprobs=2))
    while colocated.has_unfinished_requests():
        for out in colocated.step():
            ref.setdefault(out.request_id, []).extend(out.new_token_ids)
            ref_lp.setdefault(out.request_id, []).extend(out.new_logprobs or [])
    for rid, p in PROMPTS.items():
        prefill.add_request(rid, p, constrained(rid, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    _, pre = drain(prefill)
    for rid, p in PROMPTS.items():
        decode.add_request(rid, p, constrained(rid, max_tokens=40, logprobs=2,
                                               kv_transfer_params=pre[rid].kv_transfer_params))
    streams, outs = drain_with(prefill, decode, audit=True)
    compare_streams(ref, streams, ref_lp, PROMPTS)
    tok = GlmTokenizer.from_pretrained(decode.model_path)
    text = {rid: tok.decode([t for t in streams[rid] if t not in decode.eos_token_ids]) for rid in PROMPTS}
    print("\nP/D constrained outputs:", text)
    assert text["a"] in ("red", "green", "dark blue"), text
    assert re.fullmatch(r"[a-z]{2,5}-[0-9]{3}", text["b"]), text
    jsonschema.validate(json.loads(text["c"]), CONSTRAINTS["c"]().json)
    assert all(outs[r].finish_reason == "stop" and outs[r].num_cached_tokens == len(p) - 1 for r, p in PROMPTS.items())
    # A pull that fails: the request ends with an error and its matcher goes with it.
    fprefill, fail, _ = fault_pair
    fprefill.add_request("b", PROMPTS["b"], constrained("b", max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    _, fpre = drain(fprefill)
    dead = {**fpre["b"].kv_transfer_params, "remote_port": _closed_port()}
    fail.add_request("b", PROMPTS["b"], constrained("b", max_tokens=40, kv_transfer_params=dead))
    assert "b" in fail.structured.requests
    _, fouts = drain_with(fprefill, fail)
    assert fouts["b"].finish_reason == "error"
    time.sleep(0.6)
    fprefill.step()  # the held KV expires on the prefill side
    for e in (colocated, prefill, decode, fprefill, fail):
        assert not e.structured.requests, "a matcher was kept"
    _clean(colocated, prefill, decode, fprefill, fail)


def test_multiturn_pulls_only_what_the_decode_engine_lacks():
    """A later turn of a conversation: the decode engine's prefix cache holds the earlier turn
    (landed KV and its own decode tokens), so the pull starts past its whole pages and moves a
    fraction of the bytes; the prefill engine's prefix cache serves the prefill. Streams equal the
    colocated run of each turn's full prompt."""
    kw = dict(max_model_len=1024, num_gpu_blocks_override=96, enable_prefix_caching=True)
    prefill = build(connector("kv_producer"), **kw)
    decode = build(connector("kv_consumer", transfer_chunk_tokens=256), **kw)  # turn 1 in 4 chunks, turn 2 from 768
    turn1 = [(7 * i) % 300 + 4 for i in range(900)]
    params = prefill_all(prefill, {"t1": turn1})
    streams, _ = decode_all(prefill, decode, {"t1": turn1}, params)
    first_bytes = decode.pd.consumer.bytes_transferred
    turn2 = turn1 + streams["t1"] + [(5 * i) % 200 + 4 for i in range(40)]
    params = prefill_all(prefill, {"t2": turn2})
    assert prefill.prefix_cache.hits >= 896  # the prefill engine reused turn 1's pages
    streams2, outs = decode_all(prefill, decode, {"t2": turn2}, params)
    second_bytes = decode.pd.consumer.bytes_transferred - first_bytes
    _, ref, ref_lp = _colocated({"t2": turn2}, **kw)
    compare_streams(ref, streams2, ref_lp, {"t2": turn2})
    assert outs["t2"].num_cached_tokens == len(turn2) - 1
    # Only the tokens past the first indexer page (768) moved: under a third of turn 2's KV.
    print(f"\nturn 1 pulled {first_bytes} B, turn 2 {second_bytes} B")
    assert 0 < second_bytes < 0.35 * first_bytes * len(turn2) / len(turn1)
    _clean(prefill, decode)


def test_host_landing_fills_the_hisparse_host_pool_byte_exactly():
    """A HiSparse decode engine whose pool cannot hold the request lands its MLA pages straight in
    the host pool: each landed token's host row (every layer's latent row, layer after layer)
    holds exactly the bytes of the prefill engine's arena page rows, read by the layout formula."""
    prompt = [(7 * i) % 300 + 4 for i in range(600)]
    kw = dict(max_model_len=1024)
    prefill = build(connector("kv_producer"), num_gpu_blocks_override=96, **kw)
    decode = build(connector("kv_consumer"), num_gpu_blocks_override=10,
                   attention_config={"hisparse_config": {"host_pool_gib": 0.05, "prefill_buffer_size": 128}}, **kw)
    params = prefill_all(prefill, {"x": prompt})
    held = prefill.pd.producer.held["x"]
    p_arena = np.asarray(prefill.runner.kv_arena)
    decode.add_request("x", prompt, greedy(max_tokens=2, kv_transfer_params=params["x"]))
    seen = {}
    orig = decode.runner.execute

    def grab(sched, kv):  # right after admission and the landing programs, before the first step
        if not seen and kv.has_request("x"):
            rec = decode.hisparse.policy.records["x"]
            seen.update(host_blocks=dict(rec.host_blocks), pool=np.asarray(decode.runner.hisparse.pool))
        return orig(sched, kv)

    decode.runner.execute = grab
    try:
        while decode.has_unfinished_requests():
            prefill.step()
            decode.step()
    finally:
        decode.runner.execute = orig
    assert decode.pd.consumer.num_landed_host == 1 and len(seen["host_blocks"]) == (len(prompt) - 1) // 64
    g = prefill.layout.group("mla")
    (c,) = g.components
    for page, hb in seen["host_blocks"].items():
        for o in (0, 17, 63):
            want = np.concatenate([p_arena[held.blocks["mla"][page],
                                           layer * 64 * c.row_words + o * c.row_words:
                                           layer * 64 * c.row_words + (o + 1) * c.row_words]
                                   for layer in range(c.num_layers)])
            assert np.array_equal(seen["pool"][hb * 64 + o], want), (page, o)
    _clean(prefill, decode)
