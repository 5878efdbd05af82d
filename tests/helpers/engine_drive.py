"""Driving an engine through a workload step by step, with arrivals and aborts at given `step()`
calls and audits after each (the asynchronous-scheduling tests compare such runs with their
synchronous twins)."""

from __future__ import annotations


def drive(e, requests, async_scheduling: bool, events=None):
    """Run `requests` ({id: (prompt, params)}) to the end; `events` maps a `step()` call index to
    a list of ("add", id) / ("abort", id) done before that call (all requests are added before
    the first call when None). Audits after every call. → ({id: tokens}, {id: finish reason},
    {id: logprobs}, calls)."""
    e.set_async_scheduling(async_scheduling)
    toks = {rid: [] for rid in requests}
    reasons, lps = {}, {rid: [] for rid in requests}
    if events is None:
        events = {0: [("add", rid) for rid in requests]}
    call = 0
    while e.has_unfinished_requests() or any(k >= call for k in events):
        for kind, rid in events.get(call, []):
            if kind == "add":
                e.add_request(rid, *requests[rid])
            elif rid not in reasons:
                out = e.abort(rid)
                if out is not None:
                    reasons[rid] = out.finish_reason
        for o in e.step():
            assert o.request_id not in reasons, f"{o.request_id} streamed after it finished"
            toks[o.request_id] += o.new_token_ids
            lps[o.request_id] += o.new_logprobs or []
            if o.finished:
                reasons[o.request_id] = o.finish_reason
        assert e.audit() == []
        call += 1
    for s in e._schedulers():  # (one, or one per data-parallel replica)
        assert s.running == [] and not s.waiting
        assert all(r.num_output_placeholders == 0 for r in s.requests.values())
    return toks, reasons, lps, call
