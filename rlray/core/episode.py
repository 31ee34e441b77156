"""The one episode type: what crosses actor boundaries, what the store writes.

An `Episode` is one prompt, one sampled completion and everything learned about it on
its way to the learner. `EPISODE_SCHEMA` is its pyarrow schema; `to_table` and
`from_table` convert without loss (tests/test_episode.py round-trips every field).
`validate_episodes` checks episodes against the schema (and the model's limits) before
they are ingested, stored or trained on.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa

_TIMESTAMP = pa.timestamp("us", tz="UTC")
SPAN_KINDS = ("model_call", "tool_call", "reward", "event")

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
        # Null in stores written before multi-turn episodes: read as [] (all the policy's).
        pa.field("completion_mask", pa.list_(pa.int8())),
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("policy_version", pa.int64(), nullable=False),
        # Null in stores written before in-flight weight updates: read as policy_version.
        pa.field("last_policy_version", pa.int64()),
        pa.field("rollout_worker", pa.string(), nullable=False),
        pa.field("columns", pa.string(), nullable=False),  # JSON object of dataset columns
        pa.field("reward", pa.float64()),
        pa.field("reward_components", pa.map_(pa.string(), pa.float64())),
        # Null in stores written before explained scores: read as {}.
        pa.field("reward_details", pa.map_(pa.string(), pa.string())),
        pa.field("generated_at", _TIMESTAMP, nullable=False),
        pa.field("scored_at", _TIMESTAMP),
        pa.field("trained_at", _TIMESTAMP),
        pa.field("spans", pa.list_(SPAN_TYPE), nullable=False),
    ],
    metadata={"rlray.episode_schema_version": "4"},
)


class Score(float):
    """A reward's score with an explanation: a float to everything that reads it, and
    its `detail` (JSON-able: a code reward's verdict per test) is kept on the episode
    (Episode.reward_details)."""

    detail: Any

    def __new__(cls, value: float, detail: Any = None) -> Score:
        score = super().__new__(cls, value)
        score.detail = detail
        return score

    def __reduce__(self) -> tuple:
        return Score, (float(self), self.detail)


@dataclass
class Span:
    """One timestamped step of a multi-step trace: a model call (input, output; name: the
    agent's role), a tool call (name, arguments, result or error), a reward (value,
    source) or an event an agent posted (name, output: its detail, value)."""

    kind: str
    """model_call, tool_call, reward or event."""
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
    """Learner version whose weights generated the completion's first token: the oldest
    of its versions, from which its staleness counts."""
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
    last_policy_version: int | None = None
    """Learner version whose weights generated its last token: newer than policy_version
    where a weight sync came while it was generated (rollout.in_flight_updates). Given
    as None (an episode made elsewhere, or stored before), it is policy_version."""
    completion_mask: list[int] = field(default_factory=list)
    """Per completion token, 1 where the policy generated it and 0 where the rollout
    appended it (an environment's observation or a tool's result between turns): the
    learner trains, and checks logprob parity, only where it is 1. Empty: every token is
    the policy's (a single model call)."""
    reward_details: dict[str, str] = field(default_factory=dict)
    """A reward component's explanation of its score, as JSON text, by name: where the
    reward gave one (a Score's detail; code_tests' verdict per test)."""

    def __post_init__(self) -> None:
        if self.last_policy_version is None:
            self.last_policy_version = self.policy_version


def _micros(seconds: float | None) -> int | None:
    return None if seconds is None else round(seconds * 1_000_000)


def to_table(episodes: list[Episode]) -> pa.Table:
    """Returns the episodes as a pyarrow Table with EPISODE_SCHEMA."""
    arrays = []
    for f in EPISODE_SCHEMA:
        values = [getattr(ep, f.name) for ep in episodes]
        if f.name == "columns":
            values = [json.dumps(columns, sort_keys=True) for columns in values]
        elif f.name in ("reward_components", "reward_details"):
            values = [list(mapping.items()) for mapping in values]
        elif f.name == "spans":
            values = [[_span_row(span) for span in spans] for spans in values]
        if pa.types.is_timestamp(f.type):
            arrays.append(pa.array(list(map(_micros, values)), pa.int64()).cast(f.type))
        else:
            arrays.append(pa.array(values, type=f.type))
    return pa.Table.from_arrays(arrays, schema=EPISODE_SCHEMA)


def _span_row(span: Span | dict[str, Any]) -> dict[str, Any]:
    row = dataclasses.asdict(span) if isinstance(span, Span) else dict(span)
    row["started_at"], row["ended_at"] = _micros(row["started_at"]), _micros(row.get("ended_at"))
    return row


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
        row["reward_details"] = dict(row["reward_details"] or [])
        row["spans"] = [_span_from_row(span) for span in row["spans"]]
        row["completion_mask"] = row["completion_mask"] or []
        out.append(Episode(**row))
    return out


def _span_from_row(row: dict[str, Any]) -> Span:
    for name in ("started_at", "ended_at"):
        row[name] = None if row[name] is None else row[name].timestamp()
    return Span(**row)


# ---------------------------------------------------------------- validation
#
# One check of an episode, read off EPISODE_SCHEMA: what the store can write (integer
# widths, float widths, timestamps a reader can turn back into datetimes, valid UTF-8),
# plus what the schema cannot say (ids not empty, span kinds) and, given the model's
# limits, what the learner can train on. Ingestion, the store and the learner call it.

_FLOAT32_MAX = 3.4028234663852886e38
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_SECONDS_RANGE = (  # what datetime (and so from_table) can hold: years 1 to 9999
    (datetime.min.replace(tzinfo=UTC) - _EPOCH).total_seconds(),
    (datetime.max.replace(tzinfo=UTC) - _EPOCH).total_seconds(),
)


class EpisodeError(ValueError):
    """An episode the schema or the model cannot take; the message is one line that
    names the field (`episodes[3].prompt_token_ids[7]: ...`)."""


MAX_ABS_REWARD = 1e15
"""Largest |reward|. The learner computes in float32 (largest 3.4e38) and whitening sums
squared rewards over a step's tokens: 1e15 leaves room for 1e8 tokens."""


@dataclass(frozen=True)
class ModelLimits:
    """What the learner's model can take."""

    vocab_size: int
    """Token ids must be in [0, vocab_size): rows of the model's embedding."""
    max_model_len: int
    """Prompt plus completion tokens at most this many (model.max_model_len)."""
    max_abs_reward: float = MAX_ABS_REWARD
    """Largest |reward| (MAX_ABS_REWARD)."""


def validate_episodes(
    episodes: list[Episode], limits: ModelLimits | None = None, where: str = "episodes"
) -> None:
    """Returns None if every episode fits EPISODE_SCHEMA (and, given limits, the model);
    else raises EpisodeError naming the first bad field of the first bad episode."""
    for i, episode in enumerate(episodes):
        validate_episode(episode, limits, f"{where}[{i}]")


def validate_episode(
    episode: Episode, limits: ModelLimits | None = None, where: str = "episode"
) -> None:
    """Returns None if the episode fits EPISODE_SCHEMA (and, given limits, the model);
    else raises EpisodeError naming the bad field."""
    for name, check in _field_checks():
        check(getattr(episode, name), f"{where}.{name}")
    for name in ("run_id", "episode_id"):
        if not getattr(episode, name).strip():
            raise EpisodeError(f"{where}.{name}: empty")
    for i, span in enumerate(episode.spans):
        kind = span["kind"] if isinstance(span, dict) else span.kind
        if kind not in SPAN_KINDS:
            raise EpisodeError(f"{where}.spans[{i}].kind: expected one of {', '.join(SPAN_KINDS)}")
    if limits is not None:
        _check_fits_model(episode, limits, where)


def _check_fits_model(episode: Episode, limits: ModelLimits, where: str) -> None:
    for name in ("prompt_token_ids", "completion_token_ids"):
        ids = getattr(episode, name)
        if ids and not (min(ids) >= 0 and max(ids) < limits.vocab_size):
            i, bad = next((i, t) for i, t in enumerate(ids) if not 0 <= t < limits.vocab_size)
            raise EpisodeError(
                f"{where}.{name}[{i}]: token id {bad} is outside the model's vocabulary "
                f"(0 to {limits.vocab_size - 1})"
            )
    prompt, completion = episode.prompt_token_ids, episode.completion_token_ids
    _check_completion_mask(episode, where)
    if completion and not prompt:
        raise EpisodeError(f"{where}.prompt_token_ids: empty (a completion needs a prompt)")
    if len(prompt) + len(completion) > limits.max_model_len:
        raise EpisodeError(
            f"{where}.completion_token_ids: {len(prompt)} prompt + {len(completion)} "
            f"completion tokens exceed the context window (model.max_model_len="
            f"{limits.max_model_len})"
        )
    if episode.reward is not None and abs(episode.reward) > limits.max_abs_reward:
        raise EpisodeError(
            f"{where}.reward: {episode.reward:g} is beyond ±{limits.max_abs_reward:g}, "
            "where the learner's float32 statistics overflow"
        )


def check_rollout_logprobs(episode: Episode, where: str = "episode") -> None:
    """Raises EpisodeError unless the behaviour logprobs are absent or one per completion
    token, each a log-probability (at most 0, give or take an engine's rounding). For
    posted episodes: the learner treats logprobs it cannot use as unknown."""
    logprobs = episode.rollout_logprobs
    if not logprobs:
        return
    if len(logprobs) != len(episode.completion_token_ids):
        raise EpisodeError(
            f"{where}.rollout_logprobs: {len(logprobs)} entries for "
            f"{len(episode.completion_token_ids)} completion tokens"
        )
    if (largest := max(logprobs)) > 1e-3:
        raise EpisodeError(f"{where}.rollout_logprobs: {largest:g} is not a log-probability")


def _check_completion_mask(episode: Episode, where: str) -> None:
    mask = episode.completion_mask
    if not mask:
        return
    if len(mask) != len(episode.completion_token_ids):
        raise EpisodeError(
            f"{where}.completion_mask: {len(mask)} entries for "
            f"{len(episode.completion_token_ids)} completion tokens"
        )
    if not set(mask) <= {0, 1}:
        raise EpisodeError(f"{where}.completion_mask: entries must be 0 or 1")


Check = Callable[[Any, str], None]
"""Raises EpisodeError unless a value (in its Episode form) can be written as one arrow
type; the second argument names the value in the message."""


@functools.cache
def _field_checks() -> list[tuple[str, Check]]:
    """Returns each EPISODE_SCHEMA field's check, made once: the store, the learner and
    ingestion check every field of every episode, so no type is looked at per value."""
    return [
        (f.name, _check_columns if f.name == "columns" else _checker(f.type, f.nullable))
        for f in EPISODE_SCHEMA
    ]


@functools.cache
def _checker(dtype: pa.DataType, nullable: bool) -> Check:
    """Returns the check of a value of `dtype`, null allowed if `nullable`."""
    check = _value_checker(dtype, nullable)

    def check_value(value: Any, where: str) -> None:
        if value is None:
            if not nullable:
                raise EpisodeError(f"{where}: missing")
            return
        check(value, where)

    return check_value


def _value_checker(dtype: pa.DataType, nullable: bool) -> Check:
    """Returns the check of a value of `dtype` that is not None."""
    if pa.types.is_string(dtype):
        return functools.partial(_check_string, nullable=nullable)
    if pa.types.is_integer(dtype):
        return functools.partial(
            _check_int, dtype=dtype, bounds=_int_range(dtype), nullable=nullable
        )
    if pa.types.is_floating(dtype):
        return functools.partial(_check_float, dtype=dtype, nullable=nullable)
    if pa.types.is_timestamp(dtype):  # Unix seconds in an Episode
        return functools.partial(_check_seconds, nullable=nullable)
    if pa.types.is_list(dtype):
        return functools.partial(
            _check_list,
            plainly_fits=_plain_list_check(dtype.value_type),
            check_item=_checker(dtype.value_type, False),
        )
    if pa.types.is_map(dtype):
        return functools.partial(
            _check_map,
            check_key=_checker(dtype.key_type, False),
            check_item=_checker(dtype.item_type, dtype.item_field.nullable),
            nullable=nullable,
        )
    if pa.types.is_struct(dtype):
        fields = [(f.name, _checker(f.type, f.nullable)) for f in dtype]
        return functools.partial(_check_struct, fields=fields, nullable=nullable)
    raise TypeError(f"no check for arrow type {dtype}")  # a new column type needs its own


def _check_string(value: Any, where: str, nullable: bool) -> None:
    if not isinstance(value, str):
        raise EpisodeError(_wrong(where, "a string", value, nullable))
    if value.isascii():
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:  # a lone surrogate, e.g. JSON "\ud800"
        raise EpisodeError(f"{where}: not valid Unicode ({err.reason})") from None


def _check_int(
    value: Any, where: str, dtype: pa.DataType, bounds: tuple[int, int], nullable: bool
) -> None:
    if type(value) is not int:
        raise EpisodeError(_wrong(where, "an integer", value, nullable))
    low, high = bounds
    if not low <= value <= high:
        raise EpisodeError(f"{where}: {value} is outside {dtype} ({low} to {high})")


def _int_range(dtype: pa.DataType) -> tuple[int, int]:
    if pa.types.is_signed_integer(dtype):
        return -(1 << (dtype.bit_width - 1)), (1 << (dtype.bit_width - 1)) - 1
    return 0, (1 << dtype.bit_width) - 1


def _check_float(value: Any, where: str, dtype: pa.DataType, nullable: bool) -> None:
    if type(value) not in (int, float):
        raise EpisodeError(_wrong(where, "a number", value, nullable))
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an integer past any float
        bits = value.bit_length()
        raise EpisodeError(f"{where}: an integer of {bits} bits is beyond every float") from None
    if not finite:
        raise EpisodeError(f"{where}: {value} is not finite")
    if pa.types.is_float32(dtype) and abs(value) > _FLOAT32_MAX:
        raise EpisodeError(f"{where}: {value:g} is beyond float32's range")


def _check_seconds(value: Any, where: str, nullable: bool) -> None:
    _check_float(value, where, pa.float64(), nullable)
    if not _SECONDS_RANGE[0] <= value <= _SECONDS_RANGE[1]:
        raise EpisodeError(f"{where}: {value:g} is not a time (Unix seconds, years 1 to 9999)")


def _check_list(
    values: Any,
    where: str,
    plainly_fits: Callable[[list[Any]], bool],
    check_item: Check,
) -> None:
    if not isinstance(values, list):
        raise EpisodeError(_wrong(where, "a list", values, False))
    if not values or plainly_fits(values):  # token ids and logprobs: passes in C
        return
    for i, value in enumerate(values):  # find and name the bad item
        check_item(value, f"{where}[{i}]")


def _plain_list_check(item_type: pa.DataType) -> Callable[[list[Any]], bool]:
    """Returns a whole-list test that is true only if every item fits `item_type` (false
    may still fit: the items are then checked one by one)."""
    if pa.types.is_integer(item_type):
        low, high = _int_range(item_type)

        def plain_ints(values: list[Any]) -> bool:
            return set(map(type, values)) == {int} and low <= min(values) and max(values) <= high

        return plain_ints
    if pa.types.is_floating(item_type):
        limit = _FLOAT32_MAX if pa.types.is_float32(item_type) else math.inf

        def plain_floats(values: list[Any]) -> bool:
            # A finite sum means no item is infinite or NaN (an overflowing sum of finite
            # items only sends the list to the item-by-item check).
            if not set(map(type, values)) <= {int, float}:
                return False
            try:
                return math.isfinite(sum(values)) and max(map(abs, values)) <= limit
            except OverflowError:  # an integer past any float
                return False

        return plain_floats
    return lambda values: False


def _check_map(value: Any, where: str, check_key: Check, check_item: Check, nullable: bool) -> None:
    if not isinstance(value, dict):
        raise EpisodeError(_wrong(where, "an object", value, nullable))
    for key, item in value.items():
        check_key(key, f"{where} key {key!r}")
        check_item(item, f"{where}.{key}")


def _check_struct(value: Any, where: str, fields: list[tuple[str, Check]], nullable: bool) -> None:
    if not isinstance(value, (dict, Span)):
        raise EpisodeError(_wrong(where, "an object", value, nullable))
    for name, check in fields:
        item = value.get(name) if isinstance(value, dict) else getattr(value, name)
        check(item, f"{where}.{name}")


_JSON_SCALARS = (str, int, float, bool, type(None))


def _check_columns(value: Any, where: str) -> None:
    if not isinstance(value, dict):
        raise EpisodeError(_wrong(where, "an object", value, False))
    flat = all(type(k) is str and isinstance(v, _JSON_SCALARS) for k, v in value.items())
    if flat:  # a dataset row's plain columns: JSON as they are
        return
    try:
        json.dumps(value, sort_keys=True)
    except (TypeError, ValueError) as err:
        raise EpisodeError(f"{where}: not JSON ({err})") from None


def _wrong(where: str, expected: str, value: Any, nullable: bool) -> str:
    got = "a boolean" if isinstance(value, bool) else type(value).__name__
    return f"{where}: expected {expected}{' or null' if nullable else ''}, got {got}"
