"""The OpenAI API's requests and responses, as the agent endpoint speaks them.

An agent written with the official `openai` client calls `chat.completions.create` (or
`completions.create`) at its trace's base URL. This module turns the request body into
a checked `ChatRequest` (or `CompletionRequest`), refusing what it cannot serve with a
`RequestError` (an HTTP status and one line), and turns what the engine generated,
`Generated` (exact token ids, their logprobs, the text), into the response body: a
`chat.completion` object, or the chunks of a stream. Tool calls in a completion's text
(the Hermes/Qwen `<tool_call>` blocks a chat template asks for) become the message's
`tool_calls`. No HTTP and no engine here: both are the endpoint's.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from rlray.rollout.environments import parse_tool_calls
from rlray.rollout.sampling import Generated

ROLES = ("system", "user", "assistant", "tool", "developer")
# Fields the openai client may send that change nothing here (accepted, not used).
IGNORED = {"user", "metadata", "store", "parallel_tool_calls", "stream_options", "seed"}
IGNORED |= {"service_tier", "frequency_penalty", "presence_penalty", "top_p", "tool_choice"}
IGNORED |= {"response_format", "logit_bias", "modalities", "audio"}


class RequestError(Exception):
    """A request the endpoint refuses: an HTTP status and a one-line reason."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Sampling:
    """What a request asks of the engine."""

    n: int = 1
    temperature: float = 1.0
    max_tokens: int | None = None
    """None: as many as the run allows a call."""
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    """Whether the response carries each sampled token's logprob (always recorded)."""


@dataclass(frozen=True)
class ChatRequest:
    """A checked chat.completions.create request."""

    messages: list[dict[str, Any]]
    """Roles and contents as the chat template takes them (tool calls and tool results
    included)."""
    model: str
    """The caller's model name: the agent's role (several roles share one policy)."""
    sampling: Sampling
    tools: list[dict[str, Any]] = field(default_factory=list)
    """OpenAI function tools, given to the chat template as it takes them."""
    stream: bool = False


@dataclass(frozen=True)
class CompletionRequest:
    """A checked completions.create request (one plain prompt)."""

    prompt: str
    model: str
    sampling: Sampling
    stream: bool = False


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise RequestError(400, "body must be a JSON object")
    return body


