"""Generated tasks for the trained tiny checkpoint (`tiny-recall`): long-context retrieval, span
copying and short answers, in the GLM chat format.

* Retrieval: facts ` 7ing.` — a key (one of 18 numbers that are one token each, `KEYS`) directly
  followed by its value (a letter string that is one token, `VALUES`), so the key is the value's
  preceding token — scattered between filler sentences (lowercase words, no digits), then
  `What is 7?`; the answer restates the fact, `7ing` (exact match). Keys and values are unique
  within a context, so at most 18 facts per context.
* Copy: `Repeat: w1 w2 …` → `w1 w2 …` (words, letters and numbers); used for MTP acceptance.
* Short answers: `What is 3+4?` → `7`, `Which is larger, 12 or 45?` → `45`.

Conversations render through the checkpoint's chat template with `enable_thinking=False`
(`…<|user|>Q<|assistant|><think></think>A<|user|>…`), so training sees exactly the token
sequences the server builds. `training_example` packs several question/answer turns about one
context (the later turns' answers depend on the first turn's context too) and returns the loss
mask over answer tokens and the `<|user|>` that ends each answer (an EOS token of the checkpoint).

Everything is deterministic given a `numpy.random.Generator`; evaluation draws from seeds the
training script never uses (`EVAL_SEED_BASE`).
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field

import numpy as np

# Keys: numbers the tiny tokenizer encodes as one token (the digits and eight merged pairs); the
# pre-tokenizer splits digits from letters, so `7ing` is always the two tokens `7`, `ing`.
KEYS = tuple("0 1 2 3 4 5 6 7 8 9 00 10 12 15 20 25 65 80".split())
FILLER_WORDS = tuple("""
the model reads every token and then predicts what comes next while each layer keeps its own
cache of keys so that decoding stays fast sparse attention looks only at the most relevant past
tokens which makes long contexts affordable a router sends each token to a few experts chosen
from many small networks the server answers requests in batches and streams the words back to
the user who asked a question about the weather in paris or london today this story has a long
middle part with nothing to remember except the few values that matter later on please note
how quiet the river is near the old bridge where people walk their dogs every morning
""".split())
# Values: letter strings that the tiny tokenizer encodes as ONE token, alone and after a key
# (checked in tests/glm53/test_recall_tasks.py).
VALUES = tuple("""
he re er st on nt ar at in de it ion ou en me al le ue lo or se su an te ing es ts ep et pe ac ce
ist ken lt un ay ant ed ss sult for sw ser tion um ur ver ith istant ssistant ap ame ck ge gre ig
ow ri ty her ers swer urn type ad ch con ction ir lf ls ore qu ro turn xt art aris ather out tent
unction igh as ain bout em ext im ide ly ul val ity all low lock ach very irst
""".split())
COPY_ALPHABET = tuple(string.ascii_lowercase)
EVAL_SEED_BASE = 1_000_000  # evaluation samples use seeds >= this; training uses smaller ones
END_OF_ANSWER = "<|user|>"  # GLM ends an assistant turn with the next role token (an EOS id)


@dataclass
class Sample:
    """One single-turn evaluation sample: `messages` (OpenAI chat format), the exact expected
    answer text, the task kind and the prompt length in tokens (0 when not computed)."""

    kind: str
    messages: list[dict]
    answer: str
    prompt_tokens: int = 0
    meta: dict = field(default_factory=dict)


def _sentence(rng: np.random.Generator) -> str:
    n = int(rng.integers(4, 11))
    return " " + " ".join(FILLER_WORDS[i] for i in rng.integers(0, len(FILLER_WORDS), n)) + "."


def _ntok(tok, text: str) -> int:
    return len(tok.encode(text))


def retrieval_context(rng: np.random.Generator, tok, context_tokens: int, *, n_pairs: int | None = None,
                      tokens_per_pair: int = 32, question_tokens: int = 8) -> tuple[str, dict[str, str]]:
    """Filler sentences with `n_pairs` ` 7ing.` facts at random places, sized so that the first
    prompt (template prefix + context + a question) is about `context_tokens` tokens.

    → (context text, {key: value} in order of appearance). Default `n_pairs`: one per
    `tokens_per_pair` tokens, between 2 and len(KEYS)."""
    prefix = _ntok(tok, tok.apply_chat_template([{"role": "user", "content": "x"}], enable_thinking=False)) - 1
    budget = max(context_tokens - prefix - question_tokens, 16)
    if n_pairs is None:
        n_pairs = int(np.clip(budget // tokens_per_pair, 2, len(KEYS)))
    keys = [KEYS[i] for i in rng.permutation(len(KEYS))[:n_pairs]]
    pairs = [(k, VALUES[i]) for k, i in zip(keys, rng.permutation(len(VALUES)))]
    facts = [f" {k}{v}." for k, v in pairs]
    fact_tokens = sum(_ntok(tok, f) for f in facts)
    filler: list[str] = []
    used = fact_tokens
    while True:
        s = _sentence(rng)
        n = _ntok(tok, s)
        if used + n > budget:
            break
        filler.append(s)
        used += n
    # Facts go into random gaps between filler sentences (several facts may share a gap).
    slots = np.sort(rng.integers(0, len(filler) + 1, n_pairs))
    parts: list[str] = []
    fi = 0
    for gap in range(len(filler) + 1):
        while fi < n_pairs and slots[fi] == gap:
            parts.append(facts[fi])
            fi += 1
        if gap < len(filler):
            parts.append(filler[gap])
    return "".join(parts).lstrip(), dict(pairs)


def question(key: str) -> str:
    return f"What is {key}?"


def answer(key: str, value: str) -> str:
    return f"{key}{value}"


def retrieval_sample(rng: np.random.Generator, tok, context_tokens: int) -> Sample:
    """A single-turn retrieval sample whose prompt is about `context_tokens` tokens long; the
    asked key is uniform over the facts (so over positions in the context)."""
    ctx, pairs = retrieval_context(rng, tok, context_tokens)
    keys = list(pairs)
    key = keys[int(rng.integers(0, len(keys)))]
    msgs = [{"role": "user", "content": f"{ctx}\n{question(key)}"}]
    n = _ntok(tok, tok.apply_chat_template(msgs, enable_thinking=False))
    return Sample("retrieval", msgs, answer(key, pairs[key]), n,
                  {"key": key, "value": pairs[key], "key_index": keys.index(key), "num_pairs": len(keys)})


def copy_span(rng: np.random.Generator, n_items: int) -> str:
    items = []
    for _ in range(n_items):
        r = rng.random()
        if r < 0.6:
            items.append(FILLER_WORDS[int(rng.integers(0, len(FILLER_WORDS)))])
        elif r < 0.8:
            items.append(str(int(rng.integers(0, 1000))))
        else:
            items.append("".join(COPY_ALPHABET[i] for i in rng.integers(0, 26, int(rng.integers(2, 5)))))
    return " ".join(items)


def copy_sample(rng: np.random.Generator, tok, n_items: int | None = None) -> Sample:
    span = copy_span(rng, int(rng.integers(6, 17)) if n_items is None else n_items)
    msgs = [{"role": "user", "content": f"Repeat: {span}"}]
    return Sample("copy", msgs, span, _ntok(tok, tok.apply_chat_template(msgs, enable_thinking=False)))


def short_qa(rng: np.random.Generator) -> tuple[str, str]:
    if rng.random() < 0.5:
        a, b = (int(x) for x in rng.integers(0, 10, 2))
        return f"What is {a}+{b}?", str(a + b)
    a, b = (int(x) for x in rng.choice(90, 2, replace=False) + 10)
    return f"Which is larger, {a} or {b}?", str(max(a, b))


def short_sample(rng: np.random.Generator, tok) -> Sample:
    q, a = short_qa(rng)
    msgs = [{"role": "user", "content": q}]
    return Sample("short", msgs, a, _ntok(tok, tok.apply_chat_template(msgs, enable_thinking=False)))


# ---------------------------------------------------------------------- training sequences
def _append_turn(tok, msgs: list[dict], ids: list[int], mask: list[int], user: str, answer: str) -> None:
    """Extend (ids, mask) by one user turn and its answer (mask 1 on the answer tokens and the
    `<|user|>` that closes them), rendering through the chat template."""
    msgs.append({"role": "user", "content": user})
    prompt = tok.encode(tok.apply_chat_template(msgs, enable_thinking=False))
    if prompt[:len(ids)] != ids:
        raise RuntimeError("the chat template did not extend the previous turns token for token")
    new = prompt[len(ids):]
    ans = tok.encode(answer) + [tok.token_to_id(END_OF_ANSWER)]
    ids += new + ans
    mask += [0] * len(new) + [1] * len(ans)
    msgs.append({"role": "assistant", "content": answer})


def training_example(rng: np.random.Generator, tok, length: int, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """One training sequence of at most `length` tokens → (ids int32 `[length]`, mask float32
    `[length]`), padded with the checkpoint's pad id (mask 0).

    kind "retrieval": a context filling about 55 % of `length` with a denser set of facts than
    the evaluation samples (one per 12 tokens: more questions per sequence), then as many
    `What is 7?` turns (all keys, random order) as fit; "copy" / "short": independent turns
    packed until `length`."""
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    if kind == "retrieval":
        ctx, pairs = retrieval_context(rng, tok, int(length * 0.55), tokens_per_pair=12)
        keys = [list(pairs)[i] for i in rng.permutation(len(pairs))]
        turns = [(f"{ctx}\n{question(keys[0])}", answer(keys[0], pairs[keys[0]]))]
        turns += [(question(k), answer(k, pairs[k])) for k in keys[1:]]
    elif kind == "copy":
        turns = []
        for _ in range(64):
            s = copy_span(rng, int(rng.integers(4, 17)))
            turns.append((f"Repeat: {s}", s))
    elif kind == "short":
        turns = [short_qa(rng) for _ in range(64)]
    else:
        raise ValueError(f"unknown task kind {kind!r}")
    msgs: list[dict] = []
    ids: list[int] = []
    mask: list[int] = []
    for user, reply in turns:
        before = (len(msgs), len(ids))
        _append_turn(tok, msgs, ids, mask, user, reply)
        if len(ids) > length:
            del msgs[before[0]:], ids[before[1]:], mask[before[1]:]
            break
    out_ids = np.full(length, pad, np.int32)
    out_mask = np.zeros(length, np.float32)
    out_ids[:len(ids)] = ids
    out_mask[:len(mask)] = mask
    return out_ids, out_mask
