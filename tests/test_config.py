"""The one config: YAML + command line, type checks, and errors that name the field."""

import pytest

from rlray.config import (
    Config,
    ConfigError,
    build_parser,
    leaf_fields,
    parse_command_line,
    validate,
)


def test_defaults_validate():
    validate(Config())


def test_command_line_overrides_yaml_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("algorithm:\n  clip_high: 0.3\nlearner:\n  lr: 0.001\nseed: 7\n")
    command = parse_command_line(
        ["--config", str(path), "--learner.lr", "5e-5", "--run-dir", "out"]
    )
    assert command.config.algorithm.clip_high == 0.3
    assert command.config.learner.lr == 5e-5
    assert command.config.seed == 7
    assert command.config.run_dir == "out"
    assert command.resume_dir is None


def test_model_shortcut_and_dashed_names():
    command = parse_command_line(["--model", "some/dir", "--rollout.max-new-tokens", "9"])
    assert command.config.model.path == "some/dir"
    assert command.config.rollout.max_new_tokens == 9


def test_reward_list_from_command_line():
    command = parse_command_line(["--reward.functions", "[{name: exact_match, weight: 2.0}]"])
    assert command.config.reward.functions[0].weight == 2.0


def test_help_lists_every_field_with_its_doc():
    text = build_parser().format_help()
    for dotted, (_, _, doc) in leaf_fields().items():
        assert f"--{dotted}" in text, dotted
        assert doc, f"{dotted} has no docstring"
        assert " ".join(doc.split()[:4]) in " ".join(text.split()), dotted


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--algorithm.clip_hihg", "0.1"],
            "unknown config field '--algorithm.clip_hihg' (did you mean '--algorithm.clip_high'?)",
        ),
        (["--learner.lr", "fast"], "learner.lr: expected float, got 'fast'"),
        (
            ["--algorithm.kl_estimator", "k4"],
            "algorithm.kl_estimator must be one of k1, k2, k3; got 'k4'",
        ),
        (["--learner.steps", "1.5"], "learner.steps: expected int, got '1.5'"),
    ],
)
def test_bad_command_line_names_the_field(argv, message):
    with pytest.raises(ConfigError) as err:
        parse_command_line(argv)
    assert str(err.value) == message


def test_unknown_yaml_field_suggests_the_closest(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("rollout:\n  num_worker: 2\n")
    with pytest.raises(
        ConfigError,
        match=r"unknown config field 'rollout.num_worker' \(did you mean 'rollout.num_workers'\?\)",
    ):
        parse_command_line(["--config", str(path)])


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"config file not found: .*nope\.yaml"):
        parse_command_line(["--config", str(tmp_path / "nope.yaml")])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rollout.prompts_per_batch", "-4"], "rollout.prompts_per_batch must be > 0, got -4"),
        (["--algorithm.gamma", "1.5"], r"algorithm.gamma must be in \[0, 1\], got 1.5"),
        (
            ["--algorithm.kl_mode", "loss"],
            r"algorithm.kl_estimator k1 with kl_mode loss has zero gradient in expectation",
        ),
        (
            ["--algorithm.advantage", "grpo", "--rollout.samples_per_prompt", "1"],
            r"rollout.samples_per_prompt must be >= 2 for algorithm.advantage grpo",
        ),
        (
            ["--learner.minibatch_size", "24"],
            r"learner.minibatch_size \(24\) must divide learner.episodes_per_step",
        ),
        (
            ["--buffer.capacity_episodes", "32"],
            r"buffer.capacity_episodes \(32\) must hold one learner step",
        ),
        (
            ["--learner.sync_every", "3"],
            r"buffer.max_staleness \(0\) must be >= learner.sync_every - 1",
        ),
    ],
)
def test_validate_names_the_bad_field(argv, message):
    config = parse_command_line(argv).config
    with pytest.raises(ConfigError, match=message):
        validate(config)


def test_resume_reads_the_runs_own_config(tmp_path):
    (tmp_path / "config.yaml").write_text(f"run_dir: {tmp_path}\nseed: 3\nlearner:\n  steps: 4\n")
    command = parse_command_line(["--resume", str(tmp_path), "--learner.steps", "8"])
    assert command.resume_dir == tmp_path
    assert command.config.seed == 3
    assert command.config.learner.steps == 8
    with pytest.raises(ConfigError, match=r"no config\.yaml"):
        parse_command_line(["--resume", str(tmp_path / "missing")])
