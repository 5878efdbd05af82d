"""The tiny default checkpoint: a complete, deterministic HF-layout GLM-5.3 twin for tests and demos.

`write_tiny_checkpoint(path)` writes `config.json` (the `tiny` preset with vocab/eos from the
tokenizer), `generation_config.json`, `tokenizer.json`, `tokenizer_config.json`,
`chat_template.jinja` and `model.safetensors` holding every tensor of
`glm53.checkpoint_keys.expected_checkpoint_shapes` with random weights. The same seed gives
byte-identical files.

The tokenizer is a byte-level BPE trained at generation time on the small corpus below, followed by
GLM's 36 added tokens in GLM's order (`<|endoftext|>` ... `<|video|>`). Role, mask and media tokens
are special (dropped by `decode(skip_special_tokens=True)`); the markup tokens that output parsers
read (`<think>`, `</think>`, `<tool_call>`, `<arg_key>`, ...) and `/nothink` are added but not
special, so they survive decoding either way.

`default_model_dir()` returns a cached copy under `$GLM53_HOME/tiny-glm-5.3` (default
`~/.cache/glm53/tiny-glm-5.3`), regenerating it when missing or stale. `config_overrides` (every
function that builds the config takes it) writes a twin of another shape with the same tokenizer
and the same per-tensor weight draws; `default_model_dir(name, config_overrides)` caches one under
its own name (the test suite's 7-layer twin: `tests/helpers/shallow_model.py`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np
import tokenizers
from safetensors.numpy import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from glm53.checkpoint_keys import expected_checkpoint_shapes
from glm53.config import TINY_HF_CONFIG, GlmConfig

# Bump when the generator's output changes for the same inputs (invalidates cached copies).
GENERATOR_VERSION = 1
CHECKPOINT_NAME = "tiny-glm-5.3"
FINGERPRINT_FILE = "glm53_tiny_fingerprint.txt"
CHAT_TEMPLATE_PATH = Path(__file__).with_name("chat_template.jinja")

# Regular (BPE) vocabulary target: 256 byte symbols + merges.
BPE_VOCAB_SIZE = 460
VOCAB_PAD_MULTIPLE = 64

# (content, special) in GLM's order; they take the ids right after the regular vocabulary.
GLM_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("[MASK]", True),
    ("[gMASK]", True),
    ("[sMASK]", True),
    ("<sop>", True),
    ("<eop>", True),
    ("<|system|>", True),
    ("<|user|>", True),
    ("<|assistant|>", True),
    ("<|observation|>", True),
    ("<|begin_of_image|>", True),
    ("<|end_of_image|>", True),
    ("<|begin_of_video|>", True),
    ("<|end_of_video|>", True),
    ("<|begin_of_audio|>", True),
    ("<|end_of_audio|>", True),
    ("<|begin_of_transcription|>", True),
    ("<|end_of_transcription|>", True),
    ("<|code_prefix|>", True),
    ("<|code_middle|>", True),
    ("<|code_suffix|>", True),
    ("<think>", False),
    ("</think>", False),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<arg_key>", False),
    ("</arg_key>", False),
    ("<arg_value>", False),
    ("</arg_value>", False),
    ("/nothink", False),
    ("<|begin_of_box|>", True),
    ("<|end_of_box|>", True),
    ("<|image|>", True),
    ("<|video|>", True),
)
EOS_TOKENS = ("<|endoftext|>", "<|user|>", "<|observation|>")
PAD_TOKEN = "<|endoftext|>"

# GLM-4/5 style pre-tokenisation split (contractions, letter runs, 1-3 digit groups, punctuation
# runs, newlines, spaces), followed by the byte-level mapping.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_CORPUS = r'''
The user asked a simple question, and the assistant answered it step by step. First, read the
question carefully. Then think about what is being asked, write down the known facts, and check
each step before giving the final answer. If the question is ambiguous, say so and explain the
assumption that was made.

User: What is the capital of France?
Assistant: The capital of France is Paris. It is also the largest city in the country.
User: How many days are there in a leap year?
Assistant: A leap year has 366 days instead of the usual 365 days.
User: Can you write a short poem about the sea?
Assistant: The sea is wide, the sea is deep, it sings the shore to sleep. The waves return
with every tide, and carry stories far and wide.
User: Please summarize the following text in one sentence.
Assistant: The text describes how a small team built a reliable service by testing every part
of the system, measuring its performance, and fixing the slowest step first.

System: You are a helpful assistant. Answer concisely and use tools when they are needed.
The weather in Paris today is sunny with a high of 24 degrees and a low of 15 degrees.
The weather in London is cloudy, with light rain in the afternoon and a high of 18 degrees.
The meeting is scheduled for Monday, March 3, 2025 at 10:30 in room 204.
Call the function get_weather with the argument city set to the name of the city.
The function returned the result below. Use it to answer the question of the user.

{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
{"role": "user", "content": "What is the weather like in Paris today?"}
{"role": "assistant", "content": "It is sunny in Paris, with a high of 24 degrees."}
{"type": "function", "function": {"name": "search", "description": "Search the web for a query.",
 "parameters": {"type": "object", "properties": {"query": {"type": "string"},
 "max_results": {"type": "integer", "minimum": 1, "maximum": 10}}, "required": ["query"]}}}
{"id": 42, "ok": true, "values": [0.5, 1.25, -3.0, 1e-5], "tags": ["alpha", "beta"], "next": null}

def fibonacci(n: int) -> list[int]:
    """Return the first n Fibonacci numbers."""
    result = [0, 1]
    while len(result) < n:
        result.append(result[-1] + result[-2])
    return result[:n]


class Counter:
    def __init__(self, start: int = 0) -> None:
        self.value = start

    def increment(self, step: int = 1) -> int:
        self.value += step
        return self.value


for i in range(10):
    if i % 2 == 0:
        print(f"{i} is even")
    else:
        print(f"{i} is odd")

import numpy as np
x = np.arange(16, dtype=np.float32).reshape(4, 4)
y = x @ x.T + 1.0
print(y.shape, y.dtype, y.sum())

function add(a, b) { return a + b; }
const items = [1, 2, 3].map((v) => v * 2);
if (items.length > 0 && items[0] !== null) { console.log("ok"); }

SELECT name, count(*) AS total FROM orders WHERE status = 'done' GROUP BY name ORDER BY total DESC;

Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 20 25 32 50 64 100 128 256 512 1000 1024 2048
4096 8192 65536 1048576 3.14159 2.71828 0.001 99.9 -1 -42 +7 1,000 10,000 1,000,000 2024 2025.
Dates and times: 2024-01-15, 2025-12-31, 09:00, 17:45:30, 12/25/2023. Prices: $5, $19.99, $1,250.
Math: 2 + 2 = 4, 3 * 7 = 21, 10 / 4 = 2.5, 2 ** 10 = 1024, sqrt(81) = 9, (a + b) * c >= d.

The model reads a sequence of tokens and predicts the next token. Each layer has an attention
block and a feed-forward block. The attention block lets every token look at the tokens before
it; the feed-forward block transforms each token on its own. A mixture of experts sends each
token to a few experts chosen by a router, so that only a small part of the network runs for
every token. Sparse attention keeps only the most relevant past tokens, which makes long
contexts affordable. The cache stores the keys of past tokens so that they are not computed
again during decoding.

Here is a list of steps:
1. Install the package with pip.
2. Download the model weights.
3. Start the server and send a request.
4. Read the response and check the result.
- First item
- Second item
- Third item

Question: If a train travels 120 kilometers in 2 hours, what is its average speed?
Answer: The average speed is 120 / 2 = 60 kilometers per hour.
Question: What is 15 percent of 80?
Answer: 15 percent of 80 is 0.15 * 80 = 12.
Question: Which number is larger, 0.7 or 0.65?
Answer: 0.7 is larger, because 0.70 is greater than 0.65.

Thank you! You are welcome. Let me know if there is anything else I can help with. Sure, here
is the information you requested. I am not sure about that, but I can try to find out. Could
you please provide more details? That is a great question. Let us think about it together.
'''


# ---------------------------------------------------------------------- tokenizer
def build_tiny_tokenizer() -> Tokenizer:
    """Train the tiny byte-level BPE tokenizer (deterministic) and append GLM's added tokens.

    Returns a `tokenizers.Tokenizer` with `BPE_VOCAB_SIZE` (or fewer) regular tokens followed by
    `GLM_ADDED_TOKENS` in order.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    lines = _CORPUS.splitlines(keepends=True)
    tok.train_from_iterator(lines, trainer=trainer, length=len(lines))
    base = tok.get_vocab_size(with_added_tokens=False)
    for k, (content, special) in enumerate(GLM_ADDED_TOKENS):
        tok.add_tokens([AddedToken(content, special=special, normalized=False)])
        if tok.token_to_id(content) != base + k:  # must follow the regular vocabulary, in order
            raise RuntimeError(f"added token {content!r} did not get id {base + k}")
    return tok


