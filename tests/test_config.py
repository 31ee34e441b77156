"""The one config: YAML + command line, type checks, and errors that name the field."""

import dataclasses
import functools
import math
import re
import typing

import docstring_parser
import pytest
import yaml

from rlray.config import (
    Config,
    ConfigError,
    LearnerConfig,
    agent_token,
    config_to_dict,
    ingest_token,
    validate,
    weight_sync,
)
from rlray.config.command_line import build_parser, parse_command_line
from rlray.config.schema import CPU_MICRO_BATCH_TOKENS


def settable_fields(cls: type = Config, prefix: str = "") -> typing.Iterator[tuple]:
    """Yields (dotted name, type, default, doc) of every field a command line can set."""
    hints, defaults = typing.get_type_hints(cls), cls()
    docs = {p.arg_name: p.description for p in docstring_parser.parse_from_object(cls).params}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from settable_fields(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, hints[f.name], getattr(defaults, f.name), docs.get(f.name)


def help_entries(text: str) -> dict[str, str]:
    """Returns {flag: its whole entry, whitespace removed} from --help text."""
    entries: dict[str, str] = {}
    for entry in re.split(r"\n(?=  --)", text):
        if entry.startswith("  --"):
            entries[entry.split()[0]] = "".join(entry.split("\n\n")[0].split())
    return entries


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
    # The command line wins wherever --config stands.
    command = parse_command_line(["--learner.lr", "5e-5", "--config", str(path)])
    assert command.config.learner.lr == 5e-5
    assert command.config.seed == 7


def test_one_parse_leaves_nothing_behind_for_the_next(tmp_path):
    # The process builds its parser once and parses with it every time.
    path = tmp_path / "run.yaml"
    path.write_text("learner:\n  lr: 0.001\nreward:\n  functions: [{name: exact_match}]\n")
    parse_command_line(["--config", str(path), "--seed", "7", "--model", "some/dir"])
    with pytest.raises(ConfigError):
        parse_command_line(["--learner.lr", "fast"])
    assert parse_command_line([]).config == Config()


def test_model_shortcut_and_dashed_names():
    command = parse_command_line(["--model", "some/dir", "--rollout.max-new-tokens", "9"])
    assert command.config.model.path == "some/dir"
    assert command.config.rollout.max_new_tokens == 9
    command = parse_command_line(["--learner.micro-batch-size=8", "--run-dir", "out"])
    assert command.config.learner.micro_batch_size == 8
    assert command.config.run_dir == "out"


def test_the_micro_batch_token_budget_defaults_by_the_learners_device():
    learner = parse_command_line([]).config.learner
    assert learner.micro_batch_tokens is None
    assert learner.micro_batch_token_budget == CPU_MICRO_BATCH_TOKENS
    learner = parse_command_line(["--learner.gpus", "1"]).config.learner
    assert learner.micro_batch_token_budget == 0  # micro_batch_size episodes alone
    for given in ("0", "512"):
        for gpus in ("0", "1"):
            command = ["--learner.micro_batch_tokens", given, "--learner.gpus", gpus]
            assert parse_command_line(command).config.learner.micro_batch_token_budget == int(given)


def test_the_micro_batch_rows_default_to_the_token_bound_alone_on_cpu():
    def rows(*argv: str) -> int:
        return parse_command_line(list(argv)).config.learner.micro_batch_rows

    # CPU: the token budget binds alone (the mini-batch: every episode of a step).
    assert rows() == 256
    assert rows("--learner.minibatch_size", "128") == 128
    # No token bound (GPUs, or micro_batch_tokens 0): 64, or the mini-batch if fewer.
    assert rows("--learner.gpus", "1") == 64
    assert rows("--learner.micro_batch_tokens", "0") == 64
    assert rows("--learner.gpus", "1", "--learner.episodes_per_step", "32") == 32
    for gpus in ("0", "1"):  # a size given is kept
        assert rows("--learner.micro_batch_size", "16", "--learner.gpus", gpus) == 16
    gpu_batch_of_96 = ["--learner.gpus", "1", "--rollout.prompts_per_batch", "24"]
    gpu_batch_of_96 += ["--learner.episodes_per_step", "96"]
    with pytest.raises(ConfigError, match=r"learner.micro_batch_size \(64\) must divide"):
        validate(parse_command_line(gpu_batch_of_96).config)


def test_lists_and_mappings_from_command_line_are_yaml():
    command = parse_command_line(
        [
            "--reward.functions",
            "[{name: exact_match, weight: 2.0}, {name: format, schedule: [[0, 1.0], [10, 0]]}]",
            "--learner.resources",
            "{learner_node: 1}",
        ]
    )
    first, second = command.config.reward.functions
    assert (first.name, first.weight, first.timeout_s) == ("exact_match", 2.0, 60.0)
    assert (second.name, second.schedule) == ("format", [[0.0, 1.0], [10.0, 0.0]])
    assert command.config.learner.resources == {"learner_node": 1.0}
    assert isinstance(command.config.learner, LearnerConfig)


def test_help_lists_every_field_with_its_doc_default_and_choices():
    entries = help_entries(build_parser().format_help())
    fields = list(settable_fields())
    assert len(fields) > 80
    for dotted, kind, default, doc in fields:
        entry = entries[f"--{dotted}"]
        assert doc, f"{dotted} has no docstring"
        assert "".join(doc.split()[:6]) in entry, dotted
        if not isinstance(default, (list, dict)):
            shown = "null" if default is None else str(default)
            assert f"default:{''.join(shown.split())})" in entry, dotted
        if typing.get_origin(kind) is typing.Literal:
            assert "{" + ",".join(typing.get_args(kind)) + "}" in entry, dotted
    assert "--modelPATHSameas--model.path." in entries["--model"]
    assert {"--config", "--resume"} <= set(entries)


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
        (
            ["--algorithm.loss_aggregation", "nope"],
            "algorithm.loss_aggregation must be one of token_mean, seq_mean_token_mean, "
            "seq_mean_token_sum, seq_mean_token_sum_norm or null; got 'nope'",
        ),
        # float16 training would need loss scaling: refused (bfloat16 is offered).
        (
            ["--model.dtype", "float16"],
            "model.dtype must be one of float32, bfloat16; got 'float16'",
        ),
        (["--learner.steps", "1.5"], "learner.steps: expected int, got '1.5'"),
        (["--data.shuffle", "maybe"], "data.shuffle: expected bool, got 'maybe'"),
        (
            ["--algorithm.clip_high", "none"],
            "algorithm.clip_high: expected float or null, got 'none'",
        ),
        (["--learner.resources", "[1]"], "learner.resources: expected mapping, got '[1]'"),
        (["--learner.resources", "{a: x}"], "learner.resources: expected float, got 'x'"),
        (["--reward.functions", "[{name: x"], "reward.functions: expected list, got '[{name: x'"),
        (
            ["--reward.functions", "[{name: x, wieght: 2}]"],
            "unknown config field 'reward.functions.wieght' "
            "(did you mean 'reward.functions.weight'?)",
        ),
        (
            ["--reward.functions", "[{name: x, weight: heavy}]"],
            "reward.functions.weight: expected float, got 'heavy'",
        ),
        (["--learner", "5"], "learner: expected a section of fields, got '5'"),
        (["--reward", "{functions: 3}"], "reward.functions: expected list, got '3'"),
        (["--learner.lr", "inf"], "learner.lr must be finite, got inf"),
        (["--algorithm.kl_coef", "nan"], "algorithm.kl_coef must be finite, got nan"),
        (["--rollout.temperature", "nan"], "rollout.temperature must be finite, got nan"),
        (["--run-dir"], "argument --run_dir: expected one argument"),
    ],
)
def test_bad_command_line_names_the_field(argv, message):
    with pytest.raises(ConfigError) as err:
        parse_command_line(argv)
    assert str(err.value) == message


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "rollout:\n  num_worker: 2\n",
            "unknown config field 'rollout.num_worker' (did you mean 'rollout.num_workers'?)",
        ),
        ("sed: 1\n", "unknown config field 'sed' (did you mean 'seed'?)"),
        ("learner: 5\n", "learner: expected a section of fields, got 5"),
        ("algorithm: {advantage: ppo}\n", "algorithm.advantage must be one of gae, grpo,"),
        ("learner:\n  lr: [1\n", "run.yaml: not valid YAML: while parsing a flow sequence"),
        ("- 1\n", "run.yaml: expected a mapping of config sections, got list"),
        (
            "learner:\n  lr: 1.0e-3\nseed: 2\nlearner:\n  steps: 5\n",
            "run.yaml: 'learner' appears twice (line 4); name each field once",
        ),
        (
            "reward:\n  functions:\n    - {name: a, weight: 1, weight: 2}\n",
            "run.yaml: 'weight' appears twice (line 3)",
        ),
        (
            "reward:\n  functions:\n    - {name: a, schedule: [[0, x]]}\n",
            "reward.functions.schedule: expected float, got 'x'",
        ),
    ],
)
def test_bad_yaml_file_names_the_field(tmp_path, text, message):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        parse_command_line(["--config", str(path)])
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_a_config_file_that_cannot_be_read_is_one_line():
    with pytest.raises(ConfigError) as err:
        parse_command_line(["--config", "/proc/self/mem"])
    assert str(err.value) == "/proc/self/mem: cannot be read (Input/output error)"


