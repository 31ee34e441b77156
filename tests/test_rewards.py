"""Loading rewards (built-ins, import paths, schedules) and scoring with faulty rewards."""

from __future__ import annotations

import logging
import math
import textwrap

import pytest

from rlray.config import ConfigError, RewardSpec
from rlray.core.stats import component_means
from rlray.rewards.loading import absolute_spec_path, check_rewards, scheduled_weight
from rlray.rewards.process import InProcessRewards, RewardProcess
from rlray.rewards.worker import RewardWorker
from tests.test_episode import make_episode

USER_REWARDS = '''
import math
import time


def reward_len(completions, **kwargs):
    """TRL's example: longer is worse."""
    return [-abs(20 - len(c)) for c in completions]


def needs_answer(prompts, completions, answer):
    return [float(c == a) for c, a in zip(completions, answer)]


def fails_on_bad(prompts, completions, **kwargs):
    if any("bad" in c for c in completions):
        raise RuntimeError("cannot score 'bad'")
    return [1.0] * len(completions)


def nan_or_none(prompts, completions, **kwargs):
    return [math.nan if c == "nan" else None if c == "none" else 0.5 for c in completions]


def huge(prompts, completions, **kwargs):
    return [1e300 if c == "huge" else 10**400 if c == "bigint" else 1e14 for c in completions]


def slow(prompts, completions, **kwargs):
    time.sleep(30)
    return [1.0] * len(completions)


def wrong_length(prompts, completions, **kwargs):
    return [1.0]


def records_sizes(prompts, completions, log, **kwargs):
    with open(log, "a") as out:
        out.write(f"{len(completions)} ")
    return [0.0] * len(completions)


def exits_on_bad(prompts, completions, **kwargs):
    import os
    import sys

    if "sys.exit" in completions:
        sys.exit(3)
    if "os._exit" in completions:
        os._exit(4)
    if "segfault" in completions:
        import ctypes

        ctypes.string_at(0)
    return [1.0] * len(completions)


class Scaled:
    def __init__(self, factor):
        self.factor = factor

    def __call__(self, prompts, completions, **kwargs):
        return [self.factor * len(c) for c in completions]


not_callable = 3
'''


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(textwrap.dedent(USER_REWARDS))
    return path


def spec(user_file, attr: str, **fields) -> RewardSpec:
    return RewardSpec(name=f"{user_file}:{attr}", **fields)


def episodes(*completions: str):
    return [
        make_episode(episode_id=f"e{i}", completion=c, reward=None, reward_components={})
        for i, c in enumerate(completions)
    ]


def test_trl_style_function_from_a_file(user_file):
    worker = RewardWorker("reward-0", [spec(user_file, "reward_len")])
    scored, stats = worker.score(episodes("x" * 18, "x" * 20))
    assert [e.reward for e in scored] == [-2.0, 0.0]
    assert [e.reward_components for e in scored] == [
        {f"{user_file}:reward_len": -2.0},
        {f"{user_file}:reward_len": 0.0},
    ]
    assert stats.failures == {f"{user_file}:reward_len": 0}


def test_module_import_path_and_relative_file(user_file, monkeypatch):
    monkeypatch.syspath_prepend(str(user_file.parent))
    check_rewards([RewardSpec(name="my_rewards:reward_len")], set())
    relative = absolute_spec_path(RewardSpec(name="my_rewards.py:reward_len"), user_file.parent)
    assert relative.name == f"{user_file}:reward_len"
    assert (
        absolute_spec_path(RewardSpec(name="exact_match"), user_file.parent).name == "exact_match"
    )


