"""`python jobs/ppo.py` end to end on real Ray and real vLLM: learning, reproducibility,
resume and bad input (`ray job submit` to a running cluster: tests/test_cluster_commands.py,
which runs the lines of docs/preference-learning.md)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

from rlray.cluster.telemetry import METRICS
from rlray.core.checkpoints import checkpoint_version
from rlray.core.evaluation import metric_names
from rlray.core.idle_cores import board_folder
from tests.jobs_helper import (
    REPO,
    SHORT_RUN,
    metrics,
    run_job,
    run_jobs_at_once,
    scrape,
    series_name,
)
from tests.test_learner import plain_logprob_gap

TRAINING_VALUES = (
    "reward_mean",
    "policy_loss",
    "entropy",
    "clip_fraction",
    "grad_norm",
    "advantage_abs_mean",
)


@pytest.fixture(scope="module")
def five_step_runs(job_env, tmp_path_factory):
    """A 5-step run; the same run colocated (the learner and its engine in one process);
    a 4-step colocated run of 2 learners, each with its own engine; and a 3-step run of
    the same config and seed with a group of 2 learners sending weights through vLLM's
    weight transfer (gloo), run at the same time (their timings differ, their steps must
    not), that is then resumed to step 5 with 1 learner and the object store."""
    root = tmp_path_factory.mktemp("runs")
    # The learner trains on the rollout worker's core while it waits for weights
    # (learner.borrow_idle_cores): thread counts change no step beyond float rounding.
    runs = {"a": ["--learner.steps", "5", "--learner.borrow_idle_cores", "true"]}
    # A learning rate that moves run a's greedy accuracy by more than one prompt in five
    # steps, which the tests of its evaluation need: the embedded model differs by the
    # CPU kind that built it, and on a 2-core AVX-512 Xeon's copy five steps at the
    # default 5e-5 left it at 0.400 (1e-4: 0.425, 2e-4: 0.225; measured).
    common = ["--learner.lr", "2e-4"]
    runs["resumed"] = ["--learner.steps", "3"]
    runs["resumed"] += ["--learner.num_workers", "2", "--rollout.weight_sync", "gloo"]
    # In-flight updates on: a colocated engine never runs while its learner trains, so
    # they change nothing (RolloutConfig.in_flight_updates).
    runs["colocated"] = ["--learner.steps", "5", "--ray.placement", "colocated"]
    runs["colocated"] += ["--rollout.in_flight_updates", "true"]
    # Accepted and called at every turn; on CPU the state is in host memory already.
    runs["colocated"] += ["--learner.offload_optimizer", "true"]
    # A reward actor of its own, where run a's store process scores: the same scores.
    runs["colocated"] += ["--reward.num_workers", "1"]
    # A colocated group: two learners, each in the process of its own engine; a CPU each;
    # two batches a step, one for each engine.
    runs["colocated-group"] = ["--learner.steps", "4", "--ray.placement", "colocated"]
    runs["colocated-group"] += ["--learner.num_workers", "2", "--rollout.num_workers", "2"]
    runs["colocated-group"] += ["--rollout.prompts_per_batch", "4"]
    runs["colocated-group"] += ["--learner.cpus", "0.5", "--rollout.cpus_per_worker", "0.5"]
    results = run_jobs_at_once(
        [
            [*SHORT_RUN, *common, *args, "--run-dir", str(root / name)]
            for name, args in runs.items()
        ],
        job_env,
    )
    done = dict(zip(runs, results, strict=True))
    for result in results:
        assert result.returncode == 0, result.stderr[-3000:]
    plant_truncated_checkpoint(root / "resumed", 4)
    resume = ["--resume", str(root / "resumed"), "--learner.steps", "5"]
    resume += ["--learner.num_workers", "1", "--rollout.weight_sync", "object_store"]
    done["resume"] = run_job(resume, job_env)
    assert done["resume"].returncode == 0, done["resume"].stderr[-3000:]
    return root, done


def plant_truncated_checkpoint(run_dir: Path, version: int) -> Path:
    """Copies the run's latest checkpoint as the newer `version`, its weights truncated
    as a crash or a full disk leaves them, and points checkpoints/latest at it; returns
    the truncated file."""
    root = run_dir / "checkpoints"
    copy = root / f"step-{version:06d}"
    shutil.copytree(root / (root / "latest").read_text().strip(), copy)
    state = json.loads((copy / "state.json").read_text())
    (copy / "state.json").write_text(json.dumps({**state, "version": version, "step": version}))
    weights = copy / "policy" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    (root / "latest").write_text(copy.name)
    return weights


def stored_episodes(run_dir: Path) -> list:
    """Returns every episode the run stored (its episode store under run_dir/episodes)."""
    import rlray.episodes
    from rlray.core.episode import from_table

    return from_table(rlray.episodes.read(str(run_dir / "episodes")))


def load_policy(path: str | Path):
    """Returns the float32 transformers model saved at `path`, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    """Returns the HF policy directory of the run's checkpoint of `step`."""
    return run_dir / "checkpoints" / f"step-{step:06d}" / "policy"


