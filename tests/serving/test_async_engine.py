"""`serving.async_engine.AsyncEngine` against a stand-in engine (no model): what a draining
server's deadline (`abort_all`) does to requests submitted after it."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from serving.async_engine import AsyncEngine
from serving.types import RequestOutput, SamplingParams


class StallingEngine:
    """An `LLMEngine` stand-in whose requests never produce a token: only an abort ends them."""

    def __init__(self) -> None:
        self.args = SimpleNamespace(max_logprobs=20)
        self.effective_max_model_len = 1024
        self.requests: dict[str, int] = {}
        self.added: list[str] = []
        self.lock = threading.Lock()

    def max_model_len_note(self) -> str:
        return ""

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        with self.lock:
            self.requests[request_id] = len(prompt_token_ids)
            self.added.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return False  # nothing to step: the engine thread waits for its inbox

    def step(self) -> list[RequestOutput]:
        return []

    def abort(self, request_id: str, finished_reason: str = "abort") -> RequestOutput | None:
        with self.lock:
            n = self.requests.pop(request_id, None)
        return None if n is None else RequestOutput(request_id, [], True, finished_reason, n, 0, 0)


def test_a_request_submitted_after_abort_all_ends_at_once_without_reaching_the_engine():
    """The later choices of an n > 1 request are submitted after the first choice's first output;
    at the drain deadline that output is the abort, so they arrive after `abort_all`. They end at
    once with the same finish reason and never reach the engine (they used to run to their end
    past the deadline, and the server's shutdown cancelled their connections)."""
    stand_in = StallingEngine()
    engine = AsyncEngine(stand_in, "tiny")
    params = SamplingParams(temperature=0, max_tokens=50)

    async def run():
        async def collect(rid):
            return [o async for o in engine.generate([5, 6, 7], params, rid)]

        first = asyncio.create_task(collect("req-0"))
        while "req-0" not in stand_in.added:
            await asyncio.sleep(0.01)
        assert engine.abort_all() == 1
        outs0 = await asyncio.wait_for(first, 10)
        outs1 = await asyncio.wait_for(collect("req-1"), 10)
        return outs0, outs1

    try:
        outs0, outs1 = asyncio.run(run())
    finally:
        engine.shutdown(timeout=5)
    assert [(o.finished, o.finish_reason) for o in outs0] == [(True, "abort")]
    assert [(o.request_id, o.finished, o.finish_reason, o.new_token_ids, o.num_prompt_tokens) for o in outs1] == [
        ("req-1", True, "abort", [], 3)]
    assert stand_in.added == ["req-0"]  # the late request never reached the engine
    assert engine.num_unfinished_requests() == 0
