"""Multi-turn conversations driven straight through an `LLMEngine` (the agentic workload's shape,
docs/design.md §9, at test sizes): each conversation's turn t+1 prompt is turn t's prompt, its greedy
output and `new_tokens` fresh user tokens; conversations run concurrently, each turn submitted when
the previous one finished. Deterministic content, `ignore_eos`."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from serving.types import SamplingParams


@dataclass
class ConversationRun:
    """Per (conversation, turn): the prompt, the output tokens and their logprobs; and the
    engine's running-request count after every step."""

    prompts: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)
    logprobs: dict = field(default_factory=dict)
    running: list = field(default_factory=list)
    steps: int = 0


def user_tokens(conv: int, turn: int, n: int, vocab: int = 490) -> list[int]:
    rng = np.random.default_rng(1000 * conv + turn)
    return rng.integers(10, vocab, n).tolist()


def run_conversations(engine, *, conversations: int, turns: int, first_tokens: int, new_tokens: int,
                      max_tokens: int, logprobs: int | None = None, audit: bool = True,
                      max_steps: int = 100_000, on_step=None) -> ConversationRun:
    """Drive the conversations to the end (see the module docstring); `audit()` after every step,
    then `on_step(engine, step_index)` when given (a check that must hold between steps)."""
    run = ConversationRun()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    turn_of = {}

    def submit(c, t):
        prev = run.prompts.get((c, t - 1))
        prompt = (user_tokens(c, 0, first_tokens) if prev is None
                  else prev + run.outputs[(c, t - 1)] + user_tokens(c, t, new_tokens))
        rid = f"c{c}t{t}"
        run.prompts[(c, t)] = prompt
        run.outputs[(c, t)] = []
        run.logprobs[(c, t)] = []
        turn_of[rid] = (c, t)
        engine.add_request(rid, prompt, params)

    for c in range(conversations):
        submit(c, 0)
    while engine.has_unfinished_requests():
        assert run.steps < max_steps, "conversations did not finish"
        for out in engine.step():
            key = turn_of[out.request_id]
            run.outputs[key].extend(out.new_token_ids)
            if logprobs is not None:
                run.logprobs[key].extend(out.new_logprobs or [])
            if out.finished and key[1] + 1 < turns:
                submit(key[0], key[1] + 1)
        run.steps += 1
        run.running.append(int(engine.gauges.num_requests_running()))
        if audit:
            assert engine.audit() == [], engine.audit()
        if on_step is not None:
            on_step(engine, run.steps)
    return run
