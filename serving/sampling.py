"""The engine's sampling maths: re-exported from `glm53.sampling`, where it lives so that the
model package's own jit-compiled generation (`glm53.api.generate_batch`) samples with the same
rules without importing the serving package."""

from glm53.sampling import (apply_token_bitmask, compute_logprobs, filter_sorted, mask_unreachable, sample_tokens,
                            sample_with_logprobs, scale_logits)

__all__ = ["apply_token_bitmask", "compute_logprobs", "filter_sorted", "mask_unreachable", "sample_tokens",
           "sample_with_logprobs", "scale_logits"]
