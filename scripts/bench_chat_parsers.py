"""Host cost of chat output parsing: microseconds per streamed token delta.

Builds a long GLM-format turn (reasoning, `</think>`, content, several `<tool_call>` blocks),
tokenises it with the tiny checkpoint's tokenizer, and times `ChatOutput.deltas` fed one token's
text at a time (as the server does), for: no parsers (the raw pass-through), the reasoning parser
alone, and reasoning + tool calls. Also times the non-streamed `ChatOutput.message` on the whole
text. Prints a table; `--out FILE` also writes the numbers as JSON.

    PYTHONPATH=. python scripts/bench_chat_parsers.py [--repeats 5] [--out /tmp/parsers.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from glm53.tiny_checkpoint import build_tiny_tokenizer  # noqa: E402
from serving.api.chat_output import ChatParsing  # noqa: E402
from serving.api.protocol import ChatCompletionRequest  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]


def make_turn(n_calls: int = 8) -> str:
    reasoning = "Let us think about what is being asked and check the known facts. " * 40
    content = "Here is the information you requested, one city at a time. " * 10
    calls = "".join(
        f"<tool_call>get_weather<arg_key>city</arg_key><arg_value>City number {i}</arg_value>"
        f"<arg_key>days</arg_key><arg_value>{i}</arg_value></tool_call>"
        for i in range(n_calls)
    )
    return reasoning + "</think>" + content + calls


def _body(parsing: ChatParsing) -> ChatCompletionRequest:
    tools = TOOLS if parsing.enable_auto_tool_choice else None
    return ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=tools)


def time_stream(parsing: ChatParsing, pieces: list[str], repeats: int) -> float:
    body = _body(parsing)
    best = float("inf")
    for _ in range(repeats):
        out = parsing.prepare(body).new_output("<|assistant|><think>")
        t0 = time.perf_counter()
        for p in pieces[:-1]:
            out.deltas(p)
        out.deltas(pieces[-1], "stop")
        best = min(best, time.perf_counter() - t0)
    return best


def time_message(parsing: ChatParsing, text: str, repeats: int) -> float:
    body = _body(parsing)
    best = float("inf")
    for _ in range(repeats):
        out = parsing.prepare(body).new_output("<|assistant|><think>")
        t0 = time.perf_counter()
        out.message(text, "stop")
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="best of N runs")
    ap.add_argument("--out", default=None, help="write the numbers as JSON here")
    args = ap.parse_args()

    tok = build_tiny_tokenizer()
    text = make_turn()
    ids = tok.encode(text, add_special_tokens=False).ids
    pieces = [tok.decode([i], skip_special_tokens=False) for i in ids]
    assert "".join(pieces) == text
    configs = {
        "raw (no parsers)": ChatParsing(),
        "reasoning glm45": ChatParsing(reasoning_parser="glm45"),
        "reasoning + tools glm47": ChatParsing("glm45", "glm47", True),
    }
    rows = []
    print(f"turn: {len(text)} characters, {len(ids)} token deltas; best of {args.repeats}")
    print(f"{'parsers':<26}{'stream us/delta':>16}{'message ms':>12}")
    for name, parsing in configs.items():
        per_delta_us = time_stream(parsing, pieces, args.repeats) / len(pieces) * 1e6
        message_ms = time_message(parsing, text, args.repeats) * 1e3
        rows.append({"parsers": name, "stream_us_per_delta": per_delta_us, "message_ms": message_ms})
        print(f"{name:<26}{per_delta_us:>16.1f}{message_ms:>12.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"chars": len(text), "deltas": len(ids), "rows": rows}, f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