@pytest.mark.slow
def test_short_run_advances_policy_and_keeps_logprob_parity(five_step_runs):
    from rlray.config import Config
    from rlray.data.models import resolve_model_path

    root, done = five_step_runs
    records = metrics(root / "a")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert [r["policy_version"] for r in records] == [1, 2, 3, 4, 5]
    # Strict on-policy: every batch was made by the weights the learner had.
    assert all(r["staleness_mean"] == 0 for r in records)
    assert all(r["worker_policy_versions"] == {"rollout-0": r["step"] - 1} for r in records)
    # Every sync left the rollout worker holding the learner's new version.
    assert all(r["weight_versions_loaded"] == {"rollout-0": r["step"]} for r in records)
    assert all(r["weight_sync"] == "object_store" for r in records)  # CPUs: auto
    # After every sync vLLM's sampled-token logprobs equal the learner's.
    assert all(
        r["logprob_parity_error"] is not None and r["logprob_parity_error"] <= 1e-4 for r in records
    )
    # And equal a plain transformers forward pass of the same weights, which the learner
    # has no part in: the base model's for version 0, and no longer for later versions
    # (measured: 0.8 to 5 nats away), so generation followed each sync.
    episodes = stored_episodes(root / "a")
    by_version = {v: [e for e in episodes if e.policy_version == v] for v in range(5)}
    assert all(len(batch) == 32 for batch in by_version.values())
    base = load_policy(resolve_model_path(Config().model.path))
    assert plain_logprob_gap(base, by_version[0]) <= 1e-4
    assert all(plain_logprob_gap(base, by_version[v]) > 0.1 for v in range(1, 5))
    summary = json.loads((root / "a" / "summary.json").read_text())
    assert summary["steps"] == 5 and summary["episodes"] == 5 * 32
    assert f"run directory: {root / 'a'}" in done["a"].stdout
    # The console shows rlray's lines; vLLM's chatter is in the run's log files.
    console = done["a"].stdout + done["a"].stderr
    assert "FutureWarning" not in console and "RolloutActor pid=" not in console, console
    assert "vllm" in (root / "a" / "logs" / "rollout-0.log").read_text().lower()


