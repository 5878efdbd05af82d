"""Structured outputs: JSON schemas, JSON objects, regexes, choices, grammars and forced tool
calls, enforced on the device by masking the logits of every constrained sampled position.

* `params.StructuredOutputsParams`: a request's constraint (vLLM's `structured_outputs` kinds).
* `backend.GuidanceBackend`: llguidance over the model's tokenizer (why llguidance: its docstring).
* `tool_grammar`: the glm47 tool-call grammar of `tool_choice` "required" or a named function.
* `manager.StructuredOutputManager`: the engine's matchers and each step's token bitmask, which
  the step applies before sampling and logprobs (`glm53.sampling.apply_token_bitmask`).

docs/structured_outputs.md has the request surface, the rules and the measurements.
"""

from serving.structured_outputs.backend import GuidanceBackend
from serving.structured_outputs.manager import StructuredOutputManager
from serving.structured_outputs.params import (
    StructuredOutputsError,
    StructuredOutputsParams,
)

__all__ = ["GuidanceBackend", "StructuredOutputManager", "StructuredOutputsError", "StructuredOutputsParams"]
