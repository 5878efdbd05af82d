"""glm53.api.forward_step: a fresh arena and the arena a step returns run one compiled program."""

import pytest
from flax import nnx

from glm53 import api
from glm53.batch import single_sequence_batch

# The tiny checkpoint's 7-layer twin (tests/helpers/shallow_model.py): one small step program.
pytestmark = pytest.mark.shallow_model


def test_a_fresh_arena_and_a_returned_one_share_one_compiled_step():
    """jit keys its programs on where the arguments are placed too: a fresh arena (not committed
    to a device) and the committed one a step returns would compile the same one-token step twice
    (seconds each on the CPU) unless forward_step places the fresh one as the returned one is."""
    lm = api.load()
    layout = lm.layout
    pages = {g.name: [1 + i] for i, g in enumerate(layout.groups)}
    step = api._compiled(nnx.split(lm.model)[0], layout)
    before = step._cache_size()
    arena = layout.empty_arena(1 + len(layout.groups))
    _, _, arena = api.forward_step(lm, single_sequence_batch(layout, [5], 0, pages), arena)
    _, _, arena = api.forward_step(lm, single_sequence_batch(layout, [6], 1, pages), arena)
    assert step._cache_size() == before + 1
