"""The one episode type: what crosses actor boundaries, what the store writes.

An `Episode` is one prompt, one sampled completion and everything learned about it on
its way to the learner. `EPISODE_SCHEMA` is its pyarrow schema; `to_table` and
`from_table` convert without loss (tests/test_episode.py round-trips every field).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

_TIMESTAMP = pa.timestamp("us", tz="UTC")
SPAN_KINDS = ("model_call", "tool_call", "reward")

# One struct for every kind of step; the fields a kind does not use stay null.
SPAN_TYPE = pa.struct(
    [
        pa.field("kind", pa.string(), nullable=False),
        pa.field("started_at", _TIMESTAMP, nullable=False),
        pa.field("ended_at", _TIMESTAMP),
        pa.field("input", pa.string()),  # model_call
        pa.field("output", pa.string()),  # model_call
        pa.field("name", pa.string()),  # tool_call: the tool
        pa.field("arguments", pa.string()),  # tool_call: JSON text
        pa.field("result", pa.string()),  # tool_call
        pa.field("error", pa.string()),  # tool_call
        pa.field("value", pa.float64()),  # reward
        pa.field("source", pa.string()),  # reward: the function or judge that gave it
    ]
)

EPISODE_SCHEMA = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("episode_id", pa.string(), nullable=False),
        pa.field("prompt_index", pa.int64(), nullable=False),
        pa.field("sample_index", pa.int32(), nullable=False),
        pa.field("prompt", pa.string(), nullable=False),
        pa.field("completion", pa.string(), nullable=False),
        pa.field("prompt_token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("completion_token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("rollout_logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("policy_version", pa.int64(), nullable=False),
        pa.field("rollout_worker", pa.string(), nullable=False),
        pa.field("columns", pa.string(), nullable=False),  # JSON object of dataset columns
        pa.field("reward", pa.float64()),
        pa.field("reward_components", pa.map_(pa.string(), pa.float64())),
        pa.field("generated_at", _TIMESTAMP, nullable=False),
        pa.field("scored_at", _TIMESTAMP),
        pa.field("trained_at", _TIMESTAMP),
        pa.field("spans", pa.list_(SPAN_TYPE), nullable=False),
    ],
    metadata={"rlray.episode_schema_version": "1"},
)


@dataclass
class Span:
    """One timestamped step of a multi-step trace: a model call (input, output), a tool
    call (name, arguments, result or error) or a reward (value, source)."""

    kind: str
    """model_call, tool_call or reward."""
    started_at: float
    """Unix seconds."""
    ended_at: float | None = None
    input: str | None = None
    output: str | None = None
    name: str | None = None
    arguments: str | None = None
    """The tool call's arguments as JSON text."""
    result: str | None = None
    error: str | None = None
    value: float | None = None
    source: str | None = None


@dataclass
class Episode:
    """One sampled completion of one prompt, tagged with the policy version that made it."""

    run_id: str
    """Run that produced the episode."""
    episode_id: str
    """Unique id: <run>-<prompt index>-<sample index>."""
    prompt_index: int
    """Position of the prompt in the run's prompt stream (-1 for evaluation prompts)."""
    sample_index: int
    """Which of the prompt's samples this is."""
    prompt: str
    completion: str
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    rollout_logprobs: list[float]
    """vLLM's logprob of each sampled completion token (after temperature)."""
    finish_reason: str
    """'stop' (end of sequence) or 'length' (hit max_new_tokens)."""
    policy_version: int
    """Learner version whose weights generated the completion."""
    rollout_worker: str
    """Name of the rollout actor, e.g. rollout-0."""
    columns: dict[str, Any] = field(default_factory=dict)
    """Dataset columns of the prompt (e.g. answer) that reward functions receive."""
    reward: float | None = None
    """Weighted total reward; None until scored."""
    reward_components: dict[str, float | None] = field(default_factory=dict)
    """Each reward component's raw score, by name."""
    generated_at: float = 0.0
    """Unix seconds when generation finished."""
    scored_at: float | None = None
    trained_at: float | None = None
    """Unix seconds of the learner step that trained on it; None if it never was
    (dropped as stale, dropped by a failing reward, or left over at the end)."""
    spans: list[Span] = field(default_factory=list)
    """Steps of a multi-step trace (empty for a single model call)."""


def _micros(seconds: float | None) -> int | None:
    return None if seconds is None else round(seconds * 1_000_000)


def to_table(episodes: list[Episode]) -> pa.Table:
    """Returns the episodes as a pyarrow Table with EPISODE_SCHEMA."""
    rows = []
    for ep in episodes:
        row = dataclasses.asdict(ep)
        row["columns"] = json.dumps(ep.columns, sort_keys=True)
        row["reward_components"] = list(ep.reward_components.items())
        for name in ("generated_at", "scored_at", "trained_at"):
            row[name] = _micros(row[name])
        for span in row["spans"]:
            span["started_at"], span["ended_at"] = (
                _micros(span["started_at"]),
                _micros(span["ended_at"]),
            )
        rows.append(row)
    arrays = []
    for f in EPISODE_SCHEMA:
        values = [row[f.name] for row in rows]
        if pa.types.is_timestamp(f.type):
            arrays.append(pa.array(values, type=pa.int64()).cast(f.type))
        else:
            arrays.append(pa.array(values, type=f.type))
    return pa.Table.from_arrays(arrays, schema=EPISODE_SCHEMA)


def from_table(table: pa.Table) -> list[Episode]:
    """Returns the Episodes stored in a table with EPISODE_SCHEMA."""
    table = table.select(EPISODE_SCHEMA.names)
    out = []
    for row in table.to_pylist():
        for name in ("generated_at", "scored_at", "trained_at"):
            value = row[name]
            row[name] = None if value is None else value.timestamp()
        row["columns"] = json.loads(row["columns"])
        row["reward_components"] = dict(row["reward_components"] or [])
        row["spans"] = [_span_from_row(span) for span in row["spans"]]
        out.append(Episode(**row))
    return out


def _span_from_row(row: dict[str, Any]) -> Span:
    for name in ("started_at", "ended_at"):
        row[name] = None if row[name] is None else row[name].timestamp()
    return Span(**row)
