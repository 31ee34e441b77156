"""The episode type round-trips through its pyarrow schema without loss, and its one
validation names every value the schema or the model cannot take."""

import dataclasses
import math
import re

import pyarrow as pa
import pytest

from rlray.core.episode import (
    EPISODE_SCHEMA,
    Episode,
    EpisodeError,
    ModelLimits,
    Span,
    from_table,
    to_table,
    validate_episodes,
)


def make_episode(**overrides) -> Episode:
    values = dict(
        run_id="run",
        episode_id="run-3-1",
        prompt_index=3,
        sample_index=1,
        prompt="12+30=",
        completion="42",
        prompt_token_ids=[4, 5, 13, 6, 3, 16],
        completion_token_ids=[7, 5, 1],
        # Real logprobs: not exact in float32 (nor in bfloat16 or float16).
        rollout_logprobs=[math.log(p) for p in (0.3, 0.55, 0.9)],
        finish_reason="stop",
        policy_version=2,
        rollout_worker="rollout-0",
        columns={"answer": "42", "tags": ["ä", 1]},
        reward=1.0,
        reward_components={"exact_match": 1.0, "other": None},
        reward_details={"code_tests": '{"tests": [["pass", ""], ["fail", "AssertionError"]]}'},
        generated_at=1700000000.123456,
        scored_at=1700000001.5,
        trained_at=None,
        spans=[
            Span("model_call", 1700000000.0, 1700000000.5, input="12+30=", output="42"),
            Span("tool_call", 1700000000.6, name="calc", arguments='{"x": 1}', error="boom"),
            Span("reward", 1700000001.0, 1700000001.5, value=1.0, source="exact_match"),
        ],
    )
    values.update(overrides)
    return Episode(**values)


def test_every_field_round_trips():
    episodes = [
        make_episode(),
        make_episode(
            episode_id="run-3-2",
            reward=None,
            reward_components={},
            rollout_logprobs=[math.log(p) for p in (0.7, 0.05, 0.999)],
            completion_mask=[1, 0, 1],
        ),
    ]
    table = to_table(episodes)
    assert table.schema.equals(EPISODE_SCHEMA, check_metadata=True)
    restored = from_table(table)
    # Logprobs are stored as float32: they come back rounded to nearest, within half a
    # float32 unit in the last place (relative 2**-24) of each episode's own values;
    # float16 or bfloat16 storage, or values swapped between episodes, are far outside.
    for back, sent in zip(restored, episodes, strict=True):
        assert back.rollout_logprobs == pytest.approx(sent.rollout_logprobs, rel=2**-24, abs=0)
        assert back.rollout_logprobs != sent.rollout_logprobs  # rounded: == means nothing
    # Every other field comes back exactly.
    assert [dataclasses.replace(e, rollout_logprobs=[]) for e in restored] == [
        dataclasses.replace(e, rollout_logprobs=[]) for e in episodes
    ]


def test_schema_covers_every_episode_field():
    assert set(EPISODE_SCHEMA.names) == set(Episode.__dataclass_fields__)
    assert EPISODE_SCHEMA.field("rollout_logprobs").type == pa.list_(pa.float32())


LIMITS = ModelLimits(vocab_size=20, max_model_len=16)


