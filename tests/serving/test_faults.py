"""Engine faults (`serving/faults.py`) and cancellation, in every residency mode (device-resident and
Hybrid HiSparse) and with the KV offloading connector: a step that raises with the device state intact fails only its own requests
(finish reason "error", every page freed) and the engine goes on producing the same tokens; a
step that loses the device state kills the engine (`EngineDeadError`); a request cancelled while
it waits, prefills or decodes frees every page in every group and every host block."""

from __future__ import annotations

import numpy as np
import pytest

from serving.faults import EngineDeadError, FaultInjection
from serving.types import SamplingParams
from tests.serving.test_hisparse_engine import AMPLE, HISPARSE, SMALL, engine

# The tiny checkpoint's 7-layer twin (tests/helpers/shallow_model.py): the same code paths, faster steps.
pytestmark = pytest.mark.shallow_model

OFFLOAD = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes_to_use": 2**26}}
MODES = {"device": dict(num_blocks=AMPLE, kv_cache_dtype="bfloat16"),
         "hisparse": dict(num_blocks=SMALL, kv_cache_dtype="bfloat16", attention_config=HISPARSE),
         # the offloading connector on a small pool: queued stores and pinned loads in flight
         "offload": dict(num_blocks=SMALL, kv_cache_dtype="bfloat16", kv_transfer_config=OFFLOAD)}
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(MODES))
def eng(request):
    return engine(**MODES[request.param])


def run(e, rid, prompt, params=GREEDY):
    e.add_request(rid, prompt, params)
    toks = []
    while e.has_unfinished_requests():
        for o in e.step():
            toks += o.new_token_ids
    return toks


def assert_all_free(e):
    assert e.audit() == []
    e.step()  # idle: HiSparse flushes its queued host copies
    assert e.pool.num_free == e.pool.num_usable_blocks, "KV pages leaked"
    if e.hisparse is not None:
        host = e.hisparse.host
        assert not host.queue and not host.in_flight
        assert host.blocks.num_free == host.num_usable, "host blocks leaked"
    if e.offload is not None:
        st = e.offload.store
        assert not st.queue and not st.in_flight and not st.pinned and st.audit() == []
        assert st.blocks.num_free == st.num_usable, "offload host blocks leaked"


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(eng):
    e = eng
    rng = np.random.default_rng(11)
    ref_prompt = rng.integers(10, 490, 300).tolist()
    ref = run(e, "ref", ref_prompt)
    for i in range(3):
        e.add_request(f"bad{i}", rng.integers(10, 490, 200 + 40 * i).tolist(),
                      SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        e.step()
    e.runner.faults = FaultInjection("step_error")  # the next step raises before it is dispatched
    outs = e.step()
    e.runner.faults = None
    failed = {o.request_id: o for o in outs}
    assert failed and set(failed) <= {"bad0", "bad1", "bad2"}
    for o in failed.values():
        assert o.finished and o.finish_reason == "error" and "InjectedFault" in o.error
    while e.has_unfinished_requests():  # the ones the failed step did not schedule go on
        e.step()
    assert not e.runner.device_state_lost()
    assert run(e, "again", ref_prompt) == ref
    assert_all_free(e)


def test_a_step_that_loses_the_device_state_kills_the_engine():
    e = engine(**MODES["device"])
    e.add_request("doomed", list(range(10, 90)), GREEDY)
    e.step()
    e.runner.faults = FaultInjection("device_lost")
    with pytest.raises(EngineDeadError, match="device state was lost"):
        e.step()
    assert e.runner.device_state_lost()
    assert not e.has_unfinished_requests()  # its request was failed first


@pytest.mark.parametrize("when", ["waiting", "prefilling", "decoding"])
def test_cancel_frees_every_page_in_every_group(eng, when):
    e = eng
    rng = np.random.default_rng({"waiting": 1, "prefilling": 2, "decoding": 3}[when])
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i in range(6):  # max_num_seqs 4: two wait
        e.add_request(f"{when}{i}", rng.integers(10, 490, 500).tolist(), params)
    victim = None
    for _ in range(200):
        e.step()
        reqs = list(e.scheduler.running) + list(e.scheduler.waiting)
        pick = {"waiting": [r for r in e.scheduler.waiting],
                "prefilling": [r for r in e.scheduler.running if 0 < r.num_computed_tokens < r.num_prompt_tokens],
                "decoding": [r for r in e.scheduler.running if r.num_output_tokens > 2]}[when]
        if pick:
            victim = pick[0]
            assert e.abort(victim.request_id).finish_reason == "abort"
            assert not e.kv.has_request(victim.request_id)
            break
        assert reqs
    assert victim is not None, f"no request was ever {when}"
    for r in list(e.scheduler.running) + list(e.scheduler.waiting):
        e.abort(r.request_id)
    assert_all_free(e)
