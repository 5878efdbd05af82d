"""One engine over two processes (serving/multihost): 2 processes with one simulated CPU device
each (the one-process, one-device engine being the reference, one device per process is the
cheapest layout whose every axis spans the processes), on loopback, the leader serving HTTP
through the openai client, the follower `--headless`.

* Greedy streams equal those of the one-device, non-speculative engine with the same engine flags
  (cache dtype, weight quantisation) in this process (docs/design.md §10's rule: identical, or a
  divergence at a near-tie of the reference; the one-process multi-device run of a layout is held
  to the same rule by tests/sharding/test_engine_parallel.py and test_hisparse_parallel.py), for:
  DP2 + EP with the fp8 cache and FP8 weights (an attention replica per process, experts over
  both, each process loading only its weight shards; also a P/D engine, kv_both, handing KV to
  and taking KV from the one-device engine on either replica, each process staging and pulling
  its own replica's KV); PCP2 × DCP2 with the CPU offloading connector storing pages and P/D both
  ways through the leader (the context-parallel groups span the processes); MTP k = 2 under TP2
  with the connector's loads (a prefix evicted from the device comes back from the host store in
  a load program both processes run); Hybrid HiSparse on a device pool far too small under DP2 +
  EP with the fp8 cache (each process's replica has its own host pool; the suite's engine-level
  check of fp8 rows through the host pool and the hot buffer).
* SIGTERM on the leader: the running stream finishes, every process exits 0.
* A killed follower (after the PCP2 × DCP2 checks), a frozen one (SIGSTOP past --peer-timeout,
  after the MTP checks) and a corrupt step message each stop the engine: the open stream ends in
  an error without a wrong token, /health answers 503 (or the port is closed), every process
  exits non-zero.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import signal
import tempfile
import threading
import time

import httpx
import numpy as np
import pytest
from openai import OpenAI

from glm53 import api
from glm53.equality import compare_streams
from serving.cli_args import make_arg_parser, validate_args
from serving.engine_factory import build_engine
from serving.multihost.channel import CORRUPT_ENV
from serving.run import engine_args
from serving.types import SamplingParams
from tests.helpers.multihost_process import multihost_engine
from tests.helpers.shallow_model import shallow_model_argv

# The tiny checkpoint's 7-layer twin (tests/helpers/shallow_model.py), in the processes too.
pytestmark = pytest.mark.shallow_model
MODEL = "glm-5.3-tiny"
TWIN = shallow_model_argv(MODEL)

PROMPTS = {"a": list(range(5, 25)), "b": [(7 * i) % 300 + 4 for i in range(70)],
           "c": [(13 * i) % 400 + 4 for i in range(100)]}
MAX_TOKENS = 6
VOCAB = 496  # the tiny tokenizer's ids (the checkpoint pads its vocabulary to 512): what is sampled
ENGINE = [*TWIN, "--max-model-len", "192", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
          "--num-gpu-blocks-override", "24", "--cuda-graph-sizes", "--precompile-token-paddings",
          "--disable-log-stats"]
# One device per process (the tiny checkpoint's q_b_proj, 192 wide, splits into whole 128-wide FP8
# scale blocks under no TP): each process holds one attention replica and half the experts, and
# loads only those shards of the FP8 weights.
DP2_EP_FP8 = ["-dp", "2", "--enable-expert-parallel", "--kv-cache-dtype", "fp8", "--quantization", "fp8"]
# P/D in both directions between the multi-process engine and the one-device reference engine
# (both kv_both; a failed pull is an error, not a silent local prefill).
PD_BOTH = ["--kv-transfer-config", json.dumps({"kv_connector": "JaxTransferConnector", "kv_role": "kv_both",
                                                "kv_load_failure_policy": "fail"})]
DP2_EP_FP8_PD = DP2_EP_FP8 + PD_BOTH
# The offloading connector and P/D together (vLLM's MultiConnector): a replica spanning the processes
# (DCP2 over them), whose P/D KV therefore goes through the leader.
PCP2_DCP2_OFFLOAD_PD = ["-pcp", "2", "-dcp", "2", "--enable-prefix-caching", "--kv-transfer-config", json.dumps(
    {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"connectors": [
        {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_bytes_to_use": 2**26}},
        {"kv_connector": "JaxTransferConnector", "kv_role": "kv_both", "kv_load_failure_policy": "fail"}]}})]
MTP_TP2 = ["-tp", "2", "--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 2})]
# With the CPU offloading connector too, and room for prompts past one indexer page (448 tokens on
# the 7-layer twin, 704 on the tiny checkpoint, with the MTP layer), the unit a prefix hit — and so
# a load from the host store — comes in.
MTP_TP2_OFFLOAD = MTP_TP2 + ["--enable-prefix-caching", "--max-model-len", "832", "--kv-transfer-config", json.dumps(
    {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_bytes_to_use": 2**26}})]
LONG_PROMPTS = {k: [(m * j + 11) % 480 + 5 for j in range(760)] for k, m in (("A", 23), ("B", 29))}


_REFERENCES: dict = {}


def greedy_streams(engine, prompts: dict, max_tokens: int, params: dict | None = None) -> tuple[dict, dict, dict]:
    """Run `prompts` greedily (ignore_eos, top-2 logprobs; `params[rid]`: more sampling
    parameters of one request) to the end → (streams, logprobs, final outputs)."""
    params = params or {}
    for rid, p in prompts.items():
        engine.add_request(rid, p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2,
                                                  **params.get(rid, {})))
    streams, lps = {rid: [] for rid in prompts}, {rid: [] for rid in prompts}
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            streams[out.request_id] += out.new_token_ids
            lps[out.request_id] += out.new_logprobs or []
            if out.finished:
                finals[out.request_id] = out
    return streams, lps, finals


def reference_engine(flags: list[str]):
    """The one-device, non-speculative engine with the same engine flags, cache dtype, weight
    quantisation and P/D connector as `flags` (layout, MTP and offloading flags dropped, a
    MultiConnector's P/D part kept; built by
    `serving.run.engine_args`), built and run on PROMPTS once per (cache dtype, quantisation, P/D)
    → (the engine, kept only with a P/D connector, else None; streams; their top logprobs; the
    cache dtype)."""
    dtype = "fp8" if "--kv-cache-dtype" in flags and flags[flags.index("--kv-cache-dtype") + 1] == "fp8" else "bfloat16"
    quant = flags[flags.index("--quantization") + 1] if "--quantization" in flags else None
    pd = next((f for f in flags if "JaxTransferConnector" in f), None)
    if pd is not None and json.loads(pd)["kv_connector"] == "MultiConnector":  # its P/D connector only
        pd = json.dumps(next(c for c in json.loads(pd)["kv_connector_extra_config"]["connectors"]
                             if c["kv_connector"] == "JaxTransferConnector"))
    if (dtype, quant, pd) not in _REFERENCES:
        args = make_arg_parser().parse_args(ENGINE + (["--kv-cache-dtype", "fp8"] if dtype == "fp8" else [])
                                            + (["--quantization", quant] if quant else [])
                                            + (["--kv-transfer-config", pd] if pd else []))
        validate_args(args)
        engine = build_engine(engine_args(args, None))
        _REFERENCES[dtype, quant, pd] = (engine if pd else None, *greedy_streams(engine, PROMPTS, MAX_TOKENS)[:2], dtype)
    return _REFERENCES[dtype, quant, pd]


def reference(flags: list[str]) -> tuple[dict, dict, str]:
    """`reference_engine(flags)` → (streams, their top logprobs, the cache dtype)."""
    return reference_engine(flags)[1:]


def served(url: str) -> dict:
    """PROMPTS through the leader concurrently: "a" streamed, the others not → token ids."""
    client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)
    extra = {"ignore_eos": True, "return_token_ids": True}
    got = {}

    def one(rid):
        if rid == "a":
            ids = []
            for chunk in client.completions.create(model=MODEL, prompt=PROMPTS[rid], max_tokens=MAX_TOKENS,
                                                   temperature=0, stream=True, extra_body=extra):
                ids += chunk.choices[0].model_extra.get("token_ids") or [] if chunk.choices else []
            got[rid] = ids
        else:
            r = client.completions.create(model=MODEL, prompt=PROMPTS[rid], max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body=extra)
            got[rid] = r.choices[0].model_extra["token_ids"]

    threads = [threading.Thread(target=one, args=(rid,)) for rid in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got


def check_equal(flags, url):
    """→ (reference streams, their logprobs, the served streams)."""
    ref, lps, dtype = reference(flags)
    got = served(url)
    compare_streams(ref, got, lps, PROMPTS, api.load(cache_dtype=dtype))
    return ref, lps, got


def metric(url: str, name: str, label: str = "") -> float:
    """The sum of the leader's /metrics samples named `name…` (and holding `label`, e.g. 'k="v"')."""
    text = httpx.get(url + "/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name) and label in line)


def stream_tokens(url: str, prompt, max_tokens: int):
    """Open a streaming completion → an iterator of (token ids | an exception at the end)."""
    with httpx.stream("POST", url + "/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                yield RuntimeError(event["error"]["message"])
                return
            yield event["choices"][0].get("token_ids") or [], event["choices"][0].get("finish_reason")


def health(url: str) -> int | None:
    try:
        return httpx.get(url + "/health", timeout=2).status_code
    except httpx.HTTPError:
        return None  # the port is closed: the leader is gone


# P/D requests go to a chosen replica of the DP2 engine: "a" to the leader's devices, "b" and "c"
# to the follower's (vLLM's X-data-parallel-rank header).
PD_RANK = {"a": 0, "b": 1, "c": 1}


def pd_from_multihost(url: str, engine, ranks: dict | None = PD_RANK) -> dict:
    """The multi-process engine prefills PROMPTS (max_tokens 1, do_remote_decode), the one-device
    `engine` pulls their KV (staged by the process holding each replica) and decodes → streams."""
    params = {}
    for rid, p in PROMPTS.items():
        headers = {"X-data-parallel-rank": str(ranks[rid])} if ranks else {}
        r = httpx.post(url + "/v1/completions", timeout=300, headers=headers, json={
            "model": MODEL, "prompt": p, "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True}})
        r.raise_for_status()
        params[rid] = {"kv_transfer_params": r.json()["kv_transfer_params"]}
    streams, _, _ = greedy_streams(engine, PROMPTS, MAX_TOKENS, params)
    return streams


def pd_into_multihost(url: str, engine, ranks: dict | None = PD_RANK) -> dict:
    """The one-device `engine` prefills PROMPTS; the multi-process engine pulls their KV and
    decodes them, concurrently, while `engine`
    keeps stepping to answer the stage requests → streams. (The process holding each request's
    replica pulls its KV; every process runs the landing.)"""
    _, _, finals = greedy_streams(engine, {f"{rid}-p": p for rid, p in PROMPTS.items()}, 1,
                                  {f"{rid}-p": {"kv_transfer_params": {"do_remote_decode": True}} for rid in PROMPTS})
    got, errors = {}, []

    def one(rid):
        try:
            headers = {"X-data-parallel-rank": str(ranks[rid])} if ranks else {}
            r = httpx.post(url + "/v1/completions", timeout=300, headers=headers,
                           json={"model": MODEL, "prompt": PROMPTS[rid], "max_tokens": MAX_TOKENS, "temperature": 0,
                                 "ignore_eos": True, "return_token_ids": True,
                                 "kv_transfer_params": finals[f"{rid}-p"].kv_transfer_params})
            r.raise_for_status()
            got[rid] = r.json()["choices"][0]["token_ids"]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"{rid}: {e!r} {getattr(getattr(e, 'response', None), 'text', '')}")

    threads = [threading.Thread(target=one, args=(rid,)) for rid in PROMPTS]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        engine.step()  # runs the side channel's stage jobs
        time.sleep(0.01)
    assert not errors, errors
    return got


def test_dp2_ep_fp8_across_processes_serves_the_one_process_streams_pd_both_ways_and_sigterm_exits_zero():
    """The DP2 + EP engine (one device and replica per process) with the fp8 cache and FP8
    weights serves the one-device streams (same cache dtype and weights), each process loading
    only its shards; as a P/D engine (kv_both) it hands KV to the one-device engine and takes KV
    from it, on either replica, with the same streams. The P/D connector lives in the leader, but
    the KV of the follower's replica never passes through it: the follower stages it from its own
    arena shard on its own transfer server, pulls it into its own memory and supplies its pages to
    the landing (serving/pd/shards.py)."""
    with multihost_engine(ENGINE + DP2_EP_FP8_PD + ["--shutdown-timeout", "600"], devices_per_process=1) as mh:
        check_equal(DP2_EP_FP8_PD, mh.url)
        # FP8 weights, each process reading only its own shards (the experts are split between them).
        for log in (mh.leader_log(), mh.follower_log()):
            assert "quantised" in log and "linear weights to FP8 at load" in log
            mine, total = map(float, re.search(r"read ([\d.]+) MiB of the ([\d.]+) MiB of parameters", log).groups())
            assert 0 < mine < 0.9 * total, (mine, total)
        # Asynchronous scheduling across the processes (the server's default): every process
        # feeds the placeholder rows from its own copy of the previous step's sampled tokens.
        assert "asynchronous scheduling: step n+1 is scheduled" in mh.leader_log()

        engine, ref, lps, dtype = reference_engine(DP2_EP_FP8_PD)
        consumer = engine.pd.consumer
        pulled, landed = consumer.num_transfers, consumer.num_remote_tokens
        got = pd_from_multihost(mh.url, engine)
        compare_streams(ref, got, lps, PROMPTS, api.load(cache_dtype=dtype))
        # Every prompt token but the last came from the multi-process engine, none failed.
        assert consumer.num_failed_transfers == 0
        assert consumer.num_transfers - pulled == len(PROMPTS)
        assert consumer.num_remote_tokens - landed == sum(len(p) - 1 for p in PROMPTS.values())
        # "b" and "c" (the follower's replica) were staged by the follower, "a" by the leader.
        assert "P/D: each process stages and pulls its own replicas' KV" in mh.leader_log()
        staged = re.findall(r"process 1: staged (\d+) tokens .* of request (\S+) from its own arena shards",
                            mh.follower_log())
        assert sorted(int(n) for n, _ in staged) == sorted(len(PROMPTS[k]) - 1 for k in "bc"), staged

        got = pd_into_multihost(mh.url, engine)
        compare_streams(ref, got, lps, PROMPTS, api.load(cache_dtype=dtype))
        assert len(re.findall(r"process 1: pulled chunk \d+ of", mh.follower_log())) == 2  # "b" and "c"
        assert metric(mh.url, "vllm:kv_transfer_remote_prompt_tokens_total") == sum(len(p) - 1 for p in PROMPTS.values())
        assert metric(mh.url, "vllm:nixl_num_failed_transfers_total") == 0
        assert not engine.audit()
        # SIGTERM while a stream runs: it finishes, then every process exits 0.
        it = stream_tokens(mh.url, PROMPTS["b"], 24)
        ids, _ = next(it)
        mh.leader.send_signal(signal.SIGTERM)
        finish = None
        for item in it:
            assert not isinstance(item, Exception), f"{item}\n{mh.logs()}"
            ids += item[0]
            finish = item[1] or finish
        assert finish == "length" and len(ids) == 24
        codes = mh.wait_all(60)
        assert codes == [0, 0], f"exit codes {codes}\n{mh.logs()}"
        assert "the leader stopped the engine after" in mh.follower_log()


def test_pcp2_dcp2_offload_and_pd_across_processes_serve_the_one_process_streams_and_a_killed_follower_stops_all():
    """PCP2 × DCP2 over 2 × 1 devices with the CPU offloading connector and P/D (MultiConnector,
    kv_both): the streams equal the one-device engine's and the sealed pages are stored to the
    host store. (A later turn loaded back from it needs a full 1,536-token indexer page under
    DCP2, beyond this engine's 192-token limit: the loads across processes are checked under TP2
    in the MTP test below, and under PCP2 × DCP2 in one process by
    tests/sharding/test_pd_parallel.py.) Its one replica spans the processes (a DCP rank on each),
    so P/D goes through the leader: the staging gather and the landing scatter run on both
    processes, the leader alone talking to the peer; P/D both ways with the one-device engine
    gives that engine's streams. Then a follower is killed mid-stream."""
    trace = tempfile.mkdtemp(prefix="glm53-mh-trace-")
    profiler = ["--profiler-config", json.dumps({"profiler_dir": trace})]
    with multihost_engine(ENGINE + PCP2_DCP2_OFFLOAD_PD + profiler, devices_per_process=1) as mh:
        _, _, got = check_equal(PCP2_DCP2_OFFLOAD_PD, mh.url)
        # A trace (serving/profiling.py) is taken on both processes, of the same engine steps.
        assert httpx.post(mh.url + "/start_profile", timeout=60).status_code == 200
        httpx.post(mh.url + "/v1/completions", timeout=300, json={
            "model": MODEL, "prompt": PROMPTS["a"], "max_tokens": 3}).raise_for_status()
        run = httpx.post(mh.url + "/stop_profile", timeout=120).json()["trace_dir"]
        assert run.startswith(os.path.join(trace, "process_0"))
        deadline = time.monotonic() + 60  # the follower writes its run after the leader's answer
        while "process 1: profiler trace written" not in mh.follower_log() and time.monotonic() < deadline:
            time.sleep(0.2)
        follower_runs = glob.glob(os.path.join(trace, "process_1", "plugins", "profile", "*"))
        steps = [traced_steps(r) for r in (run, *follower_runs)]
        assert len(steps) == 2 and all(n >= 3 for n in steps), steps
        assert abs(steps[0] - steps[1]) <= 1, steps  # (the leader may have sent one step more)
        assert "an attention replica spans processes; its KV is staged and landed through the leader" in mh.leader_log()
        engine, ref, lps, _ = reference_engine(PCP2_DCP2_OFFLOAD_PD)
        compare_streams(ref, pd_from_multihost(mh.url, engine, ranks=None), lps, PROMPTS)
        compare_streams(ref, pd_into_multihost(mh.url, engine, ranks=None), lps, PROMPTS)
        assert metric(mh.url, "vllm:kv_transfer_remote_prompt_tokens_total") == sum(len(p) - 1 for p in PROMPTS.values())
        assert metric(mh.url, "vllm:nixl_num_failed_transfers_total") == 0 and not engine.audit()
        assert "from its own arena shards" not in mh.follower_log()
        # A prompt with a full 128-token unit (64 x DCP2): its sealed pages go to the host store, on
        # both processes (the store program spans them).
        httpx.post(mh.url + "/v1/completions", timeout=300, json={
            "model": MODEL, "prompt": [(19 * j) % 470 + 5 for j in range(150)], "max_tokens": 1}).raise_for_status()
        assert metric(mh.url, "vllm:kv_offload_total_bytes_total") > 0

        it = stream_tokens(mh.url, PROMPTS["b"], 40)
        ids, _ = next(it)
        mh.followers[0].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        items = list(it)
        assert items and isinstance(items[-1], Exception), items  # the stream ends in an error
        ids += [t for item in items[:-1] for t in item[0]]
        assert len(ids) < 40
        assert ids[:MAX_TOKENS] == got["b"][:len(ids[:MAX_TOKENS])]  # what it streamed is what it served before
        assert health(mh.url) in (503, None)
        codes = mh.wait_all(30)
        assert codes[0] == 1, f"leader exit code {codes[0]}\n{mh.logs()}"
        assert time.monotonic() - t0 < 30
        assert "the engine died" in mh.leader_log()


def traced_steps(run_dir: str) -> int:
    """The `engine_step` annotations in a trace run's Perfetto file."""
    with gzip.open(os.path.join(run_dir, "perfetto_trace.json.gz")) as f:
        events = json.load(f)["traceEvents"]
    return sum(1 for e in events if e.get("name") == "engine_step" and e.get("ph") == "X")


def test_a_corrupt_step_message_stops_the_engine_without_a_wrong_token():
    ref, lps, dtype = reference(DP2_EP_FP8_PD)  # (the streams of the P/D test's reference)
    with multihost_engine(ENGINE + DP2_EP_FP8, leader_env={CORRUPT_ENV: "4"}, devices_per_process=1) as mh:
        items = list(stream_tokens(mh.url, PROMPTS["a"], MAX_TOKENS))
        assert items and isinstance(items[-1], Exception), items
        ids = [t for item in items[:-1] for t in item[0]]
        assert len(ids) < MAX_TOKENS
        compare_streams({"a": ref["a"][:len(ids)]}, {"a": ids}, lps, PROMPTS, api.load(cache_dtype=dtype))
        codes = mh.wait_all(30)
        assert codes[0] == 1 and codes[1] not in (0, None), f"exit codes {codes}\n{mh.logs()}"
        assert "failed its CRC32 check" in mh.follower_log()


def test_a_follower_with_other_engine_flags_is_refused_by_name_before_any_collective():
    """The handshake runs before the first collective (and without --num-gpu-blocks-override, so
    each process sizes its KV arena from its own devices): a follower started with another
    --max-model-len stops start-up with the differing key named; every process exits 1 at once."""
    flags = [f for f in ENGINE if f not in ("--num-gpu-blocks-override", "24")]
    with pytest.raises(RuntimeError) as err, multihost_engine(
            flags + DP2_EP_FP8, follower_flags=["--max-model-len", "128"], startup_timeout_s=120, devices_per_process=1):
        pass
    assert "max_model_len: leader 192, process 1 128" in str(err.value)
    assert "server exited with 1" in str(err.value)
    # The follower hears the leader's reason and exits 1 itself, before it compiles (it used to
    # outlive the leader until JAX's coordination client aborted it with a fatal log line).
    follower = str(err.value).split("--- follower 1 (exited with 1) ---")[1]
    assert "the leader refused to start the engine: the leader failed to start: process 1 built a different " \
           "engine: max_model_len: leader 192, process 1 128" in follower
    assert "Terminating process" not in follower and "Check failed" not in follower


def test_mtp_k2_and_offload_loads_across_two_processes_then_a_frozen_follower_stops_all():
    """MTP k = 2 under TP2 over 2 × 1 devices (the TP group spans the processes) with the CPU
    offloading connector: the streams equal the one-process engine's. Then structured outputs
    across the processes: the leader computes each step's masks (k + 1 rows per request under MTP)
    and sends them with the step's inputs; sampled at temperature 1, the random-weight model's
    outputs match the regex and are among the choices only through the mask. Then the connector's
    loads: a 760-token prompt, another that evicts its pages from the 23-page device pool, and the
    first again — its prefix comes back from the host store (every process loads its own copy of
    the pages, in the load program both run) and it answers as the first time. Prompt logprobs
    across the processes follow one full forward. Then the follower
    is frozen (SIGSTOP) mid-stream: the stream ends in an error within --peer-timeout (3 s) plus a
    heartbeat period, /health answers 503 (or the port is closed), the leader exits 1 naming the
    silent process, and the follower, resumed, exits non-zero."""
    with multihost_engine(ENGINE + MTP_TP2_OFFLOAD + ["--peer-timeout", "3"], devices_per_process=1) as mh:
        check_equal(MTP_TP2, mh.url)
        assert "asynchronous scheduling: step n+1 is scheduled" in mh.leader_log()  # (MTP: fed on the device)
        for so, ok in (({"regex": r"[a-z]{2,5}-[0-9]{3}"}, lambda t: re.fullmatch(r"[a-z]{2,5}-[0-9]{3}", t)),
                       ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue"))):
            r = httpx.post(mh.url + "/v1/completions", timeout=300, json={
                "model": MODEL, "prompt": PROMPTS["b"], "max_tokens": 24, "temperature": 1.0, "seed": 7, "n": 2,
                "structured_outputs": so})
            assert r.status_code == 200, f"{r.text}\n{mh.logs()}"
            for c in r.json()["choices"]:
                assert c["finish_reason"] == "stop" and ok(c["text"]), c
        # Prompt logprobs across the processes (serving/prompt_logprobs.py: the whole speculative
        # step takes the rows on every process; the leader reads them), scored as evaluation
        # harnesses ask (echo, logprobs 1, max_tokens 0), against one full forward of the prompt.
        r = httpx.post(mh.url + "/v1/completions", timeout=300, json={
            "model": MODEL, "prompt": PROMPTS["c"], "max_tokens": 0, "echo": True, "logprobs": 1})
        assert r.status_code == 200, f"{r.text}\n{mh.logs()}"
        got = r.json()["choices"][0]["logprobs"]["token_logprobs"]
        logits = api.forward(api.load(), PROMPTS["c"]).astype(np.float64)[:, :VOCAB]
        ref = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        assert got[0] is None and len(got) == len(PROMPTS["c"])
        assert max(abs(got[i] - ref[i - 1, t]) for i, t in enumerate(PROMPTS["c"]) if i) < 2e-4  # (observed 3e-6)

        def complete(prompt):
            r = httpx.post(mh.url + "/v1/completions", timeout=300, json={
                "model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True})
            assert r.status_code == 200, f"{r.text}\n{mh.logs()}"
            return r.json()["choices"][0]["token_ids"], r.json()["usage"]

        first, _ = complete(LONG_PROMPTS["A"])
        complete(LONG_PROMPTS["B"])
        again, usage = complete(LONG_PROMPTS["A"])
        loaded = metric(mh.url, "vllm:kv_offload_total_bytes_total", 'transfer_type="cpu_to_gpu"')
        # The hit is at least one indexer page (448 tokens on the 7-layer twin, MTP layer included):
        # the pages B evicted come from the host store.
        assert (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) >= 448, usage
        assert metric(mh.url, "vllm:external_prefix_cache_hits_total") > 0 and loaded > 0, mh.leader_log()[-3000:]
        assert again == first

        it = stream_tokens(mh.url, PROMPTS["b"], 60)
        next(it)
        mh.followers[0].send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        items = list(it)
        assert items and isinstance(items[-1], Exception), items
        waited = time.monotonic() - t0
        assert 2.0 < waited < 20, waited  # bounded by --peer-timeout (3 s) plus the heartbeat period
        assert health(mh.url) in (503, None)
        assert mh.leader.wait(30) == 1, mh.logs()
        assert "sent no heartbeat" in mh.leader_log()
        mh.followers[0].send_signal(signal.SIGCONT)
        assert mh.followers[0].wait(30) not in (0, None), mh.logs()


HS_PROMPTS = {f"r{i}": [(17 * i + 31 * j) % 450 + 5 for j in range(400)] for i in range(4)}
HS_MAX_TOKENS = 8
HS_ENGINE = [*TWIN, "--max-model-len", "1024", "--max-num-seqs", "4", "--max-num-batched-tokens", "16",
             "--cuda-graph-sizes", "--precompile-token-paddings", "--disable-log-stats", "--enable-prefix-caching",
             "--kv-cache-dtype", "fp8"]
HS_LAYOUT = ["-dp", "2", "--enable-expert-parallel", "--num-gpu-blocks-override", "10", "--attention-config",
             json.dumps({"hisparse_config": {"host_pool_gib": 0.05, "prefill_buffer_size": 1024,
                                             "host_gather": "memory_kind"}})]


def test_hisparse_on_a_pool_far_too_small_spans_both_processes():
    """DP2 + EP with one device and replica per process, 9 usable pages per replica, two 400-token requests
    pinned to each replica (16 pages each pair), on the fp8 cache (`fp8_ds_mla` rows with their
    scales, fp8 indexer keys): both replicas' host pools — one per process — hold released pages
    and feed the hot buffers; the streams equal the one-device ample fp8 run without HiSparse, and
    nobody is preempted."""
    args = make_arg_parser().parse_args(HS_ENGINE + ["--num-gpu-blocks-override", "160"])
    validate_args(args)
    ref, lps, _ = greedy_streams(build_engine(engine_args(args, None)), HS_PROMPTS, HS_MAX_TOKENS)
    with multihost_engine(HS_ENGINE + HS_LAYOUT, devices_per_process=1) as mh:
        got = {}

        def one(i, rid):
            r = httpx.post(mh.url + "/v1/completions", timeout=600, headers={"X-data-parallel-rank": str(i // 2)},
                           json={"model": MODEL, "prompt": HS_PROMPTS[rid], "max_tokens": HS_MAX_TOKENS,
                                 "temperature": 0, "ignore_eos": True, "return_token_ids": True})
            assert r.status_code == 200, r.text
            got[rid] = r.json()["choices"][0]["token_ids"]

        threads = [threading.Thread(target=one, args=(i, rid)) for i, rid in enumerate(HS_PROMPTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        misses = metric(mh.url, "vllm:hisparse_cache_misses_total")
        preemptions = metric(mh.url, "vllm:num_preemptions_total")
    compare_streams(ref, got, lps, HS_PROMPTS, api.load(cache_dtype="fp8"))
    assert misses > 0  # rows really came from the host pools
    assert preemptions == 0
