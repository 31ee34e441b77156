"""The agent endpoint's OpenAI API (rlray.agent.openai_api): requests checked as the
official client sends them, and responses that the official client's own types parse."""

from __future__ import annotations

import json
import re

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from rlray.agent.openai_api import (
    Generated,
    RequestError,
    chat_chunks,
    chat_response,
    completion_chunks,
    completion_response,
    parse_chat_request,
    parse_completion_request,
)

LIMIT = 32
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluates arithmetic.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>'


def request(**fields):
    body = {"model": "solver", "messages": [{"role": "user", "content": "2+2="}], **fields}
    return parse_chat_request(body, LIMIT)


def generated(text: str, finish: str = "stop") -> Generated:
    ids = list(range(3, 3 + len(text)))
    return Generated(ids, [-0.5] * len(ids), text, finish, tokens=list(text))


def test_a_request_as_the_client_sends_it_is_read_whole():
    body = {
        "model": "checker",
        "messages": [
            {
                "role": "developer",
                "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
            },
            {"role": "user", "content": "2+2="},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_0",
                        "type": "function",
                        "function": {"name": "calculator", "arguments": '{"expression": "2+2"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_0", "content": "4"},
        ],
        "tools": TOOLS,
        "n": 2,
        "temperature": 0.7,
        "max_tokens": 16,
        "stop": "\n",
        "logprobs": True,
        "stream": True,
        "user": "ignored",
        "parallel_tool_calls": False,
    }
    parsed = parse_chat_request(body, LIMIT)
    assert parsed.model == "checker" and parsed.stream and parsed.tools == TOOLS
    assert parsed.messages[0] == {"role": "system", "content": "Be brief."}
    # The template gets the arguments as an object, as it renders them.
    call = parsed.messages[2]["tool_calls"][0]["function"]
    assert call == {"name": "calculator", "arguments": {"expression": "2+2"}}
    assert parsed.messages[3] == {"role": "tool", "content": "4", "tool_call_id": "call_0"}
    sampling = parsed.sampling
    assert (sampling.n, sampling.temperature, sampling.max_tokens) == (2, 0.7, 16)
    assert sampling.stop == ("\n",) and sampling.logprobs


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([], "body must be a JSON object"),
        ({"model": "x"}, "messages: expected a non-empty list"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role: expected one of"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content: expected a string"),
        ({"messages": [{"role": "user", "content": "a"}], "n": 0}, "n: 0 is not between 1 and 16"),
        (
            {"messages": [{"role": "user", "content": "a"}], "n": True},
            "n: expected an integer, got a boolean",
        ),
        (
            {"messages": [{"role": "user", "content": "a"}], "max_tokens": 0},
            "max_tokens: 0 is below 1",
        ),
        (
            {"messages": [{"role": "user", "content": "a"}], "temperature": 9},
            "temperature: 9.0 is not between 0 and 2",
        ),
        (
            {"messages": [{"role": "user", "content": "a"}], "stop": [""]},
            "stop: expected up to 4 non-empty strings",
        ),
        (
            {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 5},
            "top_logprobs: only the sampled",
        ),
        (
            {"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "x"}]},
            "tools[0]: expected",
        ),
        ({"messages": [{"role": "user", "content": "a"}], "best_of": 2}, "best_of: unknown field"),
    ],
)
def test_a_request_it_cannot_serve_is_a_400_naming_the_field(body, message):
    with pytest.raises(RequestError, match="^" + re.escape(message)) as err:
        parse_chat_request(body, LIMIT)
    assert err.value.status == 400


def test_a_max_tokens_above_the_runs_limit_is_served_up_to_the_limit():
    # Agents set their own (256 to 4096 is common) and cannot know a run's budget.
    body = {"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 4096}
    assert parse_chat_request(body, LIMIT).sampling.max_tokens == LIMIT


def test_a_chat_response_parses_as_the_clients_chat_completion():
    parsed = request(n=2, logprobs=True)
    body = chat_response(
        parsed, "chatcmpl-1", 1700000000, 5, [generated("4"), generated("44", "length")]
    )
    completion = ChatCompletion.model_validate(json.loads(json.dumps(body)))
    assert [c.message.content for c in completion.choices] == ["4", "44"]
    assert [c.finish_reason for c in completion.choices] == ["stop", "length"]
    assert completion.model == "solver"
    assert [t.logprob for t in completion.choices[1].logprobs.content] == [-0.5, -0.5]
    assert completion.usage.completion_tokens == 3 and completion.usage.total_tokens == 8


def test_tool_call_blocks_become_tool_calls_where_the_request_gave_tools():
    text = f"Let me compute.\n{CALL}"
    with_tools = chat_response(request(tools=TOOLS), "c", 0, 5, [generated(text)])
    choice = ChatCompletion.model_validate(with_tools).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me compute."
    (call,) = choice.message.tool_calls
    assert call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": "2+2"}
    # Without tools in the request the text is the answer, blocks and all.
    plain = ChatCompletion.model_validate(chat_response(request(), "c", 0, 5, [generated(text)]))
    assert plain.choices[0].message.content == text and not plain.choices[0].message.tool_calls


def test_a_stream_parses_as_the_clients_chunks_and_adds_up_to_the_response():
    parsed = request(n=2, stream=True, tools=TOOLS)
    choices = [generated("4"), generated(CALL)]
    chunks = [
        ChatCompletionChunk.model_validate(c) for c in chat_chunks(parsed, "c", 0, 5, choices)
    ]
    text = {0: "", 1: ""}
    finish = {}
    for chunk in chunks:
        for choice in chunk.choices:
            text[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert text == {0: "4", 1: ""} and finish == {0: "stop", 1: "tool_calls"}
    calls = [
        c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls
    ]
    assert calls[0][0].function.name == "calculator"
    assert chunks[-1].usage.completion_tokens == 1 + len(CALL)


def test_a_plain_completion_parses_as_the_clients_completion():
    parsed = parse_completion_request({"model": "m", "prompt": "12+34=", "logprobs": 1}, LIMIT)
    body = completion_response(parsed, "cmpl-1", 0, 6, [generated("46")])
    completion = Completion.model_validate(body)
    assert completion.choices[0].text == "46"
    assert completion.choices[0].logprobs.token_logprobs == [-0.5, -0.5]
    streamed = parse_completion_request({"prompt": "12+34=", "stream": True, "n": 2}, LIMIT)
    chunks = completion_chunks(streamed, "cmpl-2", 0, 6, [generated("46"), generated("47")])
    parsed_chunks = [Completion.model_validate(chunk) for chunk in chunks]
    assert [c.text for chunk in parsed_chunks for c in chunk.choices] == ["46", "47"]
    assert [c.index for chunk in parsed_chunks for c in chunk.choices] == [0, 1]
    assert parsed_chunks[-1].usage.completion_tokens == 4 and not parsed_chunks[-1].choices
    with pytest.raises(RequestError, match=r"^prompt: expected a non-empty string"):
        parse_completion_request({"prompt": ""}, LIMIT)
    with pytest.raises(RequestError, match=r"^logprobs: only the sampled"):
        parse_completion_request({"prompt": "a", "logprobs": 5}, LIMIT)
