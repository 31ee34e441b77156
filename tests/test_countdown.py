"""The long-tail task (builtin:countdown): answers hand-worked, held-out pairs kept out of
training, the spread of lengths that makes it a long tail, and a job that learns it as
examples/countdown.yaml runs it (in-flight weight updates, token-bounded micro-batches),
on a colocated engine whose turns leave their longest completions running for the next
(partial rollouts). The disaggregated in-flight run is tests/test_faults.py's.
"""

from __future__ import annotations

import json
import re
import statistics
from collections import Counter

import pytest

from rlray.config import Config
from rlray.core.episode import from_table
from rlray.data.prompts import builtin_task, eval_rows, train_prompts
from rlray.data.tasks import COUNTDOWN, TaskPrompts, countdown
from rlray.data.tiny_models import COUNTDOWN_MODEL
from rlray.episodes.reader import read
from tests.jobs_helper import metrics, run_example


def test_a_countdown_writes_every_number_in_two_digits_until_the_next_would_be_negative():
    assert countdown(23, 5) == "18 13 08 03"
    assert countdown(10, 9) == "01"
    assert countdown(18, 9) == "09 00"
    assert countdown(12, 1).split() == [f"{n:02d}" for n in range(11, -1, -1)]
    assert COUNTDOWN.row(23, 5).prompt == "23-5="
    assert COUNTDOWN.row(23, 5).columns == {"answer": "18 13 08 03"}


def test_training_prompts_never_hold_an_evaluation_pair():
    held_out = set(COUNTDOWN.held_out_pairs(200))
    prompts = TaskPrompts(COUNTDOWN, seed=0, held_out=200)
    pairs = {
        tuple(int(x) for x in prompts.row(i).prompt.rstrip("=").split("-")) for i in range(3000)
    }
    assert len(held_out) == 200 and not pairs & held_out
    assert {a for a, _ in pairs} == set(range(10, 100)) and {k for _, k in pairs} == set(
        range(1, 10)
    )
    # Half of the 810 pairs at most are held out.
    assert len(COUNTDOWN.held_out_pairs(10_000)) == 405


def test_answers_run_from_one_number_to_ninety_nine_most_of_them_short():
    prompts = TaskPrompts(COUNTDOWN, seed=0, held_out=200)
    tokens = [len(prompts.row(i).columns["answer"]) + 1 for i in range(5000)]  # + end
    assert min(tokens) == 3 and max(tokens) <= len(countdown(99, 1)) + 1 == 297
    # The long tail: the median is a tenth of the longest, the mean well above the median.
    assert statistics.median(tokens) < 40 < statistics.mean(tokens) < 60
    assert sum(t > 200 for t in tokens) > 0


def test_the_example_config_fits_the_longest_answer():
    config = Config()
    config.data.train = config.data.eval = "builtin:countdown"
    assert builtin_task(config.data, "builtin:countdown", "data.train") is COUNTDOWN
    rows = eval_rows(config.data)
    assert all(r.prompt.endswith("=") for r in rows)
    assert train_prompts(config.data, 0).longest_prompts() == [COUNTDOWN.row(99, 1)]
    window = COUNTDOWN_MODEL.recipe["max_position_embeddings"]
    assert len("99-1=") + len(countdown(99, 1)) + 1 <= window


