"""The GLM-5.3-format chat template (glm53/chat_template.jinja) against docs/design.md §3.8's rules."""

import json

import jinja2
import pytest

from glm53.tiny_checkpoint import write_tiny_checkpoint
from glm53.tokenizer import GlmTokenizer

HEAD = "[gMASK]<sop><|system|>Reasoning Effort: "

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]


def tools_block(tools):
    schemas = "".join(json.dumps(t["function"], ensure_ascii=False) + "\n" for t in tools)
    return (
        "<|system|>\n# Tools\n\nYou can call the functions below to help with the request. "
        "Their JSON schemas are listed inside <tools></tools>:\n<tools>\n"
        + schemas
        + "</tools>\n\nTo call a function, write its name followed by each argument (string values "
        "verbatim, other values as JSON) in this form:\n<tool_call>{function-name}<arg_key>{arg-key-1}"
        "</arg_key><arg_value>{arg-value-1}</arg_value><arg_key>{arg-key-2}</arg_key><arg_value>"
        "{arg-value-2}</arg_value>...</tool_call>"
    )


def call(name, args):
    body = "".join(
        f"<arg_key>{k}</arg_key><arg_value>{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}</arg_value>"
        for k, v in args.items()
    )
    return f"<tool_call>{name}{body}</tool_call>"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return GlmTokenizer.from_pretrained(write_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))


def test_full_conversation(tok):
    args1 = {"city": "Paris", "days": 2, "units": {"temp": "C"}}
    args2 = {"city": "Zürich"}
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris and Zürich?"},
        {
            "role": "assistant",
            "reasoning_content": "I should call the tool twice.",
            "content": "Let me check.",
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(args1)}},
                {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": args2}},
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "sunny, 24C"},
        {"role": "tool", "tool_call_id": "b", "content": "snow, -2C"},
    ]
    want = (
        HEAD
        + "Max"
        + tools_block(TOOLS)
        + "<|system|>You are terse."
        + "<|user|>Weather in Paris and Zürich?"
        + "<|assistant|><think>I should call the tool twice.</think>Let me check."
        + call("get_weather", args1)
        + call("get_weather", args2)
        + "<|observation|><tool_response>sunny, 24C</tool_response><tool_response>snow, -2C</tool_response>"
        + "<|assistant|><think>"
    )
    got = tok.apply_chat_template(messages, tools=TOOLS)
    assert got == want
    # Every marker is one token, looked up by name.
    ids = tok.encode(got)
    for name in ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
                 "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
                 "</tool_response>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"):
        assert tok.token_to_id(name) in ids
    assert ids[:2] == [tok.token_to_id("[gMASK]"), tok.token_to_id("<sop>")]
    assert ids[-2:] == [tok.token_to_id("<|assistant|>"), tok.token_to_id("<think>")]
    assert tok.decode(ids) == got


@pytest.mark.parametrize(
    "effort, level",
    [(None, "Max"), ("low", "Low"), ("LOW", "Low"), ("high", "High"), (" High ", "High"),
     ("medium", "High"), ("minimal", "Low"), ("max", "Max"), ("xhigh", "Max")],
)
def test_reasoning_effort(tok, effort, level):
    kw = {} if effort is None else {"reasoning_effort": effort}
    got = tok.apply_chat_template([{"role": "user", "content": "hi"}], **kw)
    assert got == HEAD + level + "<|user|>hi<|assistant|><think>"


def test_content_parts_and_history_without_reasoning(tok):
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "there."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Hi!"}]},
        {"role": "user", "content": "Bye"},
    ]
    got = tok.apply_chat_template(messages)
    assert got == HEAD + "Max<|user|>Hello, there.<|assistant|><think></think>Hi!<|user|>Bye<|assistant|><think>"


def test_no_generation_prompt_and_think_in_content(tok):
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>easy</think>4"},
    ]
    got = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert got == HEAD + "Max<|user|>2+2?<|assistant|><think>easy</think>4"


def test_enable_thinking_false(tok):
    got = tok.apply_chat_template([{"role": "user", "content": "hi"}], enable_thinking=False)
    assert got.endswith("<|user|>hi<|assistant|><think></think>")


def test_clear_thinking_drops_old_reasoning(tok):
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "reasoning_content": "r1", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    kept = tok.apply_chat_template(messages)
    cleared = tok.apply_chat_template(messages, clear_thinking=True)
    assert "<|assistant|><think>r1</think>b" in kept
    assert "<|assistant|><think></think>b" in cleared


def test_observation_groups_split_by_assistant(tok):
    messages = [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
        {"role": "tool", "content": "r1"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "content": "r2"},
    ]
    got = tok.apply_chat_template(messages)
    assert got == (
        HEAD + "Max<|user|>u<|assistant|><think></think><tool_call>f</tool_call>"
        "<|observation|><tool_response>r1</tool_response>"
        "<|assistant|><think></think><tool_call>g</tool_call>"
        "<|observation|><tool_response>r2</tool_response><|assistant|><think>"
    )


def test_errors(tok):
    bad_args = [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}]
    with pytest.raises(ValueError, match="JSON object"):
        tok.apply_chat_template(bad_args)
    with pytest.raises(jinja2.TemplateError, match="role"):
        tok.apply_chat_template([{"role": "wizard", "content": "x"}])
    with pytest.raises(jinja2.TemplateError, match="image"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    no_template = GlmTokenizer(tok.backend)
    with pytest.raises(ValueError, match="chat template"):
        no_template.apply_chat_template([{"role": "user", "content": "x"}])
