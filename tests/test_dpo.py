"""DPO on the engine, with the embedded tiny model: the loss starts at ln 2 (policy =
reference), the update's gradient is exactly the DPO loss's, and training on a fixed
batch raises the implicit reward margin and accuracy (for IPO too). jobs/dpo.py on a
pair file raises held-out exact match, and a group of 2 learners takes its steps."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlray.config import Config
from rlray.data.models import resolve_model_path
from rlray.data.preferences import PreferencePair, preference_batches
from rlray.learner.engine import Engine
from rlray.learner.engine_settings import EngineSettings
from rlray.learner.preference import DpoTrainer
from tests.jobs_helper import REPO

PAIRS = [
    PreferencePair("12+34=", "46", "57"),
    PreferencePair("7+8=", "15", "1"),
    PreferencePair("30+41=", "71", "7100"),
    PreferencePair("5+5=", "10", "55"),
]


@pytest.fixture(scope="module")
def model_path() -> str:
    return resolve_model_path(Config().model.path)


def make_trainer(model_path: str, lr: float = 1e-3, **settings) -> DpoTrainer:
    from transformers import AutoTokenizer

    engine = Engine(model_path, EngineSettings(lr=lr, micro_batch_size=3, with_reference=True))
    return DpoTrainer(engine, AutoTokenizer.from_pretrained(model_path), **settings)


def test_pairs_become_chosen_rows_then_rejected_rows_ending_in_eos(model_path):
    trainer = make_trainer(model_path)
    batch = trainer.token_batch(PAIRS[:2])
    tok = trainer.tokenizer
    completions = [batch.completion_ids[i][batch.mask[i].bool()].tolist() for i in range(4)]
    texts = ["46", "15", "57", "1"]
    assert completions == [
        [*tok(t, add_special_tokens=False).input_ids, tok.eos_token_id] for t in texts
    ]


def test_the_loss_starts_at_ln2_with_the_policy_equal_to_its_reference(model_path):
    trainer = make_trainer(model_path, label_smoothing=0.2)
    metrics = trainer.evaluate(PAIRS)
    assert metrics["loss"] == pytest.approx(math.log(2.0), abs=1e-6)
    assert metrics["reward_margin"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["accuracy"] == 0.0  # no pair is ranked yet (h = 0)


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("loss", ["sigmoid", "ipo"])
def test_the_updates_gradient_is_the_dpo_losss_gradient(model_path, loss):
    trainer = make_trainer(model_path, loss=loss, beta=0.5, label_smoothing=0.1)
    trainer.step(PAIRS)  # move off the reference, so that h and the weights are not trivial
    engine, batch = trainer.engine, trainer.token_batch(PAIRS)
    # The true loss, with gradients through every row at once.
    reference = trainer._sequence_logprobs(engine.reference_logprobs(batch), batch.mask)
    policy = trainer._sequence_logprobs(engine.forward(batch).logp, batch.mask)
    trainer.scores(policy, reference).loss.mean().backward()
    want = gradients(engine.policy)
    # The surrogate the update uses, one micro-batch of rows at a time.
    with torch.no_grad():
        current = trainer._sequence_logprobs(engine.forward(batch).logp, batch.mask)
    weights = trainer.row_weights(current, reference)
    surrogate = trainer._surrogate(batch, weights)
    for rows in torch.arange(batch.size).split(3):
        outputs = engine.forward(batch.rows(rows))
        surrogate(outputs, rows, None)[0].backward()
    got = gradients(engine.policy)
    assert got.keys() == want.keys()
    for name, value in want.items():
        # Summation order moves a few tiny elements, where the median gradient is 1.3e-2:
        # with every row run whole, by up to 3e-8 on an AVX2 machine and 2.3e-7 on an
        # AVX-512 one; by up to 1.6e-6 (AVX-512) now that a pair's prompt runs once for
        # both of its rows where a micro-batch holds both (engine.shared_prompts).
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("loss", ["sigmoid", "ipo"])
def test_training_on_a_fixed_batch_raises_the_margin_and_accuracy(model_path, loss):
    # IPO's squared loss oscillates at the sigmoid's rate on this batch (measured: its
    # accuracy went 0.75, 0.25, 1.0, 1.0, 0.75 over its first steps at 1e-3).
    lr = 1e-3 if loss == "sigmoid" else 3e-4
    trainer = make_trainer(model_path, lr=lr, loss=loss, beta=0.5)
    before = trainer.evaluate(PAIRS)
    history = [trainer.step(PAIRS) for _ in range(6)]
    after = trainer.evaluate(PAIRS)
    assert after["accuracy"] == 1.0
    assert all(math.isfinite(h["grad_norm"]) and h["grad_norm"] > 0 for h in history)
    if loss == "sigmoid":
        assert after["loss"] < before["loss"]
        assert after["reward_margin"] > before["reward_margin"] + 0.5
        return
    # IPO regresses each margin h onto 1/(2 beta) = 1 per token, where its implicit
    # reward margin is beta * h = 0.5: the loss nears 0 and the margins do not overshoot.
    assert after["loss"] < 0.1 * before["loss"]
    assert 0.25 < after["reward_margin"] - before["reward_margin"] < 1.0
    batch = trainer.token_batch(PAIRS)
    policy, reference = trainer._logprobs(batch)
    margins = trainer.scores(policy, reference).margins
    assert (margins < 2.0).all()


def run_dpo(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "jobs/dpo.py", *args]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def records_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def dpo_runs(job_env, tmp_path_factory) -> dict[str, Path]:
    """jobs/dpo.py on a pair file (the built-in pairs written out, as a user brings
    pairs): 20 steps in one learner, and its first 4 steps in a group of 2 learners (Ray
    actors on the test session's cluster), evaluated and checkpointed at step 4 both."""
    root = tmp_path_factory.mktemp("dpo")
    batches, _ = preference_batches(Config())
    pairs = root / "pairs.jsonl"
    pairs.write_text(
        "".join(json.dumps(p.to_json()) + "\n" for step in range(1, 21) for p in batches(step))
    )
    common = ["--data.train", str(pairs), "--learner.lr", "1e-4", "--learner.eval_every", "4"]
    common += ["--learner.checkpoint_every", "4"]
    runs = {"single": ["--learner.steps", "20"], "group": ["--learner.steps", "4"]}
    runs["group"] += ["--learner.num_workers", "2"]
    for name, args in runs.items():
        result = run_dpo([*common, *args, "--run-dir", str(root / name)], job_env)
        assert result.returncode == 0, result.stderr[-3000:]
    return {name: root / name for name in runs}


@pytest.mark.slow
def test_dpo_job_on_a_pair_file_raises_held_out_exact_match(dpo_runs):
    run_dir = dpo_runs["single"]
    records = records_of(run_dir)
    assert [r["step"] for r in records] == list(range(1, 21))
    assert records[0]["loss"] == pytest.approx(math.log(2.0), abs=1e-6)  # policy = reference
    assert records[-1]["loss"] < math.log(2.0) and records[-1]["accuracy"] > 0.5
    summary = json.loads((run_dir / "summary.json").read_text())
    before, after = summary["initial_eval"], summary["final_eval"]
    # Measured: 0.155 -> 0.250 greedy exact match on 200 held-out prompts, and 0.345 ->
    # 0.370 from a tiny model built on another machine (one that starts better).
    assert after["exact_match"] > before["exact_match"]
    assert after["pairs/loss"] < before["pairs/loss"] and after["pairs/accuracy"] > 0.5
    # The checkpoint is an HF model with its tokenizer, as jobs/ppo.py's.
    policy = run_dir / "checkpoints" / "step-000020" / "policy"
    assert (run_dir / "checkpoints" / "latest").read_text() == "step-000020"
    assert (policy / "config.json").is_file() and (policy / "tokenizer_config.json").is_file()


@pytest.mark.slow
def test_a_group_of_two_learners_takes_the_steps_one_learner_takes(dpo_runs):
    from transformers import AutoModelForCausalLM

    single, group = records_of(dpo_runs["single"])[:4], records_of(dpo_runs["group"])
    assert [r["step"] for r in group] == [1, 2, 3, 4]
    for want, got in zip(single, group, strict=True):
        # At step 1 the policy is its reference and every margin is rounding (|h| of
        # 1e-8): which pairs count as ranked then depends on the order of summation,
        # which differs where one learner runs each pair's prompt once for both rows.
        keys = ("loss", "reward_margin", "grad_norm") + (("accuracy",) if want["step"] > 1 else ())
        for key in keys:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
    evaluation, wanted = group[3]["eval"], single[3]["eval"]
    for key in ("pairs/loss", "pairs/reward_margin", "pairs/accuracy"):
        assert evaluation[key] == pytest.approx(wanted[key], rel=1e-4, abs=1e-6), key
    assert evaluation["exact_match"] == pytest.approx(wanted["exact_match"], abs=0.011)
    assert json.loads((dpo_runs["group"] / "summary.json").read_text())["learners"] == 2
    # The group's checkpoint: a whole HF policy, the one learner's weights, and an
    # optimizer shard from each learner.
    step = Path("checkpoints") / "step-000004"
    weights = [
        AutoModelForCausalLM.from_pretrained(dpo_runs[name] / step / "policy").state_dict()
        for name in ("single", "group")
    ]
    for name, value in weights[0].items():
        assert torch.allclose(weights[1][name], value, atol=2e-5, rtol=0), name
    shards = sorted(p.name for p in (dpo_runs["group"] / step / "optimizer").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--preference.label_smoothing", "0.5"], "preference.label_smoothing must be in [0, 0.5)"),
        (["--preference.loss", "ipo", "--preference.label_smoothing", "0.1"], "sigmoid loss only"),
        (["--data.train", "builtin:multiplication"], "the built-in preference pairs are"),
    ],
)
def test_dpo_job_bad_input_is_one_line_exit_2(args, message):
    result = run_dpo(args)
    assert result.returncode == 2
    assert result.stderr.startswith("dpo.py: error: ") and message in result.stderr
    assert result.stderr.count("\n") == 1


def test_dpo_job_names_the_bad_pair(tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "1+1=", "chosen": "2", "rejected": 3}) + "\n")
    result = run_dpo(["--data.train", str(pairs)])
    assert result.returncode == 2
    problem = "'rejected' must be a string for a text prompt, got int"
    assert result.stderr == f"dpo.py: error: {pairs}: pair 1: {problem}\n"