def _field(body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    # JSON true is not a number here, whatever Python thinks of bool and int.
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise RequestError(400, f"{name}: expected {_kind_name(kind)}, got a boolean")
    if not isinstance(value, kind):
        raise RequestError(400, f"{name}: expected {_kind_name(kind)}")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {str: "a string", int: "an integer", float: "a number", bool: "a boolean"}
    names |= {list: "a list", dict: "an object"}
    return " or ".join(dict.fromkeys(names.get(k, k.__name__) for k in kinds))


def _unknown(body: dict[str, Any], known: set[str]) -> None:
    unknown = sorted(set(body) - known - IGNORED)
    if unknown:
        raise RequestError(400, f"{unknown[0]}: unknown field")


def _sampling(body: dict[str, Any], max_tokens_limit: int, max_n: int) -> Sampling:
    n = _field(body, "n", int, 1)
    if not 1 <= n <= max_n:
        raise RequestError(400, f"n: {n} is not between 1 and {max_n}")
    temperature = float(_field(body, "temperature", (int, float), 1.0))
    if not (math.isfinite(temperature) and 0 <= temperature <= 2):
        raise RequestError(400, f"temperature: {temperature} is not between 0 and 2")
    max_tokens = _field(body, "max_tokens", int, None)
    max_tokens = _field(body, "max_completion_tokens", int, max_tokens)
    if max_tokens is not None and max_tokens < 1:
        raise RequestError(400, f"max_tokens: {max_tokens} is below 1")
    if max_tokens is not None:  # agents set their own; the run's limit serves them cut
        max_tokens = min(max_tokens, max_tokens_limit)
    stop = _field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(400, "stop: expected up to 4 non-empty strings")
    logprobs = _field(body, "logprobs", bool, False)
    top = _field(body, "top_logprobs", int, 0)
    if top:
        raise RequestError(400, "top_logprobs: only the sampled token's logprob is served")
    return Sampling(n, temperature, max_tokens, tuple(stop), logprobs)


def parse_chat_request(body: Any, max_tokens_limit: int, max_n: int = 16) -> ChatRequest:
    """Returns the checked request, or raises RequestError (400) naming the first bad
    field. `max_tokens_limit`: the most tokens one call may generate (the run's)."""
    body = _object(body)
    known = {"messages", "model", "tools", "stream", "n", "temperature", "max_tokens", "stop"}
    _unknown(body, known | {"max_completion_tokens", "logprobs", "top_logprobs"})
    messages = _field(body, "messages", list, None)
    if not messages:
        raise RequestError(400, "messages: expected a non-empty list")
    checked = [_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
    tools = _field(body, "tools", list, [])
    for i, tool in enumerate(tools):
        if not (isinstance(tool, dict) and isinstance(tool.get("function"), dict)):
            raise RequestError(400, f"tools[{i}]: expected {{'type': 'function', 'function': ...}}")
    return ChatRequest(
        messages=checked,
        model=_field(body, "model", str, ""),
        sampling=_sampling(body, max_tokens_limit, max_n),
        tools=tools,
        stream=_field(body, "stream", bool, False),
    )


def _message(message: Any, where: str) -> dict[str, Any]:
    """Returns a message as the chat template takes it: content as text (a list of text
    parts joined), tool calls' arguments as objects."""
    if not isinstance(message, dict):
        raise RequestError(400, f"{where}: expected an object")
    role = message.get("role")
    if role not in ROLES:
        raise RequestError(400, f"{where}.role: expected one of {', '.join(ROLES)}")
    checked: dict[str, Any] = {"role": "system" if role == "developer" else role}
    checked["content"] = _content(message.get("content"), f"{where}.content")
    calls = message.get("tool_calls")
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list):
            raise RequestError(400, f"{where}.tool_calls: expected a list on an assistant message")
        checked["tool_calls"] = [
            _tool_call(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(calls)
        ]
    for name in ("name", "tool_call_id"):
        if isinstance(message.get(name), str):
            checked[name] = message[name]
    return checked


def _content(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise RequestError(400, f"{where}: expected a string or a list of text parts")


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RequestError(
            400, f"{where}: expected {{'function': {{'name': ..., 'arguments': ...}}}}"
        )
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except json.JSONDecodeError:
            raise RequestError(400, f"{where}.function.arguments: not JSON") from None
    return {"type": "function", "function": {"name": function["name"], "arguments": arguments}}


def parse_completion_request(
    body: Any, max_tokens_limit: int, max_n: int = 16
) -> CompletionRequest:
    """Returns the checked completions request (one string prompt), or raises
    RequestError (400)."""
    body = _object(body)
    _unknown(
        body, {"prompt", "model", "stream", "n", "temperature", "max_tokens", "stop", "logprobs"}
    )
    prompt = _field(body, "prompt", str, "")
    if not prompt:
        raise RequestError(400, "prompt: expected a non-empty string")
    logprobs = _field(body, "logprobs", int, 0)  # completions take a count here
    if logprobs not in (0, 1):
        raise RequestError(400, "logprobs: only the sampled token's logprob is served (0 or 1)")
    sampling = _sampling({**body, "logprobs": bool(logprobs)}, max_tokens_limit, max_n)
    return CompletionRequest(
        prompt, _field(body, "model", str, ""), sampling, _field(body, "stream", bool, False)
    )


# ---------------------------------------------------------------- responses


def _message_of(generated: Generated, with_tools: bool) -> tuple[dict[str, Any], str]:
    """Returns the assistant message of a completion and its finish reason: its
    `<tool_call>` blocks become tool_calls (finish reason tool_calls) where the request
    gave tools, and the text before the first block is the content."""
    calls = [c for c in parse_tool_calls(generated.text) if c.error is None] if with_tools else []
    if not calls:
        return {"role": "assistant", "content": generated.text}, generated.finish_reason
    content = generated.text.split("<tool_call>", 1)[0].strip() or None
    tool_calls = [
        {
            "id": f"call_{i}",
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments_json},
        }
        for i, c in enumerate(calls)
    ]
    return {"role": "assistant", "content": content, "tool_calls": tool_calls}, "tool_calls"


def _logprobs(generated: Generated) -> dict[str, Any]:
    tokens = generated.tokens or [""] * len(generated.token_ids)
    return {
        "content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(tokens, generated.logprobs, strict=True)
        ]
    }


def _usage(prompt_tokens: int, choices: list[Generated]) -> dict[str, int]:
    completion = sum(len(g.token_ids) for g in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }


def chat_response(
    request: ChatRequest, call_id: str, created: int, prompt_tokens: int, choices: list[Generated]
) -> dict[str, Any]:
    """Returns the chat.completion object of the generated choices."""
    out = []
    for index, generated in enumerate(choices):
        message, finish = _message_of(generated, bool(request.tools))
        choice = {"index": index, "message": message, "finish_reason": finish}
        choice["logprobs"] = _logprobs(generated) if request.sampling.logprobs else None
        out.append(choice)
    return {
        "id": call_id,
        "object": "chat.completion",
        "created": created,
        "model": request.model,
        "choices": out,
        "usage": _usage(prompt_tokens, choices),
    }


def chat_chunks(
    request: ChatRequest, call_id: str, created: int, prompt_tokens: int, choices: list[Generated]
) -> list[dict[str, Any]]:
    """Returns the chat.completion.chunk objects of a stream of the generated choices:
    per choice its role, its content (or tool calls) and its finish reason, then the
    usage. The engine generates a call whole, so each choice's text comes in one delta."""
    head = {"id": call_id, "object": "chat.completion.chunk", "created": created}
    head["model"] = request.model
    chunks = []
    for index, generated in enumerate(choices):
        message, finish = _message_of(generated, bool(request.tools))
        delta: dict[str, Any] = {"role": "assistant", "content": message["content"]}
        if "tool_calls" in message:
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
        logprobs = _logprobs(generated) if request.sampling.logprobs else None
        chunks.append({**head, "choices": [{"index": index, "delta": delta, "logprobs": logprobs}]})
        chunks.append({**head, "choices": [{"index": index, "delta": {}, "finish_reason": finish}]})
    chunks.append({**head, "choices": [], "usage": _usage(prompt_tokens, choices)})
    return chunks


def completion_response(
    request: CompletionRequest,
    call_id: str,
    created: int,
    prompt_tokens: int,
    choices: list[Generated],
) -> dict[str, Any]:
    """Returns the text_completion object of the generated choices."""
    out = []
    for index, generated in enumerate(choices):
        logprobs = None
        if request.sampling.logprobs:
            tokens = generated.tokens or [""] * len(generated.token_ids)
            logprobs = {"tokens": tokens, "token_logprobs": list(generated.logprobs)}
        out.append(
            {
                "index": index,
                "text": generated.text,
                "finish_reason": generated.finish_reason,
                "logprobs": logprobs,
            }
        )
    return {
        "id": call_id,
        "object": "text_completion",
        "created": created,
        "model": request.model,
        "choices": out,
        "usage": _usage(prompt_tokens, choices),
    }


def completion_chunks(
    request: CompletionRequest,
    call_id: str,
    created: int,
    prompt_tokens: int,
    choices: list[Generated],
) -> list[dict[str, Any]]:
    """Returns the text_completion chunks of a stream: each choice whole with its finish
    reason (the engine generates a call whole), then the usage."""
    whole = completion_response(request, call_id, created, prompt_tokens, choices)
    chunks = [{**whole, "choices": [choice]} for choice in whole.pop("choices")]
    usage = whole.pop("usage")
    return [*chunks, {**whole, "choices": [], "usage": usage}]
