"""The shipped trained checkpoint (`--model tiny-recall`) answers held-out retrieval questions through
the server and the `openai` client, and Hybrid HiSparse on a device pool far too small for the
contexts gives the same answers.

The independent result is the task itself: each expected answer is the value the generated
context states for the asked key (glm53/recall_tasks.py), not anything the model computed."""

import concurrent.futures as cf

import numpy as np
import openai
import pytest

from glm53 import recall_tasks
from glm53.hub import resolve_model
from glm53.tokenizer import GlmTokenizer
from serving.engine import LLMEngine
from serving.llm import LLM
from serving.run import build_server
from serving.structured_outputs import StructuredOutputsParams
from serving.types import SamplingParams
from tests.helpers.live_server import live_server

# One engine shape for both tests: prompts of 8 × index_topk (≈ 512 tokens), 4 at a time.
COMMON = dict(max_model_len=640, max_num_seqs=4, max_num_batched_tokens=256)
HISPARSE_PAGES = 9  # 8 usable pages: not even ONE request (8 MLA + 1 indexer page) fits whole
NUM_SAMPLES = 6


@pytest.fixture(scope="module")
def samples():
    path = resolve_model("tiny-recall")
    tok = GlmTokenizer.from_pretrained(path)
    rng = np.random.default_rng(recall_tasks.EVAL_SEED_BASE + 4242)
    return [recall_tasks.retrieval_sample(rng, tok, 8 * 64) for _ in range(NUM_SAMPLES)]


@pytest.fixture(scope="module")
def server_answers(samples):
    """[(answer text, finish_reason, answer constrained to the samples' answers)] of the samples
    through the server and the openai client (4 concurrent chat completions, greedy, thinking off)."""
    argv = ["--model", "tiny-recall", "--max-model-len", str(COMMON["max_model_len"]), "--max-num-seqs", "4",
            "--max-num-batched-tokens", str(COMMON["max_num_batched_tokens"]), "--cuda-graph-sizes",
            "--kv-cache-dtype", "bfloat16", "--log-level", "warning"]
    app, args, engine = build_server(argv)
    try:
        with live_server(app) as base:
            client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)
            assert [m.id for m in client.models.list().data] == ["tiny-recall"]

            choices = sorted({s.answer for s in samples})

            def ask(s):
                r = client.chat.completions.create(model="tiny-recall", messages=s.messages, max_tokens=8,
                                                   temperature=0, extra_body={"chat_template_kwargs": {
                                                       "enable_thinking": False}})
                # The same question constrained to the samples' answers (structured outputs).
                c = client.chat.completions.create(model="tiny-recall", messages=s.messages, max_tokens=8,
                                                   temperature=0, extra_body={"chat_template_kwargs": {
                                                       "enable_thinking": False}, "structured_outputs": {
                                                       "choice": choices}})
                return r.choices[0].message.content.strip(), r.choices[0].finish_reason, c.choices[0].message.content

            with cf.ThreadPoolExecutor(4) as ex:
                got = list(ex.map(ask, samples))
    finally:
        engine.shutdown()
    return got


def test_server_answers_retrieval_questions(samples, server_answers):
    right = [g[0] == s.answer for g, s in zip(server_answers, samples)]
    # The checkpoint's measured accuracy at this length is in docs/tiny_recall.md (≥ 90 %).
    assert sum(right) >= len(samples) - 1, (server_answers, [s.answer for s in samples])
    # A right answer ends with the model's own end-of-turn token (an EOS id), not the length limit.
    assert all(g[1] == "stop" for g, r in zip(server_answers, right) if r)


def test_an_answer_constrained_to_the_candidates_is_the_free_answer(samples, server_answers):
    """`structured_outputs.choice` over the samples' answers on the trained model: greedy under the
    mask equals the unconstrained greedy answer wherever that one is a candidate (its tokens are
    allowed at every step, so they stay the argmax), and every constrained answer is a candidate."""
    choices = {s.answer for s in samples}
    assert all(g[2] in choices for g in server_answers)
    assert all(g[2] == g[0] for g in server_answers if g[0] in choices)
    assert sum(g[2] == s.answer for g, s in zip(server_answers, samples)) >= len(samples) - 1


def test_hisparse_with_a_tiny_pool_gives_the_same_answers(samples, server_answers):
    llm = LLM("tiny-recall", dtype="float32", kv_cache_dtype="bfloat16", cuda_graph_sizes=[], compile_progress=False,
              num_gpu_blocks_override=HISPARSE_PAGES, enable_prefix_caching=True, **COMMON,
              attention_config={"hisparse_config": {"host_pool_gib": 0.02, "prefill_buffer_size": 128}})
    engine: LLMEngine = llm.engine
    outs = llm.chat([s.messages for s in samples], SamplingParams(temperature=0, max_tokens=8),
                    chat_template_kwargs={"enable_thinking": False})
    assert [o.outputs[0].text.strip() for o in outs] == [g[0] for g in server_answers]
    assert engine.runner.num_hot_steps > 0 and engine.hisparse.device.misses > 0  # rows came from the host pool
    # Structured outputs through the hot program too: the constrained answers are the server's.
    hot_steps = engine.runner.num_hot_steps
    choice = StructuredOutputsParams(choice=sorted({s.answer for s in samples}))
    outs = llm.chat([s.messages for s in samples], SamplingParams(temperature=0, max_tokens=8, structured_outputs=choice),
                    chat_template_kwargs={"enable_thinking": False})
    assert [o.outputs[0].text for o in outs] == [g[2] for g in server_answers]
    assert engine.runner.num_hot_steps > hot_steps
    assert engine.hisparse.device.drops_outside_truncation == 0
    assert engine.scheduler.num_preemptions_total == 0  # nobody was preempted for lack of pages
    assert engine.audit() == []
    assert engine.pool.num_free == engine.pool.num_usable_blocks
