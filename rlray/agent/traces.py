"""Traces: what an agent did with one task the run handed out, and the episodes it makes.

A trace is one sample of one prompt: the agent takes the task, makes model calls at the
trace's base URL (each recorded as the engine generated it: prompt token ids, sampled
ids, their logprobs, the policy versions), may post events, and ends the trace with a
reward (or without one: the run's reward functions score it).

Its calls become episodes without re-tokenising anything. A call whose prompt extends an
earlier episode of the trace (its prompt and completion, token for token) continues that
episode: the tokens between are appended with completion_mask 0, the call's own with 1,
so the learner trains on the policy's tokens only. Any other call starts an episode of
its own. The trace's first episode carries the trace's spans (its model calls, tool
calls, events and reward, in order) and its other episodes none, so a trace's events
are stored once however many episodes it made; every episode's columns name the trace
(`trace_id`, which rlray.core.groups.trace_spans follows back to the spans) and the
agent's role (`agent_role`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlray.core.episode import Episode, Span
from rlray.core.groups import AGENT_TRACE_COLUMN
from rlray.core.prompt import PromptRow
from rlray.data.chat import episode_columns
from rlray.rollout.sampling import Generated

AGENT_ROLE_COLUMN = "agent_role"


@dataclass
class Call:
    """One sampled choice of one model call, as the engine made it."""

    call_id: str
    """The response's id (a per-call reward is posted under it)."""
    role: str
    """The request's `model` field: the agent's role."""
    prompt_text: str
    prompt_token_ids: list[int]
    generated: Generated
    started_at: float
    ended_at: float


@dataclass
class Trace:
    """One task handed out, and everything its agent did until the trace ended."""

    trace_id: str
    row: PromptRow
    prompt_index: int
    sample_index: int
    worker: int
    """The rollout worker that serves its calls (its prefix cache holds the trace)."""
    handed_out_at: float | None = None
    calls: list[Call] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    """Model calls, tool calls, events and the reward, in the order they happened."""
    reward: float | None = None
    components: dict[str, float] = field(default_factory=dict)
    call_rewards: dict[str, float] = field(default_factory=dict)
    """Rewards the agent posted for single calls, by call id."""
    ended: bool = False
    dropped: bool = False
    """Ended by agent.trace_timeout_s, not by its agent: never trained on."""
    model_calls: int = 0
    sampled_tokens: int = 0
    reserved_calls: int = 0
    reserved_tokens: int = 0
    """Calls and tokens of calls under way, counted against the limits before they run."""
    event_bytes: int = 0
    events: int = 0
    _tool_results: set[tuple[str, str, str]] = field(default_factory=set)

    def add_call(self, calls: list[Call], input_text: str) -> None:
        """Records a model call's choices (one Call each) and its span."""
        self.model_calls += 1
        for call in calls:
            self.calls.append(call)
            self.sampled_tokens += len(call.generated.token_ids)
            self.spans.append(
                Span(
                    "model_call",
                    call.started_at,
                    call.ended_at,
                    input=input_text,
                    output=call.generated.text,
                    name=call.role,
                )
            )

    def add_tool_results(self, messages: list[dict[str, Any]], now: float) -> None:
        """Records, as tool_call spans, the tool results a request's messages carry after
        an assistant's tool calls (each once, however many later calls repeat them)."""
        called: dict[str, tuple[str, str]] = {}
        pending: list[tuple[str, str]] = []
        for message in messages:
            if message["role"] == "assistant":
                pending = []
                for i, call in enumerate(message.get("tool_calls", [])):
                    function = call["function"]
                    named = (function["name"], _json(function["arguments"]))
                    called[call.get("id", f"call_{i}")] = named
                    pending.append(named)
            elif message["role"] == "tool":
                named = called.get(message.get("tool_call_id", "")) or (
                    pending.pop(0) if pending else ("", "{}")
                )
                key = (*named, message["content"])
                if key not in self._tool_results:
                    self._tool_results.add(key)
                    span = Span("tool_call", now, now, name=named[0], arguments=named[1])
                    span.result = message["content"]
                    self.spans.append(span)

    def add_event(self, name: str, detail: str, value: float | None, now: float) -> None:
        """Records an event the agent posted (a coordination step: a vote, a hand-off)."""
        self.events += 1
        self.event_bytes += len(name.encode()) + len(detail.encode())
        self.spans.append(Span("event", now, now, name=name, output=detail, value=value))

    def end(self, reward: float | None, components: dict[str, float], now: float) -> None:
        """Ends the trace, with the agent's reward (None: the run's rewards score it)."""
        self.ended = True
        self.reward = reward
        self.components = dict(components)
        if reward is not None:
            self.spans.append(Span("reward", now, now, value=reward, source="agent"))


