"""The grammar engine: llguidance over the model's own tokenizer.

Why llguidance (vLLM's `guidance` backend): a Rust library on PyPI with numpy bitmasks and no
torch (xgrammar's Python package needs torch and triton, which a JAX stack does not ship); it
compiles JSON schemas, regexes and Lark grammars lazily (no per-schema start-up cost worth
caching), and computes masks for speculative drafts natively.

`GuidanceBackend(tokenizer_json, vocab_size, eos_token_ids)` builds the `LLTokenizer` once (7 ms
for the tiny checkpoint's 512 ids, measured; llguidance's docs give about a second for large
vocabularies; GLM-5.3's is not measured here); `matcher(params)`
compiles one request's constraint into an `llguidance.LLMatcher`, raising
`StructuredOutputsError` (a 400) when the schema, regex or grammar is invalid.
"""

from __future__ import annotations

import functools
import logging
import time

from serving.structured_outputs.params import (
    StructuredOutputsError,
    StructuredOutputsParams,
)

logger = logging.getLogger(__name__)

# The largest compiled grammar a request may bring (llguidance's JSON form; a 2,000-property schema
# or a 20,000-way choice is far below it).
MAX_GRAMMAR_BYTES = 4 << 20


class GuidanceBackend:
    """llguidance matchers over one tokenizer.

    Args:
      tokenizer_json: the HF `tokenizers` JSON of the checkpoint's tokenizer
        (`tokenizers.Tokenizer.to_str()`).
      vocab_size: the model's logit count (the embedding's rows; ids past the tokenizer's are
        padding and never allowed). The bitmask is `ceil(vocab_size / 32)` int32 words per row.
      eos_token_ids: the ids that end a generation (the engine's EOS set): a finished grammar
        allows exactly these.
    """

    name = "guidance"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.bitmask_words = -(-self.vocab_size // 32)
        self._pool = None

    @functools.cached_property
    def tokenizer(self):
        """The `llguidance.LLTokenizer` (built on first use)."""
        import llguidance

        t0 = time.perf_counter()
        tok = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
        logger.info("structured outputs: llguidance tokenizer of %d ids ready in %.2f s", self.vocab_size,
                    time.perf_counter() - t0)
        return tok

    def matcher(self, params: StructuredOutputsParams):
        """A fresh `llguidance.LLMatcher` for `params`. Raises StructuredOutputsError naming the
        request field when the constraint does not compile, is larger than `MAX_GRAMMAR_BYTES`,
        or admits no output at all (its first mask allows nothing but the end of the output,
        which does not match).

        Compilation runs on a thread of its own with a 256 MiB stack: llguidance's grammar
        checks recurse per nested rule, and a few thousand chained rules overflow a default
        8 MiB thread stack (a segfault of the whole server, measured at 3,000 rules; 20,000
        compile in 0.6 s on the large stack)."""
        import llguidance
        import llguidance.numpy as lnp
        import numpy as np

        grammar = params.grammar_text()
        kind = params.kind().replace("_", " ")
        if len(grammar) > MAX_GRAMMAR_BYTES:
            raise StructuredOutputsError(f"the {kind} compiles to {len(grammar)} bytes of grammar, more than the "
                                         f"{MAX_GRAMMAR_BYTES} this server accepts", params.where)

        def build():
            err = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
            if err:
                return err.strip()
            m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            return m.get_error() if m.is_error() else m

        m = self._compiler().submit(build).result()
        if isinstance(m, str):
            raise StructuredOutputsError(f"invalid {kind}: {m}", params.where)
        mask = np.zeros((1, self.bitmask_words), np.int32)
        lnp.fill_next_token_bitmask(m, mask, 0)
        allowed = np.flatnonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little"))
        if not set(allowed.tolist()) - set(self.eos_token_ids) and not m.is_accepting():
            raise StructuredOutputsError(f"the {kind} admits no output", params.where)
        return m

    def _compiler(self):
        """The single compile thread (created on first use with a 256 MiB stack)."""
        if self._pool is None:
            import concurrent.futures
            import threading

            old = threading.stack_size(256 << 20)
            try:
                self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
                self._pool.submit(lambda: None).result()  # the thread starts now, with that stack
            finally:
                threading.stack_size(old)
        return self._pool

    @classmethod
    def from_model_dir(cls, model_dir, vocab_size: int, eos_token_ids) -> GuidanceBackend:
        """The backend of a checkpoint directory's `tokenizer.json`. Raises FileNotFoundError when
        the directory has none."""
        from glm53.tokenizer import GlmTokenizer

        tok = GlmTokenizer.from_pretrained(model_dir)
        return cls(tok.backend.to_str(), vocab_size, eos_token_ids)
