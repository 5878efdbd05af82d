"""GlmTokenizer on the tiny checkpoint: round trips, special tokens by name, streaming decode."""

import json
import shutil
import time

import pytest

from glm53.config import GlmConfig
from glm53.tiny_checkpoint import GLM_ADDED_TOKENS, write_tiny_checkpoint
from glm53.tokenizer import REPLACEMENT_CHAR, GlmTokenizer, IncrementalDetokenizer, eos_token_ids

MULTIBYTE = "Café naïve — 你好, мир! 😀🚀 ok"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tok(ckpt):
    return GlmTokenizer.from_pretrained(ckpt)


@pytest.mark.parametrize(
    "text",
    [
        "Hello world, what is the weather in Paris today?",
        'def f(x):\n    return {"a": [1, 2, 3]}\n',
        "   leading and trailing spaces   \n\n",
        MULTIBYTE,
        "",
    ],
)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == text


def test_encode_matches_backend_and_releases_the_gil(tok):
    import threading

    texts = [MULTIBYTE, "<|user|>hi<|assistant|><think>x</think>", "a b " * 50]
    for text in texts:  # the same ids as the backend's single-text call
        assert tok.encode(text) == tok.backend.encode(text, add_special_tokens=False).ids
    # While a long text is tokenised in another thread this one keeps running (it used to be
    # frozen: the backend's single-text call held the GIL throughout).
    # Each wake-up of this thread needs the GIL: with it held by the worker for the whole call
    # this loop gets a handful of iterations, with it released one per millisecond or so.
    long_text = "a b " * 300_000
    worker = threading.Thread(target=tok.encode, args=(long_text,))
    worker.start()
    wakeups = 0
    while worker.is_alive():
        wakeups += 1
        time.sleep(0.001)
    worker.join()
    assert wakeups > 50


def test_encode_adds_no_special_tokens(tok):
    ids = tok.encode("hi")
    assert not set(ids) & tok.all_special_ids
    assert tok.decode(ids) == "hi"


def test_special_tokens_by_name(tok):
    base = tok.backend.get_vocab_size(with_added_tokens=False)
    for k, (name, special) in enumerate(GLM_ADDED_TOKENS):
        i = tok.token_to_id(name)
        assert i == base + k  # GLM's order, right after the regular vocabulary
        assert tok.encode(name) == [i]
        wrapped = tok.encode(f"x {name} y")
        assert wrapped.count(i) == 1 and tok.decode(wrapped) == f"x {name} y"
        assert (i in tok.all_special_ids) == special
    assert tok.vocab_size == base + len(GLM_ADDED_TOKENS)
    with pytest.raises(KeyError, match="<nope>"):
        tok.token_to_id("<nope>")
    assert tok.maybe_token_id("<nope>") is None


def test_skip_special_tokens_keeps_markup(tok):
    ids = tok.encode("<|user|>hi<|assistant|><think>r</think>a<tool_call>f</tool_call>")
    assert tok.decode(ids, skip_special_tokens=True) == "hi<think>r</think>a<tool_call>f</tool_call>"
    assert tok.decode(ids) == "<|user|>hi<|assistant|><think>r</think>a<tool_call>f</tool_call>"


def test_eos_and_pad(tok, ckpt):
    cfg = GlmConfig.from_pretrained(ckpt)
    names = ("<|endoftext|>", "<|user|>", "<|observation|>")
    want = tuple(tok.token_to_id(n) for n in names)
    assert cfg.eos_token_id == want
    assert tok.eos_token_ids(cfg) == want
    assert eos_token_ids(None, ckpt) == want
    assert tok.eos_token_id == tok.token_to_id("<|endoftext|>")
    assert tok.pad_token_id == tok.token_to_id("<|endoftext|>")


def test_eos_union_with_generation_config(tmp_path, ckpt):
    d = tmp_path / "ck"
    shutil.copytree(ckpt, d)
    tok = GlmTokenizer.from_pretrained(d)
    extra = tok.token_to_id("<eop>")
    gen = json.loads((d / "generation_config.json").read_text())
    gen["eos_token_id"] = [extra, tok.token_to_id("<|user|>")]
    (d / "generation_config.json").write_text(json.dumps(gen))
    cfg = GlmConfig.from_pretrained(d)
    assert tok.eos_token_ids(cfg) == (*cfg.eos_token_id, extra)
    assert eos_token_ids({"eos_token_id": 5}, d) == (5, extra, tok.token_to_id("<|user|>"))


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        GlmTokenizer.from_pretrained(tmp_path)


def _has_split_character(tok, ids):
    return any(tok.decode(ids[:k]).endswith(REPLACEMENT_CHAR) for k in range(1, len(ids)))


@pytest.mark.parametrize("skip", [False, True])
def test_incremental_detokenizer_matches_full_decode(tok, skip):
    text = "<think>" + MULTIBYTE + "</think><|user|>" + MULTIBYTE
    ids = tok.encode(text)
    assert _has_split_character(tok, ids)  # the test really crosses split characters
    det = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    deltas = [det.add([i]) for i in ids]
    deltas.append(det.flush())
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip) == det.text


def test_incremental_detokenizer_chunks(tok):
    ids = tok.encode(MULTIBYTE * 3)
    det = tok.incremental_detokenizer()
    out = "".join(det.add(ids[k : k + 3]) for k in range(0, len(ids), 3)) + det.flush()
    assert out == MULTIBYTE * 3


def test_decode_delta_matches_full_decode(tok):
    ids = tok.encode(MULTIBYTE)
    emitted = ""
    for k in range(1, len(ids) + 1):
        d = tok.decode_delta(ids[:k], emitted)
        assert REPLACEMENT_CHAR not in d
        emitted += d
    assert emitted == MULTIBYTE


def test_flush_emits_incomplete_tail(tok):
    ids = tok.encode("😀")
    assert len(ids) > 1
    det = tok.incremental_detokenizer()
    assert det.add(ids[:-1]) == ""
    assert det.flush() == tok.decode(ids[:-1])


@pytest.mark.parametrize("text", ["héllo wörld 你好 🙂", "<|user|>x<think>y</think>"])
def test_token_bytes_join_to_the_utf8_text(tok, text):
    """Raw token bytes (logprobs `bytes`) concatenate to the text's UTF-8, including tokens that
    hold only part of a multi-byte character (whose own decode is U+FFFD)."""
    ids = tok.encode(text)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")
    partial = [i for i in ids if tok.decode([i]) == "\ufffd"]
    assert bool(partial) == (not text.isascii()), "precondition: only the non-ASCII text splits characters"
    for i in partial:
        assert tok.token_bytes(i) != "\ufffd".encode("utf-8")