def padded_vocab_size(num_tokens: int, multiple: int = VOCAB_PAD_MULTIPLE) -> int:
    """`num_tokens` rounded up to a multiple of `multiple` (the embedding's row count)."""
    return -(-num_tokens // multiple) * multiple


# ---------------------------------------------------------------------- config files
def tiny_hf_config(tok: Tokenizer, config_overrides: dict | None = None) -> dict:
    """config.json for the tiny checkpoint: the `tiny` preset, updated with `config_overrides`
    (e.g. fewer layers), with vocab/eos/pad from `tok`."""
    eos = [tok.token_to_id(t) for t in EOS_TOKENS]
    cfg = {**TINY_HF_CONFIG, **(config_overrides or {})}
    cfg.update(
        vocab_size=padded_vocab_size(tok.get_vocab_size(with_added_tokens=True)),
        eos_token_id=eos,
        pad_token_id=tok.token_to_id(PAD_TOKEN),
    )
    return cfg


def generation_config(cfg: dict) -> dict:
    """generation_config.json for a config.json dict (eos / pad ids, the default sampling)."""
    return {
        "_from_model_config": False,
        "do_sample": True,
        "eos_token_id": list(cfg["eos_token_id"]),
        "pad_token_id": cfg["pad_token_id"],
        "temperature": 1.0,
        "top_p": 0.95,
    }


def tokenizer_config(tok: Tokenizer, cfg: dict) -> dict:
    """tokenizer_config.json for `tok` (the added tokens, eos / pad names, HF fast-tokenizer class)."""
    decoder = tok.get_added_tokens_decoder()
    return {
        "added_tokens_decoder": {
            str(i): {
                "content": t.content,
                "lstrip": t.lstrip,
                "normalized": t.normalized,
                "rstrip": t.rstrip,
                "single_word": t.single_word,
                "special": t.special,
            }
            for i, t in sorted(decoder.items())
        },
        "clean_up_tokenization_spaces": False,
        "do_lower_case": False,
        "eos_token": "<|endoftext|>",
        "pad_token": PAD_TOKEN,
        "model_max_length": cfg["max_position_embeddings"],
        "padding_side": "left",
        "remove_space": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


# ---------------------------------------------------------------------- weights
def _init_tensor(name: str, shape: tuple[int, ...], dtype: str, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    noise = rng.standard_normal(shape, dtype=np.float32)
    if name.endswith("norm.weight"):  # every RMSNorm / LayerNorm scale
        x = 1.0 + 0.05 * noise
    elif name.endswith(".bias"):  # indexer k_norm bias, router e_score_correction_bias
        x = 0.02 * noise
    elif name == "model.embed_tokens.weight":
        x = noise
    else:  # Linear [out, in]
        x = noise / np.float32(np.sqrt(shape[-1]))
    return np.ascontiguousarray(x.astype(np.float32).astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype))


def tiny_weights(config: GlmConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights for every tensor of `expected_checkpoint_shapes(config)`.

    Each tensor draws from its own generator seeded by (`seed`, crc32(name)), so values do not
    depend on the order of keys. Linear weights ~ N(0, 1/fan_in), norm scales 1 + N(0, 0.05^2),
    biases N(0, 0.02^2), embeddings N(0, 1). bfloat16 (ml_dtypes) except the fp32 router tensors.
    """
    return {
        name: _init_tensor(name, shape, dtype, seed)
        for name, (shape, dtype) in expected_checkpoint_shapes(config).items()
    }


# ---------------------------------------------------------------------- writer
def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def write_tiny_checkpoint(path: str | os.PathLike, seed: int = 0, config_overrides: dict | None = None) -> Path:
    """Write the tiny checkpoint into directory `path` (created if needed; files overwritten).

    Files: config.json, generation_config.json, tokenizer.json, tokenizer_config.json,
    chat_template.jinja, model.safetensors. Deterministic: the same `seed` and `config_overrides`
    (config.json fields replacing the `tiny` preset's, validated by `GlmConfig.from_hf_config`)
    give byte-identical files. A tensor both shapes have (same name, same shape) gets the same
    values in both. Returns `Path(path)`.
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer()
    cfg = tiny_hf_config(tok, config_overrides)
    config = GlmConfig.from_hf_config(cfg)  # validates
    assert config.vocab_size >= tok.get_vocab_size(with_added_tokens=True)

    _write_json(out / "config.json", cfg)
    _write_json(out / "generation_config.json", generation_config(cfg))
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    _write_json(out / "tokenizer_config.json", tokenizer_config(tok, cfg))
    shutil.copyfile(CHAT_TEMPLATE_PATH, out / "chat_template.jinja")
    weights = out / "model.safetensors"
    save_file(tiny_weights(config, seed), str(weights), metadata={"format": "pt"})
    os.chmod(weights, 0o644)
    return out


# ---------------------------------------------------------------------- cached default
def generator_fingerprint(seed: int = 0, config_overrides: dict | None = None) -> str:
    """Hash of everything the tiny checkpoint's bytes depend on (generator version, seed, preset
    and overrides, corpus, added tokens, chat template, tokenizers version)."""
    h = hashlib.sha256()
    for part in (
        f"v{GENERATOR_VERSION}",
        f"seed={seed}",
        json.dumps({**TINY_HF_CONFIG, **(config_overrides or {})}, sort_keys=True),
        _CORPUS,
        json.dumps(GLM_ADDED_TOKENS),
        f"bpe={BPE_VOCAB_SIZE}/{VOCAB_PAD_MULTIPLE}",
        CHAT_TEMPLATE_PATH.read_text(encoding="utf-8"),
        f"tokenizers={tokenizers.__version__}",
    ):
        h.update(part.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()


def _is_current(d: Path, fingerprint: str) -> bool:
    try:
        return (d / FINGERPRINT_FILE).read_text().strip() == fingerprint
    except OSError:
        return False


def default_model_dir(name: str = CHECKPOINT_NAME, config_overrides: dict | None = None) -> Path:
    """The tiny checkpoint's cache directory, generating it when absent or stale.

    Location: `$GLM53_HOME/<name>` when GLM53_HOME is set, else `~/.cache/glm53/<name>` (`name`
    defaults to `tiny-glm-5.3`; a twin written with `config_overrides` needs a name of its own).
    A fingerprint file records the generator inputs; on mismatch the directory is regenerated.
    Generation writes into a temporary sibling directory that is renamed into place, so
    concurrent processes never see a partial checkpoint.
    """
    root = Path(os.environ.get("GLM53_HOME") or Path.home() / ".cache" / "glm53").expanduser()
    target = root / name
    fp = generator_fingerprint(0, config_overrides)
    if _is_current(target, fp):
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
    try:
        write_tiny_checkpoint(tmp, seed=0, config_overrides=config_overrides)
        (tmp / FINGERPRINT_FILE).write_text(fp + "\n")
        for _ in range(5):
            if _is_current(target, fp):
                return target  # another process won the race
            if target.exists():  # stale: move it aside, then drop it
                stale = Path(tempfile.mkdtemp(prefix=f".{name}.stale-", dir=root))
                try:
                    os.rename(target, stale / "old")
                except OSError:
                    pass  # someone else moved it first
                shutil.rmtree(stale, ignore_errors=True)
            try:
                os.rename(tmp, target)
                return target
            except OSError:
                continue  # target reappeared (a concurrent writer); re-check it
        if _is_current(target, fp):
            return target
        raise RuntimeError(f"could not install the tiny checkpoint at {target}")
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