def test_yaml_file_with_the_sections_nesting(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "algorithm: {advantage: grpo}\nreward:\n  functions:\n    - name: exact_match\n"
        "      weight: 2.0\n      kwargs: {tolerance: 0.5}\n"
    )
    config = parse_command_line(["--config", str(path)]).config
    assert config.algorithm.advantage == "grpo"
    assert config.reward.functions[0].weight == 2.0
    assert config.reward.functions[0].kwargs == {"tolerance": 0.5}
    (tmp_path / "empty.yaml").write_text("# nothing set\n")
    assert parse_command_line(["--config", str(tmp_path / "empty.yaml")]).config == Config()


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"config file not found: .*nope\.yaml"):
        parse_command_line(["--config", str(tmp_path / "nope.yaml")])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rollout.prompts_per_batch", "-4"], "rollout.prompts_per_batch must be > 0, got -4"),
        (["--algorithm.gamma", "1.5"], r"algorithm.gamma must be in \[0, 1\], got 1.5"),
        (
            ["--algorithm.kl_mode", "loss", "--algorithm.kl_coef", "0.05"],
            r"algorithm.kl_estimator k1 with kl_mode loss has zero gradient in expectation",
        ),
        (
            ["--algorithm.advantage", "grpo", "--algorithm.kl_coef", "0.05"],
            r"algorithm.kl_mode reward with advantage grpo: dividing by a group's reward std",
        ),
        (
            ["--algorithm.kl_coef", "0.05", "--algorithm.kl_estimator", "k3"],
            r"^algorithm.kl_estimator k3 with kl_mode reward is not a KL penalty: .* use k1 "
            r"\(or kl_mode loss with k2 or k3\)$",
        ),
        (
            ["--algorithm.kl_coef", "0.05", "--algorithm.kl_estimator", "k2"],
            r"^algorithm.kl_estimator k2 with kl_mode reward is not a KL penalty",
        ),
        (
            ["--algorithm.advantage", "rloo", "--rollout.samples_per_prompt", "1"],
            r"rollout.samples_per_prompt must be >= 2 for algorithm.advantage rloo",
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
            r"buffer.max_staleness \(1\) must be >= learner.sync_every - 1",
        ),
        (
            ["--rollout.gpu_memory_utilization", "1.5"],
            r"^rollout.gpu_memory_utilization must be <= 1.0 \(a share\), got 1.5$",
        ),
        (["--ingest.port", "70000"], r"^ingest.port must be <= 65535 \(a TCP port\), got 70000$"),
        (["--agent.port", "70000"], r"^agent.port must be in \[0, 65535\], got 70000$"),
        (["--agent.enabled", "true"], r"^agent.token: the agent endpoint needs a bearer token"),
        (
            [
                *["--agent.enabled", "true", "--agent.token", "t"],
                *["--rollout.environment", "builtin:calculator"],
            ],
            r"^agent.enabled: agents drive their own turns; rollout.environment ",
        ),
        (
            ["--agent.enabled", "true", "--agent.token", "t", "--ray.placement", "colocated"],
            r"^agent.enabled: the agent endpoint needs disaggregated placement",
        ),
        (["--seed", str(2**32)], r"^seed must be <= 2147483646 \(numpy seeds are 32-bit\)"),
        (
            ["--learner.resources", "{gpu_node: -1}"],
            r"^learner.resources.gpu_node must be >= 0, got -1",
        ),
        (["--model.lora.rank", "-1"], r"^model.lora.rank must be >= 0 \(0 is off\), got -1$"),
        (
            ["--model.lora.rank", "8", "--model.lora.alpha", "0"],
            r"^model.lora.alpha must be > 0, got 0.0$",
        ),
        (["--model.lora.alpha", "-2"], r"^model.lora.alpha must be > 0, got -2.0$"),
        # Values that cannot work, wherever the run is.
        (
            ["--rollout.temperature", "1e-6"],
            r"^rollout.temperature must be >= 0.05 \(RL needs sampled episodes; below it",
        ),
        (
            ["--ray.call_timeout_s", "1e-9"],
            r"^ray.call_timeout_s must be >= 0.001 \(a shorter wait ends before any answer",
        ),
        (
            ["--eval.pass_threshold", "-1"],
            r"^eval.pass_threshold must be > 0 \(at 0 or below a failed completion passes\)",
        ),
        (
            ["--model.lora.rank", "8", "--model.lora.target_modules", "[]"],
            r"^model.lora.target_modules must name at least one module$",
        ),
        (
            ["--model.lora.rank", "8", "--model.lora.target_modules", "[all-linear, q_proj]"],
            r"^model.lora.target_modules: all-linear stands alone$",
        ),
        (
            ["--model.lora.rank", "8", "--learner.num_workers", "2"],
            r"^model.lora with learner.num_workers > 1: LoRA adapters train in one learner$",
        ),
        (
            ["--learner.compile", "true", "--learner.num_workers", "2"],
            r"^learner.compile with learner.num_workers 2: compiled layers are not built "
            r"for a sharded learner group \(one learner only\)$",
        ),
        (
            ["--learner.borrow_idle_cores", "true", "--ray.placement", "colocated"],
            r"^learner.borrow_idle_cores with ray.placement colocated: it lends idle rollout "
            r"CPU cores to one learner on CPU, with the roles disaggregated$",
        ),
        (
            ["--learner.borrow_idle_cores", "true", "--learner.gpus", "1"],
            r"^learner.borrow_idle_cores with learner.gpus 1: ",
        ),
        (["--learner.num_workers", "0"], r"^learner.num_workers must be > 0, got 0$"),
        (
            ["--rollout.tensor_parallel_size", "2", "--rollout.gpus_per_worker", "1"],
            r"^rollout.tensor_parallel_size 2 needs rollout.gpus_per_worker 2 \(a GPU per "
            r"rank\), got 1.0$",
        ),
        (
            ["--rollout.weight_sync", "nccl", "--rollout.gpus_per_worker", "1"],
            r"^rollout.weight_sync nccl needs GPUs on both ends: learner.gpus 0.0, "
            r"rollout.gpus_per_worker 1.0$",
        ),
        (
            [
                *["--rollout.weight_sync", "gloo", "--rollout.tensor_parallel_size", "2"],
                *["--rollout.gpus_per_worker", "2"],
            ],
            r"^rollout.weight_sync gloo with rollout.tensor_parallel_size > 1: ",
        ),
        (["--learner.lr", ".inf"], r"^learner.lr must be finite, got inf$"),
        (["--rollout.temperature", ".nan"], r"^rollout.temperature must be finite, got nan$"),
        (["--algorithm.clip_high=-.inf"], r"^algorithm.clip_high must be finite, got -inf$"),
        (
            ["--reward.functions", "[{name: a, schedule: [[0, .nan]]}]"],
            r"^reward.functions\[0\].schedule\[0\]\[1\] must be finite, got nan$",
        ),
    ],
)
def test_validate_names_the_bad_field(argv, message, monkeypatch):
    monkeypatch.delenv("RLRAY_AGENT_TOKEN", raising=False)
    config = parse_command_line(argv).config
    with pytest.raises(ConfigError, match=message):
        validate(config)