def test_the_warm_start_in_chunks_of_like_lengths_takes_the_whole_batchs_gradient():
    import torch

    from rlray.data.tiny_models import _char_qwen2, _encode, _like_lengths, _summed_loss

    torch.manual_seed(0)
    policy, tokenizer = _char_qwen2(32, 64, 1, 1, 320)
    prompts = TaskPrompts(COUNTDOWN, seed=0, held_out=200)
    rows = [prompts.row(i) for i in range(24)]
    pieces = [[(r.prompt, False), (r.columns["answer"], True), ("<eos>", True)] for r in rows]
    sequences = [_encode(tokenizer, p) for p in pieces]
    chunks = _like_lengths(sequences, 300)
    assert len(chunks) > 2
    assert all(max(len(ids) for ids, _ in c) * len(c) <= 300 for c in chunks if len(c) > 1)
    assert sorted(map(id, sequences)) == sorted(id(s) for chunk in chunks for s in chunk)

    def gradient() -> torch.Tensor:
        grad = torch.cat([p.grad.flatten() for p in policy.parameters()])
        policy.zero_grad()
        return grad

    # What the warm start did before chunks: the batch padded to its longest, and
    # transformers' own loss (the mean over every trained token of the batch).
    width = max(len(ids) for ids, _ in sequences)
    input_ids = torch.full((len(sequences), width), tokenizer.pad_token_id)
    labels = torch.full((len(sequences), width), -100)
    for i, (ids, trained) in enumerate(sequences):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(ids)] = torch.tensor(
            [t if k else -100 for t, k in zip(ids, trained, strict=True)]
        )
    policy(
        input_ids=input_ids, attention_mask=(input_ids != tokenizer.pad_token_id), labels=labels
    ).loss.backward()
    padded = gradient()
    trained = sum(sum(mask[1:]) for _, mask in sequences)
    for chunk in chunks:
        (_summed_loss(policy, tokenizer, chunk) / trained).backward()
    torch.testing.assert_close(gradient(), padded, rtol=1e-4, atol=1e-6)


# A colocated run a batch ahead spends one version of staleness; carrying a group over a
# turn spends another.
COLOCATED = ["--ray.placement", "colocated", "--buffer.max_staleness", "2"]


@pytest.fixture(scope="module")
def countdown_run(job_env, tmp_path_factory):
    """Ten steps of examples/countdown.yaml, colocated (the first builds the tiny
    countdown model)."""
    run_dir = tmp_path_factory.mktemp("countdown") / "run"
    return run_dir, run_example("countdown", 10, run_dir, job_env, COLOCATED)


@pytest.mark.slow
def test_the_countdown_task_learns_with_little_padding(countdown_run):
    run_dir, result = countdown_run
    done = re.search(
        r"^done: 10 steps, held-out accuracy ([\d.]+) -> ([\d.]+)", result.stdout, re.M
    )
    assert done, result.stdout[-2000:]
    assert float(done[2]) - float(done[1]) >= 0.08, done[0]  # measured: 0.195 -> 0.370
    records = metrics(run_dir)
    assert all(r["logprob_parity_error"] <= 1e-4 for r in records)
    # Micro-batches of at most 512 padded tokens (measured: 7% padding; 64% with 64
    # episodes each).
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["learner_padding_share"] < 0.2
    episodes = from_table(read(str(run_dir / "episodes")))
    lengths = [len(e.completion_token_ids) for e in episodes]
    assert max(lengths) > 5 * statistics.median(lengths)  # a long tail, generated
    # Partial rollouts: groups left running by a turn finish in the next, under the
    # next version (measured: 4-27 episodes a step); an episode counts its staleness
    # from its oldest version, and no batch was too stale to train.
    assert all(e.policy_version <= e.last_policy_version <= e.policy_version + 1 for e in episodes)
    assert sum(r["episodes_updated_in_flight"] for r in records) > 0
    assert records[-1]["dropped_stale"] == 0
    # Every step but the first (a run's first batch is short) trains one batch's worth.
    assert {r["episodes"] for r in records[1:]} == {Config().learner.episodes_per_step}
    # Every group started is stored whole once, those still running at the end as well.
    per_prompt = Counter(e.prompt_index for e in episodes)
    assert sorted(per_prompt) == list(range(len(per_prompt)))
    assert set(per_prompt.values()) == {Config().rollout.samples_per_prompt}
    assert len({e.episode_id for e in episodes}) == len(episodes)
    # A resume regenerates the prompts the last checkpoint left unfinished (carried
    # groups' among them, below prompts already trained), then goes on from its cursor:
    # every prompt the run's end stored untrained is one of them.
    state = json.loads((run_dir / "checkpoints" / "step-000010" / "state.json").read_text())
    untrained = {e.prompt_index for e in episodes if e.trained_at is None}
    replay, cursor = set(state["replay_prompts"]), state["prompt_cursor"]
    assert untrained and all(p in replay or p >= cursor for p in untrained)
