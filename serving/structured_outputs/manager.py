"""`StructuredOutputManager`: the engine's grammar state per constrained request, and each
step's token bitmask.

Lifecycle (on the engine's thread, except `precompile`):

* `precompile(request_id, params)`, from any thread before the request reaches the engine (the
  server's `AsyncEngine.generate` runs it in a worker thread, so a large schema never stalls the
  engine's steps): the constraint compiles into an `llguidance.LLMatcher`, kept for `add`;
* `add(request_id, params)` when the request is queued: it takes the precompiled matcher, or
  compiles the constraint now (`StructuredOutputsError`, a 400, when it does not);
* `bitmask(sched, rows, positions)` after scheduling: one packed int32 row of allowed ids per
  sampled position of a constrained request (all ones elsewhere), or None when no scheduled
  request samples under a constraint — the step then runs the program without a mask;
* `accept(outputs)` after the step's tokens were applied: every matcher consumes its request's
  new tokens (the mask guaranteed they are allowed);
* `remove(request_id)` when it finishes, is aborted or fails.

Speculative steps (MTP): a request verifying drafts `d_1 … d_n` gets n + 1 rows: row j is the
grammar's mask after `d_1 … d_j` (consumed tentatively, then rolled back). A draft the grammar
forbids ends the rows there: the target's probability of that draft is 0 after masking, so the
verifier rejects it, and the rows after it are never used.

Reasoning: a constraint with `reasoning_end_token_id` lets the output through unconstrained up to
and including that token (`</think>`), then applies from the next token on.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import numpy as np

from serving.structured_outputs.params import StructuredOutputsParams

logger = logging.getLogger(__name__)


@dataclass
class _Constrained:
    matcher: object  # llguidance.LLMatcher
    waiting_for: int | None  # the reasoning end token still to come, or None: constrained now


class StructuredOutputManager:
    """Grammar state of the engine's constrained requests.

    backend_factory: `() -> GuidanceBackend`, called on the first constrained request (building
    the llguidance tokenizer walks the whole vocabulary — about a second for a large one, llguidance's
    docs say; not measured here on GLM-5.3's — so engines that never
    see one never pay it).

    Counters: `num_requests_total` (constrained requests accepted), `mask_seconds_total` (host
    time computing masks), `num_masked_steps` (steps that ran with a mask).
    """

    def __init__(self, backend_factory) -> None:
        self._factory = backend_factory
        self._backend = None
        self.requests: dict[str, _Constrained] = {}
        self.num_requests_total = 0
        self.mask_seconds_total = 0.0
        self.num_masked_steps = 0
        self._executor = None
        self._lock = threading.Lock()  # the backend is built once, whichever thread asks first
        self._precompiled: dict[str, object] = {}  # request id → its matcher, compiled off the engine thread

    @property
    def backend(self):
        """The grammar backend (built on first use, from any thread)."""
        if self._backend is None:
            with self._lock:
                if self._backend is None:
                    self._backend = self._factory()
        return self._backend

    def precompile(self, request_id: str, params: StructuredOutputsParams) -> None:
        """Compile the constraint of a request not queued yet, from any thread; `add` takes the
        matcher. Raises StructuredOutputsError (a ValueError) as `add` would."""
        self._precompiled[request_id] = self.backend.matcher(params)

    def discard_precompiled(self, request_id: str) -> None:
        """Drop a precompiled matcher whose request never reached `add` (refused first)."""
        self._precompiled.pop(request_id, None)

    @property
    def executor(self):
        """llguidance's mask thread pool (`LLExecutor`, its default size: 80 % of the CPUs, up to 32)."""
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor()
        return self._executor

    def add(self, request_id: str, params: StructuredOutputsParams) -> None:
        """Track the request's constraint: its `precompile`d matcher, or compiled now. Raises
        StructuredOutputsError (a ValueError)."""
        m = self._precompiled.pop(request_id, None)
        if m is None:
            m = self.backend.matcher(params)
        self.requests[request_id] = _Constrained(m, params.reasoning_end_token_id)
        self.num_requests_total += 1

    def remove(self, request_id: str) -> None:
        """Forget a finished, aborted, failed or refused request (no-op for an unknown id)."""
        self.requests.pop(request_id, None)
        self._precompiled.pop(request_id, None)

    def __len__(self) -> int:
        return len(self.requests)

    def constrains(self, sched) -> bool:
        """True when a request of `sched` samples under its constraint."""
        return any(sr.sample and sr.request_id in self.requests for sr in sched.scheduled)

    def bitmask(self, sched, num_rows: int, num_positions: int) -> np.ndarray | None:
        """int32 `[num_rows, num_positions, W]`: for request row i of `sched` (batch order) that
        samples under a constraint, position j's allowed ids (j = 0: the first sampled row; j ≥ 1:
        after the request's first j verified drafts); all ones elsewhere. None when no row is
        constrained (see the module docstring)."""
        if not self.requests or not self.constrains(sched):
            return None
        import llguidance.numpy as lnp

        t0 = time.perf_counter()
        W = self.backend.bitmask_words
        out = np.full((num_rows, num_positions, W), -1, np.int32)
        jobs = []  # (matcher, first row of out.reshape(-1, W) to write, drafts after it)
        for i, sr in enumerate(sched.scheduled):
            c = self.requests.get(sr.request_id)
            if c is None or not sr.sample:
                continue
            ns = sr.num_spec_tokens
            drafts = [int(d) for d in sr.token_ids[len(sr.token_ids) - ns:]] if ns else []
            start = 0
            if c.waiting_for is not None:
                if c.waiting_for not in drafts:
                    continue  # still inside the reasoning block: unconstrained
                start = drafts.index(c.waiting_for) + 1
                drafts = drafts[start:]
            jobs.append((c.matcher, i * num_positions + start, drafts[: num_positions - 1 - start]))
        # llguidance's thread pool: each job writes its row K and, for the drafts it accepts in
        # turn, rows K + 1, K + 2, ... (stopping at the first forbidden draft, whose later rows the
        # masked verifier never reads), then rolls the matcher back.
        flat = out.reshape(-1, W)
        plain = [(m, k) for m, k, d in jobs if not d]
        spec = [job for job in jobs if job[2]]
        if plain:
            lnp.fill_next_token_bitmask_par(self.executor, plain, flat)
        if spec:
            lnp.fill_next_token_bitmask_par_with_draft_tokens(self.executor, spec, flat)
        self.mask_seconds_total += time.perf_counter() - t0
        self.num_masked_steps += 1
        return out

    def accept(self, request_id: str, token_ids: list[int]) -> bool:
        """The request emitted `token_ids` (in order): advance its matcher. → False when a token
        is not allowed by the grammar (never expected: the mask allowed it); the matcher is then
        in its error state and the caller ends the request."""
        c = self.requests.get(request_id)
        if c is None:
            return True
        for t in token_ids:
            t = int(t)
            if c.waiting_for is not None:
                if t == c.waiting_for:
                    c.waiting_for = None
                continue
            if c.matcher.is_stopped():
                break  # the end-of-sequence token after a finished grammar: nothing more follows
            if not c.matcher.consume_token(t):
                logger.error("structured outputs: request %s emitted token %d, which its grammar does not allow (%s)",
                             request_id, t, c.matcher.get_error())
                return False
        return True