def test_a_relative_model_path_is_made_absolute_where_it_names_a_local_directory(tmp_path):
    (tmp_path / "rm1" / "reward_model").mkdir(parents=True)
    local = RewardSpec(name="classifier_reward", kwargs={"model_path": "rm1/reward_model", "a": 1})
    made = absolute_spec_path(local, tmp_path)
    assert made.kwargs == {"model_path": str(tmp_path / "rm1" / "reward_model"), "a": 1}
    assert made.name == "classifier_reward" and local.kwargs["model_path"] == "rm1/reward_model"
    # A hub name (nothing of that name here) and an absolute path are left as they are.
    for path in ("org/some-reward-model", str(tmp_path / "rm1")):
        spec = RewardSpec(name="classifier_reward", kwargs={"model_path": path})
        assert absolute_spec_path(spec, tmp_path).kwargs == {"model_path": path}


def test_class_reward_is_constructed_once_with_kwargs(user_file):
    worker = RewardWorker("reward-0", [spec(user_file, "Scaled", kwargs={"factor": 2.0})])
    scored, _ = worker.score(episodes("abc"))
    assert scored[0].reward == 6.0


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("no_such_module_xyz:fn", "cannot import no_such_module_xyz: ModuleNotFoundError"),
        ("FILE:missing", "has no attribute 'missing'"),
        ("FILE:not_callable", "is not callable"),
        ("/no/such/file.py:fn", "no such file: /no/such/file.py"),
        ("exactmatch", "unknown reward 'exactmatch'"),
        ("FILE:needs_answer", "missing a required argument: 'answer'"),
    ],
)
def test_bad_reward_fails_at_start_with_one_line(user_file, name, message):
    name = name.replace("FILE", str(user_file))
    with pytest.raises(ConfigError) as err:
        check_rewards([RewardSpec(name=name)], column_names={"question"})
    text = str(err.value)
    assert text.startswith(f"reward.functions[0].name ({name}): ")
    assert message in text
    assert "\n" not in text


def test_wrong_kwargs_are_caught_before_any_model_loads(user_file):
    with pytest.raises(ConfigError, match=r"constructor: .*unexpected keyword argument 'scale'"):
        check_rewards([spec(user_file, "Scaled", kwargs={"factor": 1, "scale": 2})], set())
    with pytest.raises(ConfigError, match=r"reward call: .*unexpected keyword argument 'bogus'"):
        check_rewards([spec(user_file, "needs_answer", kwargs={"bogus": 1})], {"answer"})
    check_rewards([spec(user_file, "needs_answer")], {"answer", "other_column"})


@pytest.mark.parametrize(
    ("schedule", "interpolation", "expected"),
    [
        ([], "linear", {0: 0.7, 100: 0.7}),
        ([[10, 0.0], [20, 1.0]], "linear", {0: 0.0, 10: 0.0, 15: 0.5, 20: 1.0, 99: 1.0}),
        ([[0, 1.0], [10, 0.5], [20, 0.0]], "step", {0: 1.0, 9: 1.0, 10: 0.5, 19: 0.5, 25: 0.0}),
    ],
)
def test_weight_schedules(schedule, interpolation, expected):
    rule = RewardSpec(weight=0.7, schedule=schedule, interpolation=interpolation)
    assert {step: scheduled_weight(rule, step) for step in expected} == pytest.approx(expected)


def test_total_uses_the_weights_of_the_scoring_step(user_file):
    ramp = spec(user_file, "Scaled", kwargs={"factor": 1.0}, schedule=[[0, 0.0], [10, 1.0]])
    worker = RewardWorker("reward-0", [ramp, spec(user_file, "reward_len", weight=0.5)])
    at_5, _ = worker.score(episodes("x" * 20), step=5)
    assert at_5[0].reward == pytest.approx(0.5 * 20 + 0.5 * 0.0)


def test_raising_reward_fails_only_the_episodes_it_raises_on(user_file, caplog):
    failing = spec(user_file, "fails_on_bad")
    worker = RewardWorker("reward-0", [failing, spec(user_file, "Scaled", kwargs={"factor": 1.0})])
    with caplog.at_level(logging.WARNING):
        scored, stats = worker.score(episodes("ok", "bad", "bad!"))
    assert [e.reward_components[failing.name] for e in scored] == [1.0, None, None]
    assert [e.reward for e in scored] == [3.0, 3.0, 4.0]  # scored from the other component
    assert stats.failures[failing.name] == 2 and stats.dropped == 0
    warnings = [r.getMessage() for r in caplog.records if failing.name in r.getMessage()]
    assert len(warnings) == 1  # the first failure only, with its episode id
    assert "episode e1" in warnings[0] and "cannot score 'bad'" in warnings[0]