def greedy_accuracy(
    policy_dir: str | Path, rows: list, max_new_tokens: int
) -> tuple[float, list[str]]:
    """Returns exact-match accuracy of transformers' greedy decoding of the rows' prompts,
    and the completions."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    model = load_policy(policy_dir)
    completions = []
    for row in rows:
        ids = torch.tensor([tokenizer(row.prompt).input_ids])
        with torch.no_grad():
            out = model.generate(
                ids,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        completions.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    right = [
        c.strip() == str(r.columns["answer"]).strip()
        for c, r in zip(completions, rows, strict=True)
    ]
    return sum(right) / len(rows), completions


@pytest.mark.slow
def test_held_out_accuracy_is_greedy_exact_match_of_the_synced_policy(five_step_runs):
    from rlray.config import Config
    from rlray.config.command_line import parse_command_line
    from rlray.data.models import resolve_model_path
    from rlray.data.prompts import eval_rows

    root, done = five_step_runs
    config = parse_command_line(SHORT_RUN).config
    rows = eval_rows(config.data)
    assert len(rows) == 40
    lines = (root / "a" / "metrics.jsonl").read_text().splitlines()
    evals = [r for r in map(json.loads, lines) if r.get("eval_accuracy") is not None]
    assert [(r["step"], r.get("eval_policy_version", r["policy_version"])) for r in evals] == [
        (0, 0),
        (5, 5),
    ]
    summary = json.loads((root / "a" / "summary.json").read_text())
    assert [r["eval_accuracy"] for r in evals] == [
        summary["initial_eval_accuracy"],
        summary["final_eval_accuracy"],
    ]
    # Recomputed with transformers from the weights vLLM evaluated (the base model, the
    # step-5 checkpoint). Measured equal; one example's slack for a greedy near-tie
    # between vLLM's and transformers' float32 arithmetic.
    max_new = config.rollout.max_new_tokens
    initial, _ = greedy_accuracy(resolve_model_path(Config().model.path), rows, max_new)
    final, completions = greedy_accuracy(checkpoint_dir(root / "a", 5), rows, max_new)
    assert summary["initial_eval_accuracy"] == pytest.approx(initial, abs=1 / 40 + 1e-9)
    assert summary["final_eval_accuracy"] == pytest.approx(final, abs=1 / 40 + 1e-9)
    # Measured 0.400 -> 0.225 (see five_step_runs): the slack cannot hide an evaluation
    # of the wrong weights.
    assert abs(final - initial) > 1 / 40
    # The examples printed with the final accuracy are the first rows' completions.
    shown = "; ".join(
        f"{r.prompt}{c!r} (want {r.columns['answer']})"
        for r, c in zip(rows, completions, strict=True)
    )
    line = re.search(r"^eval  step    5 .* e\.g\. (.*)$", done["a"].stdout, re.M)
    assert line and shown.startswith(line.group(1)), (line, shown)


@pytest.mark.slow
def test_each_step_says_where_its_time_went_and_the_run_its_memory(five_step_runs):
    from rlray.observe.timing import PHASES

    root, done = five_step_runs
    lines = (root / "a" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    for record in records:
        split = record["phase_seconds"]
        assert set(split) == {*PHASES, "other", "total"}
        assert min(split.values()) >= 0
        assert sum(v for k, v in split.items() if k != "total") == pytest.approx(split["total"])
        # Every step syncs (sync_every 1); checkpoints land where they ran, evaluations
        # where the driver waited for them: step 0's ran beside step 1's training
        # (eval.beside_training), the last one (step 5's) after its step.
        assert split["weight_sync"] > 0
        assert split["parity_check"] == 0  # max_staleness 0: each batch shows parity
        assert (split["evaluation"] > 0) == (record["step"] in (1, 5))
        assert (split["checkpoint"] > 0) == ("checkpoint" in record)
        assert record["memory_gib"] > 0.3  # at least vLLM's process
    for record in records[1:]:  # learner steps: some generation, scoring and training
        assert record["phase_seconds"]["training"] > 0
        assert record["phase_seconds"]["generation"] + record["phase_seconds"]["scoring"] > 0
    summary = json.loads((root / "a" / "summary.json").read_text())
    totals = summary["phase_seconds"]
    assert totals["training"] == pytest.approx(sum(r["phase_seconds"]["training"] for r in records))
    assert totals["total"] <= summary["wall_seconds"] + 1.0
    assert summary["memory_peak_gib"] >= max(r["memory_gib"] for r in records)
    # The peak, split by process: the driver and the actors by name, Ray's by its own.
    shares = summary["memory_peak_by_process_gib"]
    # The store's process holds the buffer and scores (reward.num_workers 0); its one
    # reward, a built-in, runs there too: no child process.
    assert {"driver", "rollout-0", "learner", "store+buffer+reward"} <= set(shares)
    assert not any(name.endswith("child") for name in shares), shares
    assert sum(shares.values()) == pytest.approx(summary["memory_peak_gib"])
    placement = json.loads((root / "a" / "placement.json").read_text())
    assert placement["reward"]["pid"] == placement["store"]["pid"]
    # The learner's padding: what every step's passes computed beyond their tokens.
    computed = sum(r["learner_tokens_computed"] for r in records[1:])
    padding = sum(r["learner_padding_tokens"] for r in records[1:])
    assert computed > padding > 0  # answers of 1 to 3 digits pad a little
    assert summary["learner_padding_share"] == pytest.approx(padding / computed)
    # Tokens computed on the rollout worker's lent core: as many as the worker's idle
    # spells allowed, and the run's board of idle cores gone with the run.
    borrowed = sum(r["learner_borrowed_tokens"] for r in records[1:])
    assert 0 <= borrowed <= computed
    assert summary["learner_borrowed_share"] == pytest.approx(borrowed / computed)
    assert not board_folder(stored_episodes(root / "a")[0].run_id).exists()
    assert re.search(r"^time: \w+ \d+ s \(\d+%\)", done["a"].stdout, re.M), done["a"].stdout
    assert re.search(r"^memory: peak \d+\.\d\d GiB", done["a"].stdout, re.M)


@pytest.mark.slow
def test_a_group_of_two_learners_takes_the_steps_one_learner_takes(five_step_runs):
    root, _ = five_step_runs
    # The first three steps of the run that was later resumed, made by 2 learners
    # (FSDP2-sharded, each with its share of the tokens), before its resume; their
    # weights reached vLLM through its weight-transfer engine, gathered one tensor at a
    # time by both learners and broadcast by rank 0.
    first, second = metrics(root / "a")[:3], metrics(root / "resumed")[:3]
    assert [r["step"] for r in second] == [1, 2, 3]
    assert [r["weight_sync"] for r in second] == ["gloo"] * 3
    assert [r["weight_versions_loaded"] for r in second] == [{"rollout-0": s} for s in (1, 2, 3)]
    # Both learners wrote their shard of the optimizer state (torch.distributed.checkpoint
    # names a rank's file __<rank>_0).
    optimizer = root / "resumed" / "checkpoints" / "step-000003" / "optimizer"
    assert sorted(p.name for p in optimizer.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    for one, two in zip(first, second, strict=True):
        # Same seed, same samples: the group's weights differ from the single learner's
        # by summation order only (~1e-6), too little to change one sampled token.
        assert one["reward_mean"] == two["reward_mean"]
        assert {k: one[k] for k in TRAINING_VALUES} == pytest.approx(
            {k: two[k] for k in TRAINING_VALUES}, rel=1e-4, abs=1e-6
        )
        assert two["logprob_parity_error"] <= 1e-4  # vLLM holds the group's weights


@pytest.mark.slow
def test_a_colocated_run_takes_the_disaggregated_runs_steps(five_step_runs):
    """The learner and its engine in one process, taking turns: the same steps as the
    run with each role in its own process, weights handed over in memory, parity after
    every sync, one process fewer."""
    root, done = five_step_runs
    assert done["colocated"].returncode == 0, done["colocated"].stderr[-3000:]
    colocated, apart = metrics(root / "colocated"), metrics(root / "a")
    assert [r["step"] for r in colocated] == [1, 2, 3, 4, 5]
    for one, two in zip(colocated, apart, strict=True):
        assert one["reward_mean"] == two["reward_mean"]
        assert {k: one[k] for k in TRAINING_VALUES} == pytest.approx(
            {k: two[k] for k in TRAINING_VALUES}, rel=1e-4, abs=1e-6
        )
        assert one["weight_sync"] == "in_memory"
        assert one["weight_versions_loaded"] == {"rollout-0": one["step"]}
        assert one["logprob_parity_error"] <= 1e-4
    placement = json.loads((root / "colocated" / "placement.json").read_text())
    assert placement["rollout-0"]["pid"] == placement["learner"]["pid"]
    summary = json.loads((root / "colocated" / "summary.json").read_text())
    assert {"rollout-0+learner", "reward-0", "store+buffer"} <= set(
        summary["memory_peak_by_process_gib"]
    )
    assert placement["reward-0"]["pid"] != placement["store"]["pid"]
    assert (
        summary["final_eval_accuracy"]
        == json.loads((root / "a" / "summary.json").read_text())["final_eval_accuracy"]
    )
    # Evaluations between steps, as colocated they all are: step 0's, the base model's,
    # is never checkpointed; the last step's is (checkpoint_every 3).
    saved = sorted(p.name for p in (root / "colocated" / "checkpoints").iterdir() if p.is_dir())
    assert saved == ["step-000003", "step-000005"]


@pytest.mark.slow
def test_a_colocated_learner_group_loads_each_engine_with_the_groups_weights(five_step_runs):
    """Each learner of a group of 2 in the process of its own engine: the FSDP2 group and
    vLLM's engines share torch.distributed's group, every engine loads the whole weights
    from its own learner in memory, and each engine's samples are the group's policy."""
    root, done = five_step_runs
    run = root / "colocated-group"
    assert done["colocated-group"].returncode == 0, done["colocated-group"].stderr[-3000:]
    records = metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for record in records:
        assert record["weight_sync"] == "in_memory"
        loaded = {"rollout-0": record["step"], "rollout-1": record["step"]}
        assert record["weight_versions_loaded"] == loaded
        assert record["logprob_parity_error"] <= 1e-4
    placement = json.loads((run / "placement.json").read_text())
    assert placement["rollout-0"]["pid"] == placement["learner"]["pid"]
    assert placement["rollout-1"]["pid"] == placement["learner-1"]["pid"]
    assert placement["rollout-0"]["pid"] != placement["rollout-1"]["pid"]
    summary = json.loads((run / "summary.json").read_text())
    assert {"rollout-0+learner", "rollout-1+learner-1"} <= set(
        summary["memory_peak_by_process_gib"]
    )
    optimizer = run / "checkpoints" / "step-000003" / "optimizer"
    assert sorted(p.name for p in optimizer.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    # The group's step-3 checkpoint, loaded by transformers alone, reproduces the
    # logprobs each engine sampled with after loading version 3, and not version 2's.
    step3 = load_policy(checkpoint_dir(run, 3))
    episodes = stored_episodes(run)
    for worker in ("rollout-0", "rollout-1"):
        mine = [e for e in episodes if e.rollout_worker == worker]
        assert plain_logprob_gap(step3, [e for e in mine if e.policy_version == 3]) <= 1e-4
        assert plain_logprob_gap(step3, [e for e in mine if e.policy_version == 2]) > 0.1


@pytest.mark.slow
def test_resumed_run_continues_where_it_stopped(five_step_runs):
    root, done = five_step_runs
    resumed = metrics(root / "resumed")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5]
    assert resumed[3]["policy_version"] == 4
    # It resumed from step 3, past the newer checkpoint whose weights were truncated,
    # and said which file it found wrong.
    truncated = root / "resumed" / "checkpoints" / "step-000004" / "policy" / "model.safetensors"
    assert f"skipped checkpoint step-000004: {truncated} has 1000 bytes" in done["resume"].stderr
    # Model, optimizer, RNG and prompt cursor all came back, from the group of 2 into
    # 1 learner (the optimizer state resharded): the resumed steps are the steps the
    # uninterrupted run took (up to the group's summation order).
    uninterrupted = metrics(root / "a")
    for one, two in zip(resumed[3:], uninterrupted[3:], strict=True):
        assert one["reward_mean"] == two["reward_mean"]
        assert {k: one[k] for k in TRAINING_VALUES} == pytest.approx(
            {k: two[k] for k in TRAINING_VALUES}, rel=1e-4, abs=1e-6
        )
    assert resumed[3]["logprob_parity_error"] <= 1e-4  # vLLM started from the checkpoint
    # ... from the checkpoint's weights themselves, loaded here by transformers alone.
    step3 = load_policy(checkpoint_dir(root / "resumed", 3))
    after_resume = [e for e in stored_episodes(root / "resumed") if e.policy_version == 3]
    assert after_resume and plain_logprob_gap(step3, after_resume) <= 1e-4


@pytest.mark.slow
def test_checkpoint_in_transformers_holds_the_weights_vllm_was_synced_with(five_step_runs):
    from transformers import AutoTokenizer

    root, _ = five_step_runs
    run = root / "a"
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-000005"
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == [
        "step-000003",
        "step-000005",
    ]
    episodes = stored_episodes(run)
    # The step-3 checkpoint, loaded by transformers alone, reproduces the logprobs vLLM
    # sampled with right after loading the learner's version-3 weights, and not those of
    # versions 2 or 4 (measured: 1.4 and 0.6 nats away): it holds version 3 itself.
    step3 = load_policy(checkpoint_dir(run, 3))
    assert step3.config.model_type == "qwen2"
    assert plain_logprob_gap(step3, [e for e in episodes if e.policy_version == 3]) <= 1e-4
    assert plain_logprob_gap(step3, [e for e in episodes if e.policy_version == 2]) > 0.1
    assert plain_logprob_gap(step3, [e for e in episodes if e.policy_version == 4]) > 0.1
    # Its tokenizer encodes prompts as vLLM did.
    tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir(run, 3))
    assert all(tokenizer(e.prompt).input_ids == e.prompt_token_ids for e in episodes[:32])


@pytest.mark.slow
def test_eval_job_compares_checkpoints_with_the_scores_their_runs_logged(
    five_step_runs, job_env, tmp_path
):
    """jobs/eval.py on the base model and two checkpoints gives each the greedy accuracy
    its run logged for that step (same prompts, same greedy decoding), and a paired
    comparison whose differences are the values' differences."""
    root, _ = five_step_runs
    run, resumed = root / "a", root / "resumed"
    models = ["builtin:tiny-arithmetic", str(resumed / "checkpoints" / "step-000003"), str(run)]
    out = tmp_path / "comparison"
    args = ["--config", str(run / "config.yaml"), "--eval.samples", "3", "--eval.pass_k", "[1, 3]"]
    result = subprocess.run(
        [sys.executable, "jobs/eval.py", *models, *args, "--out", str(out)],
        cwd=REPO,
        env=job_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    table = json.loads((out / "comparison.json").read_text())
    assert table["baseline"] == models[0] and table["models"] == models
    assert table["prompts"] == 40
    logged = [eval_accuracy(run, 0), eval_accuracy(resumed, 3), eval_accuracy(run, 5)]
    greedy = table["metrics"]["exact_match/greedy_accuracy"]
    assert [greedy[m]["value"] for m in models] == pytest.approx(logged, abs=1e-12)
    # Trained 5 steps: a comparison with something to show (up or down: five short steps
    # move the tiny model's accuracy either way, by its build).
    assert logged[2] != logged[0]
    for name, by_model in table["metrics"].items():
        base = by_model[models[0]]
        assert base["difference"] == 0 and base["difference_stderr"] == 0, name
        for model in models[1:]:
            entry = by_model[model]
            assert entry["difference"] == pytest.approx(entry["value"] - base["value"])
            assert entry["stderr"] >= 0 and entry["difference_stderr"] >= 0
    for model in models:  # binary rewards: pass@1 is the mean, pass@3 at least that
        value = {name: by_model[model]["value"] for name, by_model in table["metrics"].items()}
        assert value["reward/pass@1"] == pytest.approx(value["reward/mean"])
        assert value["reward/pass@3"] >= value["reward/pass@1"]
    markdown = (out / "comparison.md").read_text()
    assert markdown in result.stdout
    assert f"| exact_match/greedy_accuracy | {logged[0]:.3f} ± " in markdown


def eval_accuracy(run_dir: Path, step: int) -> float:
    """Returns the held-out accuracy a run logged at `step`."""
    (record,) = [r for r in read_metrics(run_dir) if r["step"] == step]
    return record["eval_accuracy"]


def read_metrics(run_dir: Path) -> list[dict]:
    """Returns every line of the run's metrics.jsonl (step 0, the first evaluation, too)."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def overlap_run(job_env, tmp_path_factory):
    """One 6-step run with two rollout workers, max_staleness 1 and in-flight weight
    updates, rewards from a config file with a user reward file, evaluations with
    samples and rewards of their own, and wandb (offline): for several tests."""
    root = tmp_path_factory.mktemp("overlap")
    rewards = root / "rewards.py"
    rewards.write_text(USER_REWARDS)
    config = root / "run.yaml"
    config.write_text(
        "reward:\n"
        "  functions:\n"
        "    - {name: exact_match, weight: 1.0}\n"
        f"    - {{name: '{rewards}:short_answers', weight: 0.5, schedule: [[0, 0.0], [2, 0.5]]}}\n"
        f"    - {{name: '{rewards}:flaky', weight: 1.0}}\n"
        "eval:\n"
        "  samples: 2\n"
        "  pass_k: [1, 2]\n"
        f"  rewards: [{{name: exact_match}}, {{name: '{rewards}:flaky'}}]\n"
        "  best_metric: exact_match/pass@2\n"
    )
    run_dir = root / "run"
    args = ["--config", str(config), *SHORT_RUN, "--learner.steps", "6", "--run-dir", str(run_dir)]
    args += ["--learner.eval_every", "2"]
    overlap = ["--rollout.num_workers", "2", "--buffer.max_staleness", "1"]
    overlap += ["--rollout.weight_sync", "gloo"]  # into both engines, one group
    overlap += ["--rollout.in_flight_updates", "true"]
    tracking = ["--tracking.wandb", "true", "--tracking.wandb_mode", "offline"]
    result = run_job([*args, *overlap, *tracking], {**job_env, "WANDB_SILENT": "true"})
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir, result, rewards


@pytest.mark.slow
def test_two_workers_with_staleness_one_overlap_generation_and_training(overlap_run):
    run_dir, _, _ = overlap_run
    records = metrics(run_dir)
    assert [r["policy_version"] for r in records] == [1, 2, 3, 4, 5, 6]
    # Generation runs ahead only as far as max_staleness allows: nothing is ever made
    # that is then too stale to train on.
    assert all(r["dropped_stale"] == 0 and r["dropped_stale_this_step"] == 0 for r in records)
    # Both workers generated, and every sync brought both to the learner's version,
    # through vLLM's weight transfer (one broadcast into both engines, which may be
    # generating: each pauses between two engine steps, loads, and goes on).
    seen = {name: version for r in records for name, version in r["worker_policy_versions"].items()}
    assert set(seen) == {"rollout-0", "rollout-1"}
    assert all(r["weight_sync"] == "gloo" for r in records)
    assert all(
        r["weight_versions_loaded"] == {"rollout-0": r["step"], "rollout-1": r["step"]}
        for r in records
    )
    # Every sync's parity is checked, on the step's own tokens after the sync (its time
    # in the split) or on the next batch where it is fresh.
    assert all(r["logprob_parity_error"] <= 1e-4 for r in records)
    assert all(r["phase_seconds"]["parity_check"] > 0 for r in records)
    # Each step trained one whole generated batch (one trained_at, one policy version)
    # at most one version older than the learner. Left untrained: only batches of
    # version 5 or later, prefetched when the run ended; nothing older was lost.
    trained: dict[float, list] = {}
    episodes = stored_episodes(run_dir)
    # An episode generated across a sync records both versions; a batch is trained before
    # the sync after next, so at most one sync lands while it is generated.
    assert all(e.policy_version <= e.last_policy_version <= e.policy_version + 1 for e in episodes)
    across = sum(e.last_policy_version > e.policy_version for e in episodes)
    assert sum(r["episodes_updated_in_flight"] for r in records) <= across
    for e in episodes:
        assert e.trained_at is not None or e.policy_version >= 5, e
        if e.trained_at is not None:
            trained.setdefault(e.trained_at, []).append(e)
    batches = [trained[t] for t in sorted(trained)]
    versions = [{e.policy_version for e in batch} for batch in batches]
    assert [len(batch) for batch in batches] == [32] * 6 and all(len(v) == 1 for v in versions)
    staleness = [step - 1 - min(v) for step, v in enumerate(versions, 1)]
    assert all(0 <= s <= 1 for s in staleness) and 1 in staleness, staleness
    assert [r["staleness_mean"] for r in records] == staleness
    assert [r["staleness_max"] for r in records] == staleness  # one version a batch
    # Measurable overlap: some batch finished generating while the learner trained the
    # step before, in [trained_at - learner_seconds, trained_at] (measured: 4 of 5 did).
    inside = [
        previous[0].trained_at - record["learner_seconds"]
        < max(e.generated_at for e in batch)
        < previous[0].trained_at
        for previous, batch, record in zip(batches, batches[1:], records, strict=False)
    ]
    assert any(inside), inside


@pytest.fixture(scope="module")
def group_run(ray_cluster, job_env, tmp_path_factory):
    """One 5-step GRPO run in bfloat16 with dynamic sampling (so that the reward workers
    count the groups they drop) and no KL, for several tests; the session cluster's
    Prometheus export is scraped every 2 s while it runs. Returns the run directory and
    the samples exported for the run, by series."""
    root = tmp_path_factory.mktemp("grpo")
    # Its own run id: the export is filtered by it, and Ray keeps exporting a finished
    # run's last gauges for a while (another run named "run" made this test fail).
    run_dir = root / "grpo-run"
    algorithm = ["--algorithm.advantage", "grpo", "--algorithm.drop_uniform_groups", "true"]
    args = [*SHORT_RUN, *algorithm, "--algorithm.kl_coef", "0", "--model.dtype", "bfloat16"]
    # Steps 2-5 leave Ray's metrics export (every 2 s here, see conftest) time to carry
    # the learner's metrics of step 1 and the evaluation of step 2.
    args += ["--learner.steps", "5", "--learner.eval_every", "2", "--run-dir", str(run_dir)]
    with (root / "job.log").open("w") as log:
        job = subprocess.Popen(
            [sys.executable, str(REPO / "jobs" / "ppo.py"), *args],
            cwd=REPO,
            env=job_env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            exported = scrape_while_running(job, ray_cluster.metrics_url, run_dir.name)
        finally:
            job.kill()
    assert job.returncode == 0, (root / "job.log").read_text()[-3000:]
    return run_dir, exported


def scrape_while_running(job: subprocess.Popen, url: str, run_id: str) -> dict[str, list]:
    """Returns {series: [(labels, value), ...]} of the run's samples at a Prometheus
    endpoint, scraped every 2 s until the job ends (at most 600 s)."""
    exported: dict[str, list] = defaultdict(list)
    deadline = time.monotonic() + 600
    while job.poll() is None and time.monotonic() < deadline:
        time.sleep(2)
        try:
            samples = scrape(url)
        except OSError:  # the head's metrics agent may not be listening yet
            continue
        for series, labels, value in samples:
            if labels.get("run_id") == run_id:
                exported[series].append((labels, value))
    return exported


@pytest.mark.slow
def test_bfloat16_run_keeps_vllm_and_learner_logprobs_close(group_run):
    records = metrics(group_run[0])
    # Measured here (bf16 vLLM against the learner's bf16 autocast over fp32 masters), per
    # step of a 150-step bf16 default run: mean |vLLM - learner| 0.007-0.016 per token,
    # max 0.09-0.46 but 1.6 once (a rare low-probability token), ratio outside [0.5, 2]
    # for at most 0.11% of tokens. A broken sync is far outside the mean bound (a stale
    # lm_head: mean > 0.5); float32 gives ~5e-7, so the lower bound shows bf16 really ran.
    for r in records:
        assert 1e-4 < r["rollout_logprob_diff_mean"] < 0.05, r
        assert r["logprob_parity_error"] < 2.5, r
        assert r["rollout_ratio_outside_share"] < 0.01, r
        assert 0.9 < r["rollout_correction_weight_mean"] < 1.1, r


@pytest.mark.slow
def test_dynamic_sampling_trains_whole_mixed_groups_and_stores_every_episode(group_run):
    run_dir, _ = group_run
    import rlray.episodes
    from rlray.core.episode import from_table

    records = metrics(run_dir)
    assert sum(r["dropped_uniform_groups"] for r in records) > 0
    # Every trained group had rewards that differ: no episode has all-zero advantages,
    # and more prompts were generated than one step's worth to fill the steps.
    assert all(r["zero_advantage_share"] == 0.0 and r["episodes"] >= 32 for r in records)
    assert sum(r["prompts_generated"] for r in records) > len(records) * 8
    episodes = from_table(rlray.episodes.read(str(run_dir / "episodes")))
    assert len({e.episode_id for e in episodes}) == len(episodes)
    groups: dict[int, list] = {}
    for e in episodes:
        groups.setdefault(e.prompt_index, []).append(e)
    trained = 0
    for members in groups.values():
        assert len(members) == 4  # every group whole, in the store too
        assert len({e.trained_at for e in members}) == 1  # trained together or not at all
        if members[0].trained_at is not None:
            assert len({e.reward for e in members}) > 1
            trained += 4
    assert trained == sum(r["episodes"] for r in records)
    uniform = [m for m in groups.values() if len({e.reward for e in m}) == 1]
    assert uniform and all(m[0].trained_at is None for m in uniform)


@pytest.mark.slow
def test_group_estimators_hold_no_critic_and_no_reference(group_run):
    run_dir, _ = group_run
    records = metrics(run_dir)
    assert all(r["value_loss"] is None and r["explained_variance"] is None for r in records)
    assert all(r["kl"] is None for r in records)
    latest = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    assert (latest / "policy").is_dir() and not (latest / "critic").exists()


@pytest.mark.slow
def test_every_metric_reaches_prometheus_with_the_values_the_run_logged(group_run):
    run_dir, exported = group_run
    wanted = {series_name(name, kind) for name, (kind, _, _) in METRICS.items()}
    assert not wanted - set(exported), f"never exported: {sorted(wanted - set(exported))}"
    records = metrics(run_dir)

    def values(name: str, kind: str = "gauge") -> list[float]:
        return [value for _, value in exported[series_name(name, kind)]]

    def logged(*values_of_steps: float):
        return lambda v: any(v == pytest.approx(w, rel=1e-6) for w in values_of_steps)

    # What the learner exported is what it logged for some step.
    for name in ("reward_mean", "logprob_parity_error", "rollout_logprob_diff_mean"):
        assert all(map(logged(*(r[name] for r in records)), values(f"rlray_{name}"))), name
    assert all(
        map(logged(*(r["learner_seconds"] for r in records)), values("rlray_learner_step_seconds"))
    )
    # Accuracy is right answers over the 40 held-out prompts (data.eval_size): k / 40.
    accuracies = [v * 40 for v in values("rlray_eval_accuracy")]
    assert all(0 <= a <= 40 and abs(a - round(a)) < 1e-4 for a in accuracies), accuracies
    assert max(values("rlray_rollout_tokens_per_second")) > 0
    assert max(values("rlray_episodes_generated", "counter")) >= 32
    assert max(values("rlray_episodes_scored", "counter")) >= 32
    assert max(values("rlray_uniform_groups_dropped", "counter")) > 0
    assert all(0 <= v <= 1024 for v in values("rlray_buffer_depth"))
    assert values("rlray_dropped_stale") and all(v == 0 for v in values("rlray_dropped_stale"))
    assert max(values("rlray_staleness", "histogram")) >= 32  # episodes observed
    assert all(v > 0 for v in values("rlray_weight_sync_seconds"))
    workers = {labels["worker"] for labels, _ in exported["ray_rlray_policy_version"]}
    assert workers == {"rollout-0", "learner"}
    assert max(values("rlray_policy_version")) >= 1


USER_REWARDS = """
def short_answers(completions, **kwargs):
    # TRL-style: keyword arguments, extra dataset columns in **kwargs.
    return [1.0 if len(c) <= 3 else 0.0 for c in completions]


def flaky(prompts, completions, answer, **kwargs):
    if any("7" in c for c in completions):
        raise ValueError("sevens are unlucky")
    return [0.0 for _ in completions]
"""


@pytest.mark.slow
def test_user_reward_file_from_a_config_runs_end_to_end(overlap_run):
    run_dir, result, rewards = overlap_run
    records = metrics(run_dir)
    names = {"exact_match", f"{rewards}:short_answers", f"{rewards}:flaky"}
    assert all(set(r["reward_components"]) >= names - {f"{rewards}:flaky"} for r in records)
    assert all(set(r["reward_failures"]) == names for r in records)
    # The flaky reward raised on some episodes; the run went on, counting them.
    assert sum(r["reward_failures"][f"{rewards}:flaky"] for r in records) > 0
    assert all(r["reward_failures"]["exact_match"] == 0 for r in records)
    assert "sevens are unlucky" in result.stdout + result.stderr  # logged once, by name
    # The breakdown reaches TensorBoard and wandb (offline), and the report is drawn.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"reward/components/exact_match", f"reward/failures/{rewards}:flaky"} <= set(tags)
    assert [e.step for e in events.Scalars("reward/mean")] == [1, 2, 3, 4, 5, 6]
    assert len(list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))) == 1
    assert (run_dir / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"report: {run_dir / 'report.png'}" in result.stdout


@pytest.mark.slow
def test_evaluations_score_with_the_eval_rewards_and_keep_the_best_checkpoint(overlap_run):
    run_dir, result, rewards = overlap_run
    evals = [r for r in read_metrics(run_dir) if "eval" in r]
    assert [r["step"] for r in evals] == [0, 2, 4, 6]
    flaky = f"{rewards}:flaky"
    # eval.rewards, not the training rewards (short_answers is not scored)
    names = metric_names(["exact_match", flaky], samples=2, ks=[1, 2])
    for r in evals:
        assert list(r["eval"]) == names and list(r["eval_stderr"]) == names
        e = r["eval"]
        assert e["exact_match/pass@1"] == pytest.approx(e["exact_match/mean"])
        assert e["exact_match/mean"] <= e["exact_match/pass@2"] <= 1
        assert e[f"{flaky}/mean"] == 0  # flaky gives 0 where it does not raise
        assert e["reward/mean"] == pytest.approx(e["exact_match/mean"])
        assert all(v >= 0 for v in r["eval_stderr"].values())
    # flaky raises on completions with a 7: their prompts are left out, not counted as 0
    assert any(0 < r["eval_prompts_left_out"] < 39 for r in evals)
    # The best evaluation by exact_match/pass@2 (the first of equals) is kept: its
    # checkpoint holds its step's weights, saved then although checkpoint_every is 3.
    best = json.loads((run_dir / "checkpoints" / "best.json").read_text())
    values = [r["eval"]["exact_match/pass@2"] for r in evals]
    first_best = values.index(max(values))
    assert best["metric"] == "exact_match/pass@2" and best["value"] == values[first_best]
    assert best["step"] == evals[first_best]["step"]
    assert best["stderr"] == evals[first_best]["eval_stderr"]["exact_match/pass@2"]
    if best["step"] == 0:
        assert best["checkpoint"] is None
    else:
        assert checkpoint_version(best["checkpoint"]) == best["step"]
        assert (Path(best["checkpoint"]) / "policy" / "config.json").is_file()
    improved = [r for i, r in enumerate(evals[1:], 1) if values[i] > max(values[:i])]
    assert all(r["checkpoint"].endswith(f"step-{r['step']:06d}") for r in improved)
    # Every evaluation but the last ran beside the next step's training
    # (eval.beside_training): the time the driver waited for it is in that step's
    # split, and the checkpoint taken for it before its verdict was kept only if it
    # improved. Each evaluated the policy of its own step all the same.
    records = {r["step"]: r for r in read_metrics(run_dir)}
    waited = [s for s, r in records.items() if r["phase_seconds"]["evaluation"] > 0]
    assert waited == [1, 3, 5, 6]
    assert [r["eval_policy_version"] for r in evals] == [0, 2, 4, 6]
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.is_dir())
    kept = {3, 6} | {r["step"] for r in improved}
    assert saved == [f"step-{s:06d}" for s in sorted(kept)]
    assert [s for s, r in records.items() if "checkpoint" in r] == sorted(kept)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["best_eval"] == best
    assert f"best: exact_match/pass@2 {best['value']:.3f} at step {best['step']}" in result.stdout
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    points = events.Scalars("eval/exact_match/pass@2")
    assert [(p.step, p.value) for p in points] == [
        (r["step"], pytest.approx(v)) for r, v in zip(evals, values, strict=True)
    ]


def test_bad_input_is_one_line_exit_2_before_any_actor(tmp_path):
    # The real command-line path, once; every other bad input is checked in-process
    # (tests/test_bad_input.py).
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    args = ["--model", "/no/such/model", "--learner.lr", "1e-5"]
    result = run_job([*args, "--run-dir", str(tmp_path / "run")], env, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "ppo.py: error: model.path: no such model directory: /no/such/model"
    ]
    assert not (tmp_path / "run").exists()  # nothing started, nothing written


def test_help_lists_fields():
    result = run_job(["--help"], timeout=120)
    assert result.returncode == 0
    assert "--algorithm.kl_estimator" in result.stdout and "KL estimator: k1" in result.stdout


def readme_preference_lines() -> list[str]:
    """Returns the lines of docs/preference-learning.md's bash block that runs jobs/pairs.py."""
    blocks = re.findall(
        r"^```bash\n(.*?)^```", (REPO / "docs/preference-learning.md").read_text(), re.M | re.S
    )
    found = [b for b in blocks if re.search(r"^python jobs/pairs\.py", b, re.M)]
    assert len(found) == 1, (
        f"docs/preference-learning.md has {len(found)} bash blocks running jobs/pairs.py"
    )
    return found[0].splitlines()


# Appended to the page's lines, so that each job takes a few steps of small batches.
PREFERENCE_FAST = {
    "jobs/pairs.py": [],
    "jobs/dpo.py": ["--learner.steps", "2", "--preference.pairs_per_step", "8"],
    "jobs/reward_model.py": ["--preference.reward_model_steps", "20", "--learner.eval_every", "10"],
    "jobs/ppo.py": [*SHORT_RUN, "--learner.steps", "2"],
}
PREFERENCE_SMALL = ["--preference.eval_pairs", "4", "--data.eval_size", "40"]


def test_readme_preference_lines_turn_a_runs_episodes_into_a_policy_and_a_reward(
    five_step_runs, job_env, tmp_path
):
    """The lines of docs/preference-learning.md, as written (plus fewer, smaller steps),
    in order, in a directory of their own: a run's episodes become pairs, DPO trains a
    policy on them, a reward model is fit to them, and a PPO run trains with that
    reward model as its only reward, its episodes scored with it."""
    root, _ = five_step_runs
    (tmp_path / "jobs").symlink_to(REPO / "jobs")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "exp1").symlink_to(root / "a")
    env = {**job_env, "PATH": f"{Path(sys.executable).parent}:{job_env.get('PATH', '')}"}
    for line in readme_preference_lines():
        job = re.search(r"jobs/\w+\.py", line)[0]
        extra = PREFERENCE_FAST[job] + (PREFERENCE_SMALL if job != "jobs/pairs.py" else [])
        command = f"{line} {' '.join(extra)}"
        result = subprocess.run(
            ["bash", "-c", command],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, f"{command}\n{result.stderr[-3000:]}"

    # Pairs: episodes of one prompt of run a, the chosen one right and the rejected wrong.
    pairs = [json.loads(line) for line in (tmp_path / "pairs.jsonl").read_text().splitlines()]
    episodes = {e.episode_id: e for e in stored_episodes(root / "a")}
    assert len(pairs) > 4  # some left to train on after the 4 held out
    for pair in pairs:
        chosen, rejected = episodes[pair["chosen_episode"]], episodes[pair["rejected_episode"]]
        assert chosen.prompt == rejected.prompt == pair["prompt"]
        assert (chosen.reward, rejected.reward) == (1.0, 0.0)
        assert (pair["chosen"], pair["rejected"]) == (chosen.completion, rejected.completion)
    # DPO: two steps, a checkpoint of its policy; the reward model: an HF classifier.
    dpo = json.loads((tmp_path / "runs" / "dpo1" / "summary.json").read_text())
    assert dpo["steps"] == 2 and "exact_match" in dpo["final_eval"]
    assert (tmp_path / "runs" / "dpo1" / "checkpoints" / "latest").read_text() == "step-000002"
    model_path = tmp_path / "runs" / "rm1" / "reward_model"
    rm = json.loads((tmp_path / "runs" / "rm1" / "summary.json").read_text())
    assert rm["steps"] == 20 and rm["reward_model"] == str(model_path)
    # PPO: every episode's reward is the reward model's score of its prompt and completion.
    from rlray.rewards.model_based import ClassifierReward

    trained = [e for e in stored_episodes(tmp_path / "runs" / "ppo-rm1") if e.reward is not None]
    assert len(trained) >= 64
    score = ClassifierReward(str(model_path))
    want = score([e.prompt for e in trained], [e.completion for e in trained])
    assert [e.reward for e in trained] == pytest.approx(want, abs=1e-4)
    assert [e.reward_components for e in trained[:1]] == [{"classifier_reward": trained[0].reward}]
    steps = metrics(tmp_path / "runs" / "ppo-rm1")
    assert [s["step"] for s in steps] == [1, 2]