def test_a_valid_episode_passes_the_schema_and_the_model():
    validate_episodes([make_episode()], LIMITS)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"prompt_token_ids": [4, 2**31]},
            "episodes[0].prompt_token_ids[1]: 2147483648 is outside int32",
        ),
        (
            {"completion_token_ids": [-(2**31) - 1]},
            "completion_token_ids[0]: -2147483649 is outside int32",
        ),
        (
            {"policy_version": 2**63},
            "episodes[0].policy_version: 9223372036854775808 is outside int64",
        ),
        ({"sample_index": 2**40}, "episodes[0].sample_index: 1099511627776 is outside int32"),
        ({"generated_at": 1e300}, "episodes[0].generated_at: 1e+300 is not a time"),
        ({"scored_at": float("nan")}, "episodes[0].scored_at: nan is not finite"),
        ({"reward": float("nan")}, "episodes[0].reward: nan is not finite"),
        ({"reward": float("inf")}, "episodes[0].reward: inf is not finite"),
        (
            {"reward_components": {"judge": float("nan")}},
            "reward_components.judge: nan is not finite",
        ),
        ({"rollout_logprobs": [-0.5, 1e39, 0.0]}, "rollout_logprobs[1]: 1e+39 is beyond float32"),
        ({"rollout_logprobs": [float("-inf")]}, "rollout_logprobs[0]: -inf is not finite"),
        # Finite items whose sum overflows are checked one by one, and pass the range.
        ({"rollout_logprobs": [-1e38, 1e39]}, "rollout_logprobs[1]: 1e+39 is beyond float32"),
        ({"rollout_logprobs": [-(2**2000)]}, "rollout_logprobs[0]: an integer of 2001 bits"),
        ({"reward": 2**1100}, "episodes[0].reward: an integer of 1101 bits is beyond every"),
        ({"columns": {"answer": [1, {2}]}}, "episodes[0].columns: not JSON"),
        ({"run_id": ""}, "episodes[0].run_id: empty"),
        ({"episode_id": "  "}, "episodes[0].episode_id: empty"),
        ({"prompt": "\ud800"}, "episodes[0].prompt: not valid Unicode"),
        (
            {"prompt_token_ids": [1, True]},
            "prompt_token_ids[1]: expected an integer, got a boolean",
        ),
        ({"completion": None}, "episodes[0].completion: missing"),
        ({"columns": {"x": {1, 2}}}, "episodes[0].columns: not JSON"),
        ({"spans": [Span("dream", 1.0)]}, "episodes[0].spans[0].kind: expected one of"),
        ({"spans": [Span("reward", 1e20)]}, "episodes[0].spans[0].started_at: 1e+20 is not a time"),
    ],
)
def test_values_the_schema_cannot_hold_are_named(overrides, message):
    bad = make_episode(**overrides)
    with pytest.raises(EpisodeError) as caught:
        validate_episodes([make_episode(), bad])
    assert str(caught.value).startswith("episodes[1].")
    assert message.split(".", 1)[-1] in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"completion_token_ids": [7, 20]},
            "completion_token_ids[1]: token id 20 is outside the model's vocabulary (0 to 19)",
        ),
        (
            {"prompt_token_ids": [-1]},
            "prompt_token_ids[0]: token id -1 is outside the model's vocabulary",
        ),
        (
            {"completion_token_ids": [7] * 11},
            "6 prompt + 11 completion tokens exceed the context window (model.max_model_len=16)",
        ),
        ({"prompt_token_ids": [], "completion_token_ids": [7]}, "prompt_token_ids: empty"),
        ({"reward": 1e308}, "episodes[0].reward: 1e+308 is beyond ±1e+15"),
        ({"completion_mask": [1, 0]}, "completion_mask: 2 entries for 3 completion tokens"),
        ({"completion_mask": [1, 2, 1]}, "completion_mask: entries must be 0 or 1"),
    ],
)
def test_episodes_the_model_cannot_take_are_named(overrides, message):
    bad = make_episode(**overrides)
    validate_episodes([bad])  # the schema holds it; the model does not
    with pytest.raises(EpisodeError, match=re.escape(message)):
        validate_episodes([bad], LIMITS)


def test_a_store_written_before_completion_masks_reads_as_all_policy_tokens(tmp_path):
    import pyarrow.parquet as pq

    import rlray.episodes

    # Schema version 2 had neither column; version 1 had no completion_mask.
    old = to_table([make_episode()]).drop_columns(["completion_mask", "last_policy_version"])
    new = to_table(
        [make_episode(episode_id="run-3-2", completion_mask=[1, 0, 1], last_policy_version=3)]
    )
    for name, table in (("a-old", old), ("b-new", new)):
        folder = tmp_path / "run=run" / "date=2026-11-23"
        folder.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, folder / f"{name}.parquet")
    restored = {e.episode_id: e for e in from_table(rlray.episodes.read(tmp_path))}
    assert restored["run-3-1"].completion_mask == []
    assert restored["run-3-2"].completion_mask == [1, 0, 1]
    # One policy version made every token of an episode stored before in-flight updates.
    assert restored["run-3-1"].last_policy_version == restored["run-3-1"].policy_version == 2
    assert restored["run-3-2"].last_policy_version == 3