def test_drop_episode_policy_leaves_failed_episodes_without_reward(user_file):
    worker = RewardWorker("reward-0", [spec(user_file, "nan_or_none")], on_failure="drop_episode")
    scored, stats = worker.score(episodes("nan", "none", "fine"))
    assert [e.reward for e in scored] == [None, None, 0.5]
    assert stats.dropped == 2
    assert stats.failures == {f"{user_file}:nan_or_none": 2}
    assert component_means(scored) == {f"{user_file}:nan_or_none": 0.5}


def test_a_finite_score_the_learner_cannot_take_is_that_rewards_failure(user_file, caplog):
    """1e300 is finite, but float32 statistics of it overflow: it fails like NaN, and a
    weighted total beyond ±1e15 fails the component that put it there."""
    huge = spec(user_file, "huge", weight=20.0)
    worker = RewardWorker("reward-0", [huge, spec(user_file, "Scaled", kwargs={"factor": 1.0})])
    with caplog.at_level(logging.WARNING):
        scored, stats = worker.score(episodes("huge", "bigint", "ok"))
    # 20 x 1e14 = 2e15 is beyond the limit too: the weighted score fails as well.
    assert [e.reward_components[huge.name] for e in scored] == [None, None, None]
    assert [e.reward for e in scored] == [4.0, 6.0, 2.0]  # the other component's
    assert stats.failures[huge.name] == 3
    assert "returned 1e+300" in caplog.text
    within = RewardWorker("reward-0", [spec(user_file, "huge", weight=5.0)])
    assert within.score(episodes("fine"))[0][0].reward == 5e14


def test_timed_out_reward_fails_its_batch_and_the_worker_goes_on(user_file):
    slow = spec(user_file, "slow", timeout_s=0.5)
    worker = RewardWorker("reward-0", [slow, spec(user_file, "reward_len")])
    scored, stats = worker.score(episodes("a", "b"))
    # Marked failed, not 1.0: the worker stopped waiting before the reward returned.
    assert stats.failures[slow.name] == 2
    assert all(e.reward_components[slow.name] is None for e in scored)
    assert all(not math.isnan(e.reward) for e in scored)


def test_wrong_number_of_scores_fails_the_batch(user_file):
    worker = RewardWorker("reward-0", [spec(user_file, "wrong_length")])
    _, stats = worker.score(episodes("a", "b"))
    assert stats.failures == {f"{user_file}:wrong_length": 2}


def test_scoring_batch_size_splits_calls(user_file, tmp_path):
    log = tmp_path / "sizes"
    records = spec(user_file, "records_sizes", kwargs={"log": str(log)})
    worker = RewardWorker("reward-0", [records], batch_size=2)
    worker.score(episodes("a", "b", "c", "d", "e"))
    assert log.read_text().split() == ["2", "2", "1"]


def test_reward_code_that_exits_or_crashes_fails_only_its_episodes(user_file, caplog):
    exits = spec(user_file, "exits_on_bad")
    worker = RewardWorker("reward-0", [exits, spec(user_file, "reward_len")])
    completions = ("fine", "sys.exit", "os._exit", "segfault", "also fine")
    with caplog.at_level(logging.WARNING):
        scored, stats = worker.score(episodes(*completions))
    assert [e.reward_components[exits.name] for e in scored] == [1.0, None, None, None, 1.0]
    assert stats.failures[exits.name] == 3
    assert "called sys.exit(3)" in caplog.text
    # The worker (this process) lives on, and so does scoring.
    scored, stats = worker.score(episodes("again"))
    assert scored[0].reward_components[exits.name] == 1.0 and stats.failures[exits.name] == 0