@pytest.mark.parametrize(
    ("argv", "chosen"),
    [
        ([], "object_store"),  # CPU learner and workers
        (["--learner.gpus", "1"], "object_store"),  # CPU workers
        (["--rollout.gpus_per_worker", "1"], "object_store"),  # CPU learner
        (["--learner.gpus", "1", "--rollout.gpus_per_worker", "1"], "nccl"),
        (["--rollout.weight_sync", "gloo"], "gloo"),
        (["--rollout.weight_sync", "object_store", "--learner.gpus", "1"], "object_store"),
    ],
)
def test_weight_sync_auto_is_nccl_between_gpus_only(argv, chosen):
    config = parse_command_line(argv).config
    validate(config)
    assert weight_sync(config) == chosen


def test_lora_fields_parse_from_the_command_line():
    argv = ["--model", "m", "--model.lora.rank", "8", "--model.lora.target_modules", "[q_proj]"]
    lora = parse_command_line(argv).config.model.lora
    assert (lora.rank, lora.alpha, lora.target_modules) == (8, 16.0, ["q_proj"])
    assert parse_command_line([]).config.model.lora.rank == 0  # off by default


def test_every_float_field_must_be_finite():
    floats = [(d, k) for d, k, _, _ in settable_fields() if k is float or k == float | None]
    assert len(floats) > 20
    for dotted, _ in floats:
        section, _, name = dotted.rpartition(".")
        config = Config()
        target = functools.reduce(getattr, section.split("."), config) if section else config
        setattr(target, name, math.nan)
        with pytest.raises(ConfigError, match=rf"^{re.escape(dotted)} must be finite, got nan$"):
            validate(config)
    config = Config()
    config.reward.functions[0].weight = math.inf
    with pytest.raises(ConfigError, match=r"^reward.functions\[0\].weight must be finite"):
        validate(config)


