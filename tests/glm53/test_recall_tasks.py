"""The generated tasks of the trained tiny model (glm53/recall_tasks.py): lengths, uniqueness,
answers present in the context, loss masks over exactly the answers, and the chat template."""

import numpy as np
import pytest

from glm53 import recall_tasks as rt
from glm53.tiny_checkpoint import default_model_dir
from glm53.tokenizer import GlmTokenizer


@pytest.fixture(scope="module")
def tok():
    return GlmTokenizer.from_pretrained(default_model_dir())


@pytest.mark.parametrize("length", [64, 256, 1024])
def test_retrieval_sample_length_and_answer(tok, length):
    rng = np.random.default_rng(length)
    for _ in range(5):
        s = rt.retrieval_sample(rng, tok, length)
        assert length - 40 <= s.prompt_tokens <= length, s.prompt_tokens
        text = s.messages[0]["content"]
        key = s.meta["key"]
        assert text.endswith(f"\nWhat is {key}?")
        assert s.answer == f"{key}{s.meta['value']}" and s.meta["value"] in rt.VALUES
        assert f" {text}".count(f" {s.answer}.") == 1  # the fact, once
        keys = [w.rstrip(".").rstrip("abcdefghijklmnopqrstuvwxyz") for w in text.split() if w[:1].isdigit()
                and w.endswith(".")]
        assert len(set(keys)) == len(keys) == s.meta["num_pairs"]  # one fact per key
        assert tok.encode(tok.apply_chat_template(s.messages, enable_thinking=False))[-3:] == [
            tok.token_to_id("<|assistant|>"), tok.token_to_id("<think>"), tok.token_to_id("</think>")]


def test_keys_and_values_are_single_tokens_and_facts_two(tok):
    assert len(set(rt.VALUES)) == len(rt.VALUES) >= 90 and len(set(rt.KEYS)) == len(rt.KEYS) == 18
    for k in rt.KEYS:
        (ki,) = tok.encode(k)
        for v in rt.VALUES:
            (vi,) = tok.encode(v)
            assert tok.encode(f" {k}{v}.")[1:3] == [ki, vi] and tok.encode(rt.answer(k, v)) == [ki, vi], (k, v)


@pytest.mark.parametrize("kind", ["retrieval", "copy", "short"])
def test_training_example_masks_exactly_the_answers(tok, kind):
    ids, mask = rt.training_example(np.random.default_rng(7), tok, 512, kind)
    assert ids.shape == mask.shape == (512,)
    end = tok.token_to_id("<|user|>")
    think_end = tok.token_to_id("</think>")
    # Each masked run starts right after </think> and ends with the <|user|> that closes the turn.
    runs, start = [], None
    for t, m in enumerate(mask):
        if m and start is None:
            start = t
        if not m and start is not None:
            runs.append((start, t))
            start = None
    assert len(runs) >= 2
    for a, b in runs:
        assert ids[a - 1] == think_end and ids[b - 1] == end
    text = tok.decode(ids[mask == 0].tolist(), skip_special_tokens=False)
    assert "<|assistant|>" in text
    if kind == "retrieval":  # every answer is a value stated in the first user turn
        first = tok.decode(ids[:runs[0][0]].tolist())
        for a, b in runs:
            assert tok.decode(ids[a:b - 1].tolist()) + "." in first