def test_built_ins_score_in_the_workers_process_and_any_other_reward_in_a_child(user_file):
    built_ins = [RewardSpec("exact_match"), RewardSpec("numeric_match", weight=0.5)]
    in_process = RewardWorker("reward-0", built_ins)
    assert isinstance(in_process.process, InProcessRewards)
    apart = [
        [RewardSpec("regex_match", kwargs={"pattern": "^4"})],  # the user's pattern
        [RewardSpec("exact_match"), spec(user_file, "reward_len")],  # user code beside
    ]
    for specs in apart:
        assert isinstance(RewardWorker("reward-0", specs).process, RewardProcess)
    # The same scores either way, and a built-in that raises fails only its call.
    completions = ("42", " 42 ", "41", "4.2e1")
    child = RewardWorker("reward-0", built_ins)
    child.process = RewardProcess(built_ins)
    one, two = (worker.score(episodes(*completions))[0] for worker in (in_process, child))
    assert [e.reward_components for e in one] == [e.reward_components for e in two]
    assert [e.reward for e in one] == [1.5, 1.5, 0.0, 0.5]
    unanswered = episodes("42")
    unanswered[0].columns = {}
    scored, stats = in_process.score(unanswered)
    assert scored[0].reward_components["exact_match"] is None
    assert stats.failures == {"exact_match": 1, "numeric_match": 1}


def test_evaluation_is_scored_by_the_eval_rewards_and_comes_back_as_small_records(user_file):
    from rlray.core.evaluation import EvalEpisodes

    greedy = episodes("ab", "bad")
    sampled = episodes("a", "abc", "bad", "abcd")
    for i, e in enumerate(greedy):
        e.prompt_index = -2 + i
    for i, e in enumerate(sampled):
        e.prompt_index = -2 + i // 2
    train = [spec(user_file, "reward_len")]
    evaluation = [spec(user_file, "fails_on_bad"), spec(user_file, "Scaled", kwargs={"factor": 2})]
    worker = RewardWorker("reward-0", train, eval_specs=evaluation)
    samples = worker.evaluate(EvalEpisodes(greedy, sampled))
    assert [(s.prompt_id, s.greedy) for s in samples] == [
        (-2, True),
        (-1, True),
        (-2, False),
        (-2, False),
        (-1, False),
        (-1, False),
    ]
    lengths = [2, 3, 1, 3, 3, 4]
    failing, scaled = (s.name for s in evaluation)
    assert [s.components[scaled] for s in samples] == [2.0 * n for n in lengths]
    # fails_on_bad fails on "bad" only: None there, the total from the other component
    assert [s.components[failing] for s in samples] == [1.0, None, 1.0, 1.0, None, 1.0]
    assert [s.reward for s in samples] == [5.0, 6.0, 3.0, 7.0, 6.0, 9.0]
    # training still scores with its own rewards
    scored, _ = worker.score(episodes("abc"))
    assert scored[0].reward_components == {train[0].name: -17.0}
    # without eval rewards, the training rewards score the evaluation
    plain = RewardWorker("reward-1", train).evaluate(EvalEpisodes(episodes("ab"), []))
    assert plain[0].components == {train[0].name: -18.0}


@pytest.mark.parametrize(
    ("old_spec", "name"),
    [
        ("rlray.rewards.model_rewards:EmbeddingSimilarity", "EmbeddingSimilarity"),
        ("rlray.rewards.model_rewards:ClassifierReward", "ClassifierReward"),
        ("rlray.environments:tool_success", "tool_success"),
        ("rlray.environments:ToolEnvironment", "ToolEnvironment"),
        ("rlray.calculator:CalculatorEnvironment", "CalculatorEnvironment"),
        ("rlray.tools:python_tool", "python_tool"),
        ("rlray.multiturn:Trajectory", "Trajectory"),
    ],
)
def test_specs_written_against_the_flat_layout_still_find_their_targets(old_spec, name):
    from rlray.rewards.loading import import_attribute

    assert import_attribute(old_spec).__name__ == name