def test_resume_reads_the_runs_own_config(tmp_path):
    (tmp_path / "config.yaml").write_text(f"run_dir: {tmp_path}\nseed: 3\nlearner:\n  steps: 4\n")
    command = parse_command_line(["--resume", str(tmp_path), "--learner.steps", "8"])
    assert command.resume_dir == tmp_path
    assert command.config.seed == 3
    assert command.config.learner.steps == 8
    with pytest.raises(ConfigError, match=r"no config\.yaml"):
        parse_command_line(["--resume", str(tmp_path / "missing")])
    with pytest.raises(ConfigError, match=r"^--resume takes the run's own config\.yaml"):
        parse_command_line(["--resume", str(tmp_path), "--config", str(tmp_path / "config.yaml")])
    with pytest.raises(ConfigError, match=r"^--resume and --run-dir name different directories$"):
        parse_command_line(["--resume", str(tmp_path), "--run-dir", str(tmp_path / "other")])


def test_config_yaml_round_trips_through_resume(tmp_path):
    config = parse_command_line(
        ["--run-dir", str(tmp_path), "--reward.functions", "[{name: a, kwargs: {k: [1, 2]}}]"]
    ).config
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config_to_dict(config)))
    assert parse_command_line(["--resume", str(tmp_path)]).config == config


