"""`AsyncEngine`: the `EngineClient` the HTTP server talks to.

A background thread owns the `LLMEngine` and runs `step()` while there is work; callers submit
requests from the asyncio loop and receive `RequestOutput`s through per-request asyncio queues.
Only the engine thread touches the engine; submissions and aborts cross over through a lock-
protected inbox, so a client disconnect can never race a step. A request whose step failed gets
`EngineStepError` (the server's 500); when the engine dies (`serving.faults.EngineDeadError`)
every open request gets an error, `is_healthy()` turns False and the `on_dead` callbacks run
(the server exits non-zero). Each step runs under a `jax.profiler.StepTraceAnnotation`
("engine_step"), and a trace (`serving/profiling.py`, `profiler`) starts and stops on the engine
thread between steps.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

import jax

from serving.engine import LLMEngine
from serving.types import RequestOutput, SamplingParams

logger = logging.getLogger(__name__)


class EngineStepError(RuntimeError):
    """The engine step that ran this request failed; the engine itself goes on serving."""


class AsyncEngine:
    """Runs an `LLMEngine` in a thread. `model_name` is the served model name."""

    def __init__(self, engine: LLMEngine, model_name: str):
        self.engine = engine
        self.model_name = model_name
        # the context length requests are checked against: --max-model-len, or less when the KV
        # cache bounds one request (Hybrid HiSparse on a small pool), with the sentence saying why
        self.max_model_len = engine.effective_max_model_len
        self.max_model_len_note = engine.max_model_len_note()
        self.max_logprobs = engine.args.max_logprobs  # the server checks requests against it
        self._cv = threading.Condition()
        self._inbox: list[tuple] = []
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._dead: BaseException | None = None
        self._stop = False
        # Set by `abort_all` (a draining server's deadline) to the finish reason every request
        # submitted after it ends with at once (e.g. the later choices of an n > 1 stream).
        self._aborted_all: str | None = None
        self.on_dead: list = []  # callbacks(exc) run on the engine thread when the engine dies
        self.profiler = None  # a serving.profiling.EngineProfiler with --profiler-config
        self._steps = 0
        pd = getattr(engine, "pd", None)
        if pd is not None:  # P/D: a side-channel job or a finished pull wakes the loop
            pd.set_wake(self._wake)
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ client side
    def is_healthy(self) -> bool:
        """False once the engine died (its device state was lost, or its loop crashed)."""
        return self._dead is None and self._thread.is_alive()

    def num_unfinished_requests(self) -> int:
        """Requests the engine holds (waiting or running) plus those queued in the inbox."""
        with self._cv:
            queued = sum(1 for item in self._inbox if item[0] == "add")
        return queued + len(self._queues)

    def kv_event_sources(self) -> dict[str, dict]:
        """Where each data-parallel replica publishes its KV events, keyed by rank (a string), for
        `GET /kv_event_sources`; empty when `--kv-events-config` is off or its publisher is "null"."""
        events = getattr(self.engine, "kv_events", None)
        return {} if events is None else events.discovery_sources()

    @property
    def kv_block_size(self) -> int | None:
        """Tokens per KV event block (the prefix cache's hash unit), None when events are off."""
        events = getattr(self.engine, "kv_events", None)
        return None if events is None else events.block_size

    async def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Every check `generate` would make of a request, without submitting it: the engine's
        (`LLMEngine._validate`: lengths, vocabulary, ranks, budgets) and its constraint's compile
        (then dropped). Raises the ValueError `generate` would (the server's 400s)."""
        self.engine._validate(list(prompt_token_ids), params)
        precompile = getattr(self.engine, "precompile_constraint", None)
        if params.structured_outputs is not None and precompile is not None:
            probe = f"check-{id(params)}"
            try:
                await asyncio.get_running_loop().run_in_executor(None, precompile, probe, params)
            finally:
                self._discard_precompiled(probe)

    async def start_profile(self) -> str:
        """Start a trace between two engine steps (`serving/profiling.py`); returns the directory
        it is written under. Raises `ProfilerError` when no profiler is configured or a trace runs."""
        return await self._profile("start")

    async def stop_profile(self) -> str | None:
        """End the trace after the step running now; returns the run directory written. Raises
        `ProfilerError` when none runs."""
        return await self._profile("stop")

    async def _profile(self, action: str) -> Any:
        from serving.profiling import ProfilerError

        if self.profiler is None:
            raise ProfilerError("no profiler is configured (start the server with --profiler-config)")
        if self._dead is not None:
            raise RuntimeError(f"engine is dead: {self._dead!r}")
        done = asyncio.get_running_loop().create_future()
        with self._cv:
            self._inbox.append(("profile", action, done))
            self._cv.notify()
        return await done

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; raises ValueError for a request the engine refuses."""
        if self._dead is not None:
            raise RuntimeError(f"engine is dead: {self._dead!r}")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        done = asyncio.get_running_loop().create_future()
        precompile = getattr(self.engine, "precompile_constraint", None)
        if params.structured_outputs is not None and precompile is not None:
            with self._cv:
                if request_id in self._queues:
                    raise ValueError(f"duplicate request id {request_id!r}")
            # The grammar compiles in a worker thread: the engine keeps stepping meanwhile.
            await loop.run_in_executor(None, precompile, request_id, params)
        with self._cv:
            if request_id in self._queues:
                self._discard_precompiled(request_id)
                raise ValueError(f"duplicate request id {request_id!r}")
            aborted = self._aborted_all
            if aborted is not None:
                self._discard_precompiled(request_id)
            else:
                self._queues[request_id] = (loop, q)
                self._inbox.append(("add", request_id, prompt_token_ids, params, done))
                self._cv.notify()
        if aborted is not None:  # after the drain's deadline: it ends as the requests running then did
            yield RequestOutput(request_id, [], True, aborted, len(prompt_token_ids), 0, 0)
            return
        try:
            await done  # raises the engine's ValueError for a refused request
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            with self._cv:
                alive = self._queues.pop(request_id, None) is not None
                if alive:
                    self._inbox.append(("abort", request_id, "abort"))
                    self._cv.notify()

    async def abort(self, request_id: str, finished_reason: str = "abort") -> None:
        """Abort a request; finished_reason "stop" when a stop string ended it."""
        with self._cv:
            self._inbox.append(("abort", request_id, finished_reason))
            self._cv.notify()

    def abort_all(self, finished_reason: str = "abort") -> int:
        """Abort every request the engine holds, each stream ending with a final output (finish
        reason `finished_reason`), as a draining server does at its deadline; a request submitted
        afterwards (the later choices of an n > 1 request start after its first choice's first
        output) gets that final output at once instead of running. Returns how many it aborted."""
        with self._cv:
            self._aborted_all = finished_reason
            rids = list(self._queues)
            self._inbox.extend(("abort_all", rid, finished_reason) for rid in rids)
            self._cv.notify()
        return len(rids)

    def background_compile_running(self) -> bool:
        """Whether a background step-variant compile (`serving.runner_variants`) is still inside
        XLA: the process must then end with `os._exit` (tearing the interpreter down under a
        running XLA compile crashes it with SIGSEGV)."""
        runner = getattr(self.engine, "runner", None)
        return bool(getattr(runner, "variant_precompile_running", _noop)())

    def engine_thread_running(self) -> bool:
        """Whether the engine thread is still inside a step after `shutdown` stopped waiting for it
        (a step compiled on first use can take a minute): the process must then end with `os._exit`,
        as under a background compile."""
        return self._thread.is_alive()

    def shutdown(self, timeout: float = 30.0, close: bool = True) -> None:
        """Stop the engine thread (waiting up to `timeout` seconds for its step) and, with
        `close`, close the P/D side channel and the KV event publishers."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=timeout)
        if self.profiler is not None and self.profiler.active and not self._thread.is_alive():
            self.profiler.stop()  # a trace left running is written, not lost
        runner = getattr(self.engine, "runner", None)
        if runner is not None and hasattr(runner, "stop_variant_precompile"):
            runner.stop_variant_precompile()  # a daemon thread: stops after the compile in progress
        if not close:
            return
        pd = getattr(self.engine, "pd", None)
        if pd is not None:
            pd.close()  # the P/D side channel's socket and thread
        events = getattr(self.engine, "kv_events", None)
        if events is not None:
            events.close()  # the KV event publishers' sockets and threads

    # ------------------------------------------------------------------ engine thread
    def _has_jobs(self) -> bool:
        return getattr(self.engine, "has_pending_work", _noop)()

    def _only_waiting_for_kv(self) -> bool:
        return getattr(self.engine, "is_waiting_for_remote_kv", _noop)()

    def _discard_precompiled(self, request_id: str) -> None:
        structured = getattr(self.engine, "structured", None)
        if structured is not None:
            structured.discard_precompiled(request_id)

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify()

    def _deliver(self, out: RequestOutput | BaseException, request_id: str) -> None:
        if isinstance(out, RequestOutput) and out.error is not None:
            out = EngineStepError(out.error)  # the request's step failed (serving/faults.py)
        with self._cv:
            entry = self._queues.get(request_id)
            if entry is not None and (not isinstance(out, RequestOutput) or out.finished):
                self._queues.pop(request_id, None)
        if entry is not None:
            loop, q = entry
            loop.call_soon_threadsafe(q.put_nowait, out)

    def _drain_inbox(self) -> None:
        with self._cv:
            items, self._inbox = self._inbox, []
        for item in items:
            if item[0] == "add":
                _, rid, prompt, params, done = item
                try:
                    self.engine.add_request(rid, prompt, params)
                    err = None
                except ValueError as e:
                    err = e
                    self._discard_precompiled(rid)
                    with self._cv:
                        self._queues.pop(rid, None)
                loop = done.get_loop()
                loop.call_soon_threadsafe(_settle, done, err)
            elif item[0] == "profile":
                _, action, done = item
                try:
                    result, err = getattr(self.profiler, action)(), None
                except Exception as e:  # noqa: BLE001 - handed to the caller
                    result, err = None, e
                done.get_loop().call_soon_threadsafe(_settle, done, err, result)
            elif item[0] == "abort_all":  # the stream waits for its end: deliver it
                out = self.engine.abort(item[1], item[2])
                if out is not None:
                    self._deliver(out, item[1])
            else:
                self.engine.abort(item[1], item[2])

    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    while (not self._stop and not self._inbox and not self.engine.has_unfinished_requests()
                           and not self._has_jobs()):
                        # (an idle prefill server wakes at the earliest P/D hold's deadline to release it)
                        wake = getattr(self.engine, "idle_wake_after", _none)()
                        self._cv.wait(None if wake is None else wake + 0.01)
                    if self._stop:
                        return
                self._drain_inbox()
                if self.engine.has_unfinished_requests() or self._has_jobs():
                    self._steps += 1
                    with jax.profiler.StepTraceAnnotation("engine_step", step_num=self._steps):
                        outs = self.engine.step()
                    if self.profiler is not None:
                        self.profiler.after_step()
                    for out in outs:
                        self._deliver(out, out.request_id)
                    if not outs and self._only_waiting_for_kv():
                        with self._cv:  # nothing runs: wait for the pull (or news) instead of spinning
                            if not self._inbox:
                                self._cv.wait(0.002)
        except BaseException as e:  # device state lost (EngineDeadError) or a bug outside the step
            if self._dead is None:
                logger.exception("engine loop died")
            self._die(e)

    def fail(self, error: BaseException) -> None:
        """Declare the engine dead from any thread (a multi-host peer was lost, serving/multihost):
        every open request gets an error, `is_healthy()` turns False, the `on_dead` callbacks run
        and the engine thread stops at its next turn (a step blocked on a lost peer is left to
        fail on its own)."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._die(error)

    def _die(self, e: BaseException) -> None:
        """Once: mark the engine dead, fail every open request, run the `on_dead` callbacks."""
        with self._cv:
            if self._dead is not None:
                return
            self._dead = e
            entries = list(self._queues.items())
        for rid, _ in entries:
            self._deliver(RuntimeError(f"engine failed: {e!r}"), rid)
        for cb in list(self.on_dead):
            try:
                cb(e)
            except Exception:  # noqa: BLE001
                logger.exception("on_dead callback failed")


def _noop() -> bool:
    return False


def _none() -> None:
    return None


def _settle(fut: asyncio.Future, err: BaseException | None, result: Any = None) -> None:
    if fut.done():
        return
    if err is None:
        fut.set_result(result)
    else:
        fut.set_exception(err)
