"""The engine's side of structured outputs (`LLMEngine` and `DataParallelEngine` mix it in).

* `precompile_constraint(request_id, params)`, from the server's worker thread before the request
  is submitted: the checks below and the compile, off the engine thread;
* `_structured_check(params)` in `add_request`'s validation: combinations refused (400) and the
  constraint compiled (`StructuredOutputsError` when it does not) unless it was precompiled;
  `_structured_admission` wraps it around the queueing, dropping the matcher again when the
  request is refused after it;
* `_structured_masks(scheds)` after scheduling: each `SchedulerOutput.grammar_bitmask`;
* `_structured_advance(outs)` after every step's tokens were applied (and on aborts and failed
  steps): matchers consume the new tokens; finished requests are forgotten.

Asynchronous scheduling: a constrained request's next mask needs the token of the step in flight,
so the engine waits for a step that sampled for a constrained request before it schedules the next
one (`serving.async_scheduling`); steps without constrained requests overlap as before.
"""

from __future__ import annotations

import contextlib
import logging

from serving.min_tokens import apply_min_tokens
from serving.structured_outputs.backend import GuidanceBackend
from serving.structured_outputs.config import StructuredOutputsConfig
from serving.structured_outputs.manager import StructuredOutputManager
from serving.structured_outputs.params import StructuredOutputsError

logger = logging.getLogger(__name__)


class StructuredOutputsMixin:
    """Needs `self.config`, `self.model_path`, `self.eos_token_ids`, `self.runner`, `self.args`."""

    structured: StructuredOutputManager

    def _structured_init(self, model_path: str, vocab_size: int, eos_token_ids, config: dict | None) -> None:
        """config: `--structured-outputs-config` (`StructuredOutputsConfig`; raises its error)."""
        eos = tuple(eos_token_ids)
        self.structured_config = StructuredOutputsConfig.from_dict(config)
        self._structured_vocab_size = int(vocab_size)
        self.structured = StructuredOutputManager(lambda: GuidanceBackend.from_model_dir(model_path, vocab_size, eos))

    def start_structured_precompile(self, default: bool) -> int:
        """Compile the step variants constrained steps run (the masked step; the forward pass alone
        and the sampler, which asynchronous scheduling runs for constrained steps and every engine
        for steps with penalties or logit biases, the sampler's smallest penalised form too) in a
        background thread
        (`serving.runner_variants`), when `--structured-outputs-config`'s `precompile` says so
        (`default` when it says nothing: the server passes True, `LLM` False) and the engine
        compiled its buckets at start-up in one process. Returns how many variants it compiles
        (0: none, and why is logged)."""
        import jax

        from serving.engine_args import skip_precompile_requested

        want = self.structured_config.precompile
        if not (default if want is None else want):
            return 0
        if skip_precompile_requested(self.args):
            logger.info("step variants compile on first use (the step buckets do too)")
            return 0
        if jax.process_count() > 1:
            logger.info("step variants compile on first use (a multi-process engine)")
            return 0
        # The split step (forward pass, then the sampler): structured outputs under asynchronous
        # scheduling, and penalties / logit biases always (serving/penalties.py).
        forward_only = self.runner.can_defer_sampling
        n = self.runner.start_variant_precompile(-(-self._structured_vocab_size // 32), forward_only)
        logger.info("compiling %d step variants in the background (requests with structured outputs, min_tokens, "
                    "penalties, logit_bias or prompt logprobs no longer stop the engine to compile them; "
                    "--structured-outputs-config "
                    "'{\"precompile\": false}' leaves them to first use)", n)
        return n

    def _structured_check(self, request_id: str, params) -> None:
        """Refuse what cannot run under a constraint, then compile it (ValueError / its subclass
        `StructuredOutputsError`, both 400s), unless `precompile_constraint` did. Call last in
        validation: the matcher is kept."""
        so = self._structured_prepare(params)
        if so is not None:
            self.structured.add(request_id, so)

    def precompile_constraint(self, request_id: str, params) -> None:
        """Check and compile a request's constraint before it is submitted, from any thread (the
        server's `AsyncEngine.generate` runs it in a worker thread, so the engine thread never
        waits for a grammar compile); `add_request` then takes the matcher. Raises what
        `add_request` would for the constraint (StructuredOutputsError / ValueError: 400s)."""
        so = self._structured_prepare(params)
        if so is not None:
            self.structured.precompile(request_id, so)

    def _structured_prepare(self, params):
        """The request's constraint with the server's `--structured-outputs-config` defaults
        applied (idempotent), or None; refuses combinations that cannot run (ValueError)."""
        so = params.structured_outputs
        if so is None:
            return None
        if params.ignore_eos:
            raise StructuredOutputsError("ignore_eos cannot be combined with structured outputs (the grammar ends the "
                                         "output)", "ignore_eos")
        cfg = self.structured_config
        so.disable_any_whitespace |= cfg.disable_any_whitespace
        so.disable_additional_properties |= cfg.disable_additional_properties
        if cfg.enable_in_reasoning:
            so.reasoning_end_token_id = None
        return so

    @contextlib.contextmanager
    def _structured_admission(self, request_id: str, params):
        """`_structured_check`, then the body that queues the request: when the body raises (a
        P/D parameter or a prompt the scheduler refuses), the request's matcher is dropped again,
        so a refused request leaves no grammar state behind."""
        self._structured_check(request_id, params)
        try:
            yield
        except BaseException:
            self.structured.remove(request_id)
            raise

    def _structured_masks(self, scheds) -> None:
        """Set each `SchedulerOutput.grammar_bitmask` (None where no sampled row is constrained
        and none is held back by its `min_tokens`, `serving.min_tokens`)."""
        rows = self.args.max_num_seqs + 1
        positions = self.runner.spec_k + 1
        words = -(-self._structured_vocab_size // 32)  # the backend's bitmask width
        for s in scheds:
            mask = self.structured.bitmask(s, rows, positions) if self.structured.requests else None
            s.grammar_bitmask = apply_min_tokens(s, mask, rows, positions, words, self.eos_token_ids)

    def _structured_advance(self, outs) -> None:
        """After tokens were applied: advance the matchers; drop finished requests. A token the
        grammar refuses (never expected) ends its request with finish reason "error"."""
        if not self.structured.requests:
            return
        for out in outs:
            rid = out.request_id
            if rid not in self.structured.requests:
                continue
            if out.new_token_ids and not self.structured.accept(rid, out.new_token_ids) and not out.finished:
                self.scheduler_of(rid).abort(rid, "error")
                out.finished, out.finish_reason = True, "error"
                out.error = "the structured-output grammar refused a generated token"
            if out.finished:
                self.structured.remove(rid)

    _structured_counts = (0, 0.0, 0)

    def _structured_record(self, rec) -> None:
        """Fill the `StepRecord`'s structured-output counters since the previous record."""
        m = self.structured
        now = (m.num_requests_total, m.mask_seconds_total, m.num_masked_steps)
        prev = self._structured_counts
        rec.structured_output_requests = now[0] - prev[0]
        rec.structured_output_mask_s = now[1] - prev[1] if now[2] > prev[2] else None
        self._structured_counts = now

    def scheduler_of(self, request_id: str):
        """The scheduler holding `request_id` (the engine's; a DP engine overrides it)."""
        return self.scheduler