def test_tokens_stay_out_of_the_run_directory_which_only_its_owner_reads(tmp_path, monkeypatch):
    from rlray.driver.plan import RunPlan, write_config

    run_dir = tmp_path / "runs" / "secret"
    argv = ["--run-dir", str(run_dir), "--ingest.token", "s3cr3t-t0ken"]
    command = parse_command_line([*argv, "--agent.token", "s3cr3t-agent"])
    assert command.config.ingest.token == "s3cr3t-t0ken"  # the run itself has it
    assert config_to_dict(command.config)["ingest"]["token"] == ""  # what is written has not
    assert config_to_dict(command.config)["agent"]["token"] == ""
    write_config(RunPlan(command.config, run_dir, "secret", "", None, [], None))  # type: ignore[arg-type]
    written = run_dir / "config.yaml"
    assert "s3cr3t" not in written.read_text()
    assert run_dir.stat().st_mode & 0o777 == 0o700 and written.stat().st_mode & 0o777 == 0o600
    # A resumed run takes the token from the environment (or --ingest.token) again.
    monkeypatch.setenv("RLRAY_INGEST_TOKEN", "from-the-environment")
    resumed = parse_command_line(["--resume", str(run_dir)]).config
    assert resumed.ingest.token == ""
    assert ingest_token(resumed.ingest) == "from-the-environment"
    monkeypatch.setenv("RLRAY_AGENT_TOKEN", "agent-from-the-environment")
    assert agent_token(resumed.agent) == "agent-from-the-environment"
