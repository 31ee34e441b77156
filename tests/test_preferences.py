"""Preference pairs: read from JSONL with one-line errors, and made from an episode
store by the documented rule (jobs/pairs.py on a real store)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rlray.config import Config, ConfigError
from rlray.data.chat import MESSAGES_COLUMN
from rlray.data.preferences import (
    PreferencePair,
    arithmetic_pair,
    pairs_from_episodes,
    preference_batches,
    read_pairs,
)
from rlray.episodes.store import EpisodeStore
from tests.jobs_helper import REPO
from tests.test_episode import make_episode


def scored(prompt: str, completions: dict[str, float | None], start: int = 0, **fields):
    """Episodes of one prompt with the given completions and rewards."""
    fields.setdefault("completion_mask", [])
    return [
        make_episode(
            episode_id=f"{prompt}-{start + i}",
            prompt=prompt,
            completion=text,
            reward=reward,
            **fields,
        )
        for i, (text, reward) in enumerate(completions.items())
    ]


def test_the_best_completion_is_chosen_over_the_worst_at_least_a_margin_below():
    episodes = [
        *scored("12+34=", {"46": 1.0, "6": 0.5, "57": 0.0, "3": 0.0}),
        *scored("7+8=", {"15": 1.0, "16": 1.0}),  # no difference: no pair
        *scored("1+1=", {"2": 1.0, "3": None}),  # unscored: left out
    ]
    pairs, counts = pairs_from_episodes(episodes, margin=1.0)
    # Worst first; of the two at 0.0, the later episode id ranks lower.
    assert [(p.prompt, p.chosen, p.rejected) for p in pairs] == [("12+34=", "46", "3")]
    assert pairs[0].columns == {
        "chosen_reward": 1.0,
        "rejected_reward": 0.0,
        "chosen_episode": "12+34=-0",
        "rejected_episode": "12+34=-3",
    }
    assert (counts.prompts, counts.pairs, counts.prompts_without_pair) == (3, 1, 2)
    assert counts.without_reward == 1
    more, _ = pairs_from_episodes(episodes, margin=0.5, per_prompt=3)
    assert [(p.chosen, p.rejected) for p in more] == [("46", "3"), ("46", "57"), ("46", "6")]


def test_repeated_completions_rank_once_and_multi_turn_and_empty_episodes_are_left_out():
    episodes = [
        *scored("5+5=", {"10": 1.0, "11": 0.0}),
        *scored("5+5=", {"10": 0.0}, start=2),  # sampled again, scored lower: best kept
        *scored("5+5=", {"(5+5)10": 0.0}, start=3, completion_mask=[1, 0, 1]),
        # stopped at once: a pair file's completion must not be empty (read_pairs)
        *scored("5+5=", {"": 0.0}, start=4),
    ]
    pairs, counts = pairs_from_episodes(episodes, margin=1.0, per_prompt=5)
    assert [(p.chosen, p.rejected) for p in pairs] == [("10", "11")]
    assert (counts.multi_turn, counts.empty) == (1, 1)
    with pytest.raises(ValueError, match="margin must be > 0"):
        pairs_from_episodes(episodes, margin=0.0)


def test_chat_episodes_give_chat_pairs():
    messages = [{"role": "user", "content": "2+2?"}]
    episodes = scored("<rendered>", {"4": 1.0, "5": 0.0}, columns={MESSAGES_COLUMN: messages})
    (pair,), _ = pairs_from_episodes(episodes, margin=1.0)
    assert pair.prompt == messages
    assert pair.chosen == [{"role": "assistant", "content": "4"}]
    assert pair.rejected == [{"role": "assistant", "content": "5"}]


def write_lines(path, *records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_pair_files_round_trip_text_and_chat_pairs(tmp_path):
    chat = [{"role": "user", "content": "2+2?"}]
    pairs = [
        PreferencePair("12+34=", "46", "57", {"source": "hand"}),
        PreferencePair(
            chat, [{"role": "assistant", "content": "4"}], [{"role": "assistant", "content": "5"}]
        ),
    ]
    path = write_lines(tmp_path / "pairs.jsonl", *(p.to_json() for p in pairs))
    assert read_pairs(path) == pairs


@pytest.mark.parametrize(
    "record, message",
    [
        ({"prompt": "1+1=", "chosen": "2"}, r"pairs.jsonl:1: missing field 'rejected'$"),
        ({"prompt": "1+1=", "chosen": "2", "rejected": "2"}, r"are the same$"),
        ({"prompt": "1+1=", "chosen": "", "rejected": "3"}, r"pair 1: 'chosen' is empty$"),
        (
            {"prompt": "1+1=", "chosen": [{"role": "assistant", "content": "2"}], "rejected": "3"},
            r"'chosen' must be a string for a text prompt, got list$",
        ),
        (
            {
                "prompt": [{"role": "user", "content": "1+1?"}],
                "chosen": "2",
                "rejected": [{"role": "user", "content": "3"}],
            },
            r"'rejected' message 0 is not an assistant message$",
        ),
        ({"prompt": [], "chosen": "2", "rejected": "3"}, r"'prompt' is an empty list"),
    ],
)
def test_bad_pairs_are_one_line_errors_naming_the_pair(tmp_path, record, message):
    path = write_lines(tmp_path / "pairs.jsonl", record)
    with pytest.raises(ConfigError, match=message) as error:
        read_pairs(path)
    assert "\n" not in str(error.value)


def test_pairs_job_turns_a_stores_episodes_into_a_pair_file(tmp_path):
    store = EpisodeStore(tmp_path / "episodes", "run", rows_per_file=100)
    store.append([*scored("12+34=", {"46": 1.0, "57": 0.0}), *scored("7+8=", {"15": 1.0})])
    assert store.close() == []
    out = tmp_path / "out" / "pairs.jsonl"
    command = [sys.executable, "jobs/pairs.py", str(tmp_path / "episodes"), "--out", str(out)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("1 pairs from 2 prompts (1 without a pair at margin 1.0)")
    (pair,) = read_pairs(str(out))
    assert (pair.prompt, pair.chosen, pair.rejected) == ("12+34=", "46", "57")
    missing = subprocess.run(
        [sys.executable, "jobs/pairs.py", str(tmp_path / "none"), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 2
    assert missing.stderr.startswith("pairs.py: error: no such episode store")


def test_builtin_pairs_choose_the_sum_over_near_misses_and_far_ones():
    from rlray.data.tasks import addition

    arithmetic_row = addition(2).row

    pairs = [arithmetic_pair(arithmetic_row(40, 6), i, digits=2) for i in range(400)]
    assert {(p.prompt, p.chosen, p.columns["answer"]) for p in pairs} == {("40+6=", "46", "46")}
    near, far = [int(p.rejected) for p in pairs[0::2]], [int(p.rejected) for p in pairs[1::2]]
    assert set(near) == {47, 45, 56, 36}
    # Far misses: any other sum of two 2-digit numbers (0..198), spread over the range.
    assert 46 not in far and min(far) >= 0 and max(far) <= 198
    assert len(set(far)) > 100 and sum(abs(w - 46) > 10 for w in far) > 150
    # Seeded by the index: the same pair every time; never negative for 0+0.
    assert arithmetic_pair(arithmetic_row(40, 6), 7, 2) == pairs[7]
    zero = [int(arithmetic_pair(arithmetic_row(0, 0), i, 2).rejected) for i in range(0, 40, 2)]
    assert set(zero) == {1, 10}


def test_builtin_batches_train_on_other_prompts_than_the_held_out_pairs():
    config = Config()
    config.preference.pairs_per_step = 16
    batches, held_out = preference_batches(config)
    assert len(held_out) == config.preference.eval_pairs
    trained = {p.prompt for step in (1, 2, 3) for p in batches(step)}
    assert len(batches(1)) == 16 and batches(2) == batches(2) and batches(1) != batches(2)
    assert not trained & {p.prompt for p in held_out}


def test_file_batches_hold_out_pairs_and_cycle_through_the_rest(tmp_path):
    written = [PreferencePair(f"{i}+0=", str(i), str(i + 1)) for i in range(10)]
    config = Config()
    config.data.train = write_lines(tmp_path / "pairs.jsonl", *(p.to_json() for p in written))
    config.preference.pairs_per_step, config.preference.eval_pairs = 4, 3
    batches, held_out = preference_batches(config)
    train = [p for p in written if p not in held_out]
    assert len(held_out) == 3 and len(train) == 7
    # Two passes over the 7 training pairs in steps of 4: each pair once per pass.
    seen = [p.prompt for step in range(1, 8) for p in batches(step)]
    assert sorted(seen[:7]) == sorted(seen[7:14]) == sorted(p.prompt for p in train)
    config.preference.eval_pairs = 10
    with pytest.raises(ConfigError, match="leave none to train on"):
        preference_batches(config)
