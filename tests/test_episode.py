"""The episode type round-trips through its pyarrow schema without loss."""

import pyarrow as pa

from rlray.episode import EPISODE_SCHEMA, Episode, Span, from_table, to_table


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
        rollout_logprobs=[-0.5, -0.25, -0.125],
        finish_reason="stop",
        policy_version=2,
        rollout_worker="rollout-0",
        columns={"answer": "42", "tags": ["ä", 1]},
        reward=1.0,
        reward_components={"exact_match": 1.0, "other": None},
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
        make_episode(episode_id="run-3-2", reward=None, reward_components={}),
    ]
    table = to_table(episodes)
    assert table.schema.equals(EPISODE_SCHEMA, check_metadata=True)
    assert from_table(table) == episodes


def test_schema_covers_every_episode_field():
    assert set(EPISODE_SCHEMA.names) == set(Episode.__dataclass_fields__)
    assert EPISODE_SCHEMA.field("rollout_logprobs").type == pa.list_(pa.float32())
