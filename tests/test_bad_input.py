"""Bad input stops `jobs/ppo.py` with exit code 2 and one line naming the field or file,
before any actor starts: main() called in-process (no Ray), or plan_run directly."""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
from pathlib import Path

import pytest
import yaml

import rlray.driver.job
from rlray.config import Config, ConfigError, config_to_dict
from rlray.config.command_line import parse_command_line
from rlray.data.models import resolve_model_path
from rlray.driver.plan import check_machine, plan_run
from tests.jobs_helper import REPO


@pytest.fixture(scope="module")
def ppo():
    """jobs/ppo.py as a module; joining Ray fails the test (nothing may start)."""
    spec = importlib.util.spec_from_file_location("ppo_job", REPO / "jobs" / "ppo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def join_ray(*args, **kwargs):
        raise AssertionError("bad input reached Ray")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rlray.driver.job, "join_ray", join_ray)
        yield module


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    return Path(resolve_model_path(Config().model.path))


def model_copy(tiny_model: Path, where: Path) -> Path:
    target = where / "model"
    shutil.copytree(tiny_model, target)
    return target


def jsonl(path: Path, *records: dict) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def corrupt(tiny_model: Path, tmp_path: Path, how: str) -> str:
    model = model_copy(tiny_model, tmp_path)
    weights = model / "model.safetensors"
    config = json.loads((model / "config.json").read_text())
    if how == "no-weights":
        weights.unlink()
    elif how == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif how == "garbage":
        weights.write_bytes(b"\xff" * 64)
    elif how == "config-json":
        (model / "config.json").write_text("{not json")
    elif how == "non-causal":
        config["architectures"] = ["Qwen2Model"]
        (model / "config.json").write_text(json.dumps(config))
    elif how == "no-vocab":
        del config["vocab_size"]
        (model / "config.json").write_text(json.dumps(config))
    elif how == "no-chat-template":
        (model / "chat_template.jinja").unlink()
    elif how == "missing-shard":
        index = {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
        (model / "model.safetensors.index.json").write_text(json.dumps(index))
    return str(model)


BAD_INPUTS = {
    # id: (args, message); MODEL(how) and files are made by the test
    "missing-model": (["--model", "/no/such/model"], "model.path: no such model directory"),
    "unknown-field": (
        ["--algorithm.clip_hihg", "0.1"],
        "unknown config field '--algorithm.clip_hihg' (did you mean '--algorithm.clip_high'?)",
    ),
    "wrong-type": (["--learner.lr", "fast"], "learner.lr: expected float, got 'fast'"),
    "negative": (["--rollout.prompts_per_batch", "-8"], "rollout.prompts_per_batch must be > 0"),
    "lr-inf": (["--learner.lr", "inf"], "learner.lr must be finite, got inf"),
    "kl-nan": (["--algorithm.kl_coef", "nan"], "algorithm.kl_coef must be finite, got nan"),
    "kl-k3-in-reward": (
        ["--algorithm.kl_coef", "0.05", "--algorithm.kl_estimator", "k3"],
        "algorithm.kl_estimator k3 with kl_mode reward is not a KL penalty",
    ),
    "temperature-nan": (
        ["--rollout.temperature", "nan"],
        "rollout.temperature must be finite, got nan",
    ),
    "reward-import": (
        ["--reward.functions", "[{name: 'no_such_pkg.rewards:fn'}]"],
        "reward.functions[0].name (no_such_pkg.rewards:fn): cannot import no_such_pkg.rewards",
    ),
    "long-prompt": (["--data.train", "LONG"], "data.train: prompt '1+1+1+"),
    "max-model-len": (
        ["--model.max_model_len", "4096"],
        "model.max_model_len (4096) is beyond the model's own context window (64: "
        "max_position_embeddings in ",
    ),
    "no-weights": (["--model", "MODEL(no-weights)"], "holds no weights (*.safetensors or"),
    "truncated-weights": (
        ["--model", "MODEL(truncated)"],
        "model.safetensors is not readable safetensors (truncated: ",
    ),
    "garbage-weights": (["--model", "MODEL(garbage)"], "is not readable safetensors"),
    "missing-shard": (["--model", "MODEL(missing-shard)"], "weight shard "),
    "corrupt-config": (["--model", "MODEL(config-json)"], "config.json is not readable JSON"),
    "no-vocab": (["--model", "MODEL(no-vocab)"], "config.json has no positive vocab_size"),
    "non-causal": (
        ["--model", "MODEL(non-causal)"],
        "is a Qwen2Model, not a causal LM that vLLM generates with",
    ),
    "empty-prompt": (["--data.train", "EMPTY"], "empty.jsonl:2: 'prompt' is empty"),
    "unknown-task": (
        [
            "--data.train",
            "reasoning_gym:leg_countin",
            "--reward.functions",
            "[{name: reasoning_gym}]",
        ],
        "data: unknown reasoning-gym task 'leg_countin' (did you mean 'leg_counting'?)",
    ),
    "task-config": (
        ["--data.train", "reasoning_gym:leg_counting", "--data.task_config", "{legs: 3}"],
        "data.task_config: not a config of reasoning-gym's leg_counting: ",
    ),
    "question-template": (
        [
            "--data.train",
            "reasoning_gym:leg_counting",
            "--data.question_template",
            "[{role: user, content: hi}]",
        ],
        "data.question_template: no message holds {question}",
    ),
    "no-token-prompt": (
        ["--data.train", "UNTOKENIZABLE"],
        "data.train: prompt 'abc' is no tokens to the model's tokenizer",
    ),
    "not-utf8": (["--data.train", "LATIN1"], "latin1.jsonl:1: not UTF-8 text (byte 0xe9 at column"),
    "chat-unknown-role": (
        ["--data.train", "BAD_CHAT"],
        "bad_chat.jsonl:2: 'prompt' message 0 has role 'robot'; known: system, user,",
    ),
    "chat-without-template": (
        ["--model", "MODEL(no-chat-template)", "--data.train", "CHAT"],
        "/model's tokenizer has no chat template, so it cannot read prompts given as chat "
        "messages (e.g. 'user: 1+1=')",
    ),
    "run-dir-under-a-file": (["--run-dir", "FILE/run"], "run_dir: cannot create "),
    "run-dir-is-a-file": (["--run-dir", "FILE"], "run_dir: cannot create "),
    "run-dir-in-proc": (
        ["--run-dir", "/proc/rundir"],
        "run_dir: cannot create /proc/rundir: No such file or directory",
    ),
    "store-shards-fewer-than-journals": (
        ["--store.shards", "2", "--run-dir", "RUN_WITH_SHARD_2_JOURNAL"],
        "episode-journal-2 holds episodes store shard 2 had not written; run with store.shards 3",
    ),
    "config-nested-too-deep": (["--config", "DEEP_YAML"], "deep.yaml: nested too deeply"),
    "config-nested-deep": (["--config", "DEEPISH_YAML"], "deepish.yaml: nested more than 32"),
    "seed-too-large": (["--seed", "4294967296"], "seed must be <= "),
    "one-held-out-prompt": (
        ["--data.eval", "ONE_PROMPT"],
        "data.eval: 1 held-out prompt(s); an evaluation needs at least 2",
    ),
    "eval-reward-lacks-a-column": (
        ["--data.eval", "NO_ANSWERS"],
        "reward.functions[0].name (exact_match) with data.eval: ",
    ),
    "eval-best-metric-unknown": (
        ["--eval.best_metric", "reward/pass@4"],
        "eval.best_metric: no metric 'reward/pass@4'; with these settings there are "
        "reward/greedy_accuracy, exact_match/greedy_accuracy",
    ),
    "eval-pass-k-beyond-samples": (
        ["--eval.samples", "2", "--eval.pass_k", "[1, 4]"],
        "eval.pass_k[1] must be in [1, eval.samples = 2], got 4",
    ),
}


def materialise(args: list[str], tmp_path: Path, tiny_model: Path) -> list[str]:
    files = {
        "LONG": lambda: jsonl(
            tmp_path / "long.jsonl", {"prompt": "1+" * 40 + "1=", "answer": "41"}
        ),
        "EMPTY": lambda: jsonl(
            tmp_path / "empty.jsonl",
            {"prompt": "1+1=", "answer": "2"},
            {"prompt": "", "answer": ""},
        ),
        "UNTOKENIZABLE": lambda: jsonl(tmp_path / "abc.jsonl", {"prompt": "abc", "answer": "1"}),
        "LATIN1": lambda: _write(
            tmp_path / "latin1.jsonl", b'{"prompt": "caf\xe9", "answer": "1"}\n'
        ),
        "CHAT": lambda: jsonl(
            tmp_path / "chat.jsonl",
            {"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"},
        ),
        "BAD_CHAT": lambda: jsonl(
            tmp_path / "bad_chat.jsonl",
            {"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"},
            {"prompt": [{"role": "robot", "content": "1+1="}], "answer": "2"},
        ),
        "ONE_PROMPT": lambda: jsonl(tmp_path / "one.jsonl", {"prompt": "1+1=", "answer": "2"}),
        "NO_ANSWERS": lambda: jsonl(
            tmp_path / "plain.jsonl", {"prompt": "1+1="}, {"prompt": "2+2="}
        ),
        "DEEP_YAML": lambda: _write(tmp_path / "deep.yaml", b"a: " + b"[" * 3000 + b"]" * 3000),
        "DEEPISH_YAML": lambda: _write(tmp_path / "deepish.yaml", b"a: " + b"[" * 40 + b"]" * 40),
        "RUN_WITH_SHARD_2_JOURNAL": lambda: _journal_of_shard(tmp_path / "earlier", 2),
        "FILE": lambda: _write(tmp_path / "file", b"x"),
        "FILE/run": lambda: _write(tmp_path / "file", b"x") + "/run",
    }
    out = []
    for arg in args:
        if arg.startswith("MODEL("):
            arg = corrupt(tiny_model, tmp_path, arg[6:-1])
        elif arg in files:
            arg = files[arg]()
        out.append(arg)
    return out


def _journal_of_shard(run_dir: Path, shard: int) -> str:
    """A run directory whose store shard `shard` left an append it had not written."""
    journal = run_dir / f"episode-journal-{shard}"
    journal.mkdir(parents=True)
    (journal / "000000000000-k.arrow").write_bytes(b"")
    return str(run_dir)


def _write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


@pytest.mark.parametrize(("args", "message"), BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_input_is_one_line_exit_2_before_any_actor(
    ppo, tiny_model, tmp_path, capsys, args, message
):
    args = materialise(args, tmp_path, tiny_model)
    run_dir = [] if "--run-dir" in args else ["--run-dir", str(tmp_path / "run")]
    assert ppo.main([*args, *run_dir]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("ppo.py: error: ")
    assert message in lines[0]
    assert not (tmp_path / "run").exists()  # nothing started, nothing written


def test_prompts_that_lose_characters_are_warned_about_once_with_an_example(tmp_path, caplog):
    prompts = [{"prompt": f"1+{i}=", "answer": str(i + 1)} for i in range(5)]
    prompts[2]["prompt"], prompts[4]["prompt"] = "1+1= ça", "2+2= ?"
    train = jsonl(tmp_path / "train.jsonl", *prompts)
    config = parse_command_line(["--data.train", train, "--run-dir", str(tmp_path / "run")]).config
    with caplog.at_level(logging.WARNING, logger="rlray.driver.plan"):
        plan_run(config, None)
    warnings = [r.getMessage() for r in caplog.records if "lose characters" in r.getMessage()]
    assert warnings == [
        "warning: data.train: 2 of 5 prompts lose characters to the model's tokenizer, "
        "e.g. '1+1= ça' reads as '1+1='"
    ]


def test_the_context_window_check_follows_vllm_rope_scaling(tiny_model, tmp_path):
    model = model_copy(tiny_model, tmp_path)
    config = json.loads((model / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "linear", "factor": 4.0}
    (model / "config.json").write_text(json.dumps(config))
    from rlray.data.models import model_limits

    assert model_limits(str(model), 256).max_model_len == 256
    with pytest.raises(ConfigError, match=r"\(256: max_position_embeddings x RoPE factor 4.0"):
        model_limits(str(model), 257)


@pytest.fixture(scope="module")
def eval_job():
    """jobs/eval.py as a module; starting an engine fails the test (nothing may start)."""
    spec = importlib.util.spec_from_file_location("eval_job", REPO / "jobs" / "eval.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def engine(*args, **kwargs):
        raise AssertionError("bad input reached vLLM")

    module.RolloutWorker = engine
    return module


def test_eval_job_bad_input_is_one_line_exit_2(eval_job, tmp_path, capsys):
    unfinished_run = tmp_path / "run"
    (unfinished_run / "checkpoints").mkdir(parents=True)
    cases = {
        "no model": ([], "error: name at least one model to evaluate (usage: eval.py MODEL"),
        "twice": (
            ["builtin:tiny-arithmetic"] * 2,
            "model 'builtin:tiny-arithmetic' is named twice",
        ),
        "no such model": (["/no/such/model"], "/no/such/model: no such model directory"),
        "no checkpoint": ([str(unfinished_run)], "a run directory without a complete checkpoint"),
        "bad field": (
            ["builtin:tiny-arithmetic", "--eval.samples", "-1"],
            "eval.samples must be >= 0, got -1",
        ),
    }
    for name, (args, message) in cases.items():
        assert eval_job.main([*args, "--out", str(tmp_path / "out")]) == 2, name
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("eval.py: error: "), (name, lines)
        assert message in lines[0], (name, lines)
    assert not (tmp_path / "out").exists()


def test_resume_without_a_checkpoint_that_verifies_is_one_line_exit_2(ppo, tmp_path, capsys):
    from rlray.config import config_to_dict
    from tests.test_checkpoints import saved_checkpoint

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(json.dumps(config_to_dict(Config())))
    trainer_state = saved_checkpoint(run, 2) / "trainer_state.pt"
    trainer_state.write_bytes(trainer_state.read_bytes()[:3])
    assert ppo.main(["--resume", str(run)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"ppo.py: error: --resume: no complete checkpoint under {run}/checkpoints: "
        f"step-000002: {trainer_state} has 3 bytes, 11 when saved (truncated?)"
    ]


def test_workers_and_a_kv_cache_this_machine_cannot_hold_are_refused(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # a new local Ray on this machine
    workers = Config()
    workers.rollout.num_workers = 1000
    with pytest.raises(ConfigError, match=r"^rollout.num_workers 1000: this machine has \d+ CPU"):
        check_machine(workers)
    cache = Config()
    cache.rollout.kv_cache_gib = 1_000_000
    with pytest.raises(ConfigError, match=r"^rollout.kv_cache_gib 1000000: 1 rollout worker"):
        check_machine(cache)
    cache.ray.address = "ray://head:10001"  # a cluster's nodes decide
    check_machine(cache)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            ["--algorithm.advantage", "gae"],
            "--resume: algorithm.advantage (a critic or none) was False in ",
        ),
        (["--model.lora.rank", "4"], "--resume: model.lora was off in "),
        (
            ["--model.path", "builtin:tiny-countdown"],
            "--resume: model.path was builtin:tiny-arithmetic",
        ),
    ],
)
def test_a_resume_whose_overrides_change_what_its_checkpoints_hold_is_refused(
    tmp_path, override, message
):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(config_to_dict(Config())))
    command = parse_command_line(["--resume", str(run), *override])
    with pytest.raises(ConfigError) as refused:
        plan_run(command.config, command.resume_dir)
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)
    assert str(refused.value).endswith("start a new run")


def test_a_resume_that_turns_kl_on_goes_past_the_override_check(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(config_to_dict(Config())))
    command = parse_command_line(["--resume", str(run), "--algorithm.kl_coef", "0.05"])
    with pytest.raises(ConfigError, match=r"^--resume: no complete checkpoint under"):
        plan_run(command.config, command.resume_dir)
