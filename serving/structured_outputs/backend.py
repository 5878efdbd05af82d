"""The grammar engine: llguidance over the model's own tokenizer.

Why llguidance (vLLM's `guidance` backend): a Rust library on PyPI with numpy bitmasks and no
torch (xgrammar's Python package needs torch and triton, which a JAX stack does not ship); it
compiles JSON schemas, regexes and Lark grammars lazily (no per-schema start-up cost worth
caching), and computes masks for speculative drafts natively.

`GuidanceBackend(tokenizer_json, vocab_size, eos_token_ids)` builds the `LLTokenizer` once (about
a second for GLM-5.3's 154,856 tokens; milliseconds for the tiny checkpoint's); `matcher(params)`
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
        request field when the constraint does not compile."""
        import llguidance

        grammar = params.grammar_text()
        err = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if err:
            raise StructuredOutputsError(f"invalid {params.kind().replace('_', ' ')}: {err.strip()}", params.where)
        m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise StructuredOutputsError(f"invalid {params.kind().replace('_', ' ')}: {m.get_error()}", params.where)
        return m

    def check(self, params: StructuredOutputsParams) -> None:
        """Raise StructuredOutputsError when `params` does not compile (the server's 400)."""
        self.matcher(params)

    @classmethod
    def from_model_dir(cls, model_dir, vocab_size: int, eos_token_ids) -> GuidanceBackend:
        """The backend of a checkpoint directory's `tokenizer.json`. Raises FileNotFoundError when
        the directory has none."""
        from glm53.tokenizer import GlmTokenizer

        tok = GlmTokenizer.from_pretrained(model_dir)
        return cls(tok.backend.to_str(), vocab_size, eos_token_ids)