def _json(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, sort_keys=True)


@dataclass
class _Open:
    """An episode being assembled from a trace's calls."""

    calls: list[Call]
    prompt_token_ids: list[int]
    completion_token_ids: list[int] = field(default_factory=list)
    completion_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    completion: str = ""

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.completion_token_ids

    def extend(self, call: Call, between: list[int], between_text: str) -> None:
        sampled = call.generated
        self.calls.append(call)
        self.completion_token_ids += between + sampled.token_ids
        self.completion_mask += [0] * len(between) + [1] * len(sampled.token_ids)
        self.rollout_logprobs += [0.0] * len(between) + list(sampled.logprobs)
        self.completion += between_text + sampled.text


def trace_episodes(
    trace: Trace, run_id: str, worker_name: str, decode: Callable[[list[int]], str], now: float
) -> list[Episode]:
    """Returns the episodes of an ended trace (none for a dropped one): its calls, merged
    where one's prompt extends an earlier episode token for token, in call order."""
    if trace.dropped:
        return []
    episodes: list[_Open] = []
    for call in trace.calls:
        extended = next((e for e in episodes if _extends(call, e)), None)
        if extended is None:
            opened = _Open([], list(call.prompt_token_ids))
            opened.extend(call, [], "")
            episodes.append(opened)
        else:
            between = call.prompt_token_ids[len(extended.token_ids) :]
            extended.extend(call, between, decode(between) if between else "")
    return [_episode(trace, e, k, run_id, worker_name, now) for k, e in enumerate(episodes)]


def _extends(call: Call, episode: _Open) -> bool:
    """Whether the call continues the episode: same role, and its prompt starts with the
    episode's every token (nothing re-tokenised differently)."""
    tokens = episode.token_ids
    return (
        call.role == episode.calls[-1].role
        and len(call.prompt_token_ids) > len(tokens)
        and call.prompt_token_ids[: len(tokens)] == tokens
    )


def _episode(
    trace: Trace, assembled: _Open, index: int, run_id: str, worker_name: str, now: float
) -> Episode:
    first, last = assembled.calls[0], assembled.calls[-1]
    reward = trace.call_rewards.get(last.call_id, trace.reward)
    merged = len(assembled.calls) > 1
    return Episode(
        run_id=run_id,
        episode_id=f"{run_id}-{trace.prompt_index}-{trace.sample_index}-{trace.trace_id}-{index}",
        prompt_index=trace.prompt_index,
        sample_index=trace.sample_index,
        prompt=first.prompt_text,
        completion=assembled.completion,
        prompt_token_ids=assembled.prompt_token_ids,
        completion_token_ids=assembled.completion_token_ids,
        rollout_logprobs=assembled.rollout_logprobs,
        finish_reason=last.generated.finish_reason,
        policy_version=min(c.generated.first_version for c in assembled.calls),
        last_policy_version=max(c.generated.last_version for c in assembled.calls),
        rollout_worker=worker_name,
        columns={
            **episode_columns(trace.row),
            AGENT_TRACE_COLUMN: trace.trace_id,
            AGENT_ROLE_COLUMN: first.role,
        },
        reward=reward,
        reward_components=dict(trace.components) if reward is not None else {},
        generated_at=now,
        spans=list(trace.spans) if index == 0 else [],
        completion_mask=assembled.completion_mask if merged else [],
    )
