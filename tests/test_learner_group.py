"""A learner group is one learner: the real Learner (policy, critic and KL reference all
sharded with FSDP2) in 2 processes of a gloo group takes the same step as one Learner,
its checkpoint resumes in one process, and one process's checkpoint resumes in the
group, each to the same next step; the group's checkpoint holds a whole HF policy."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from rlray.config import Config
from rlray.core.episode import Episode
from rlray.data.models import resolve_model_path
from rlray.learner import distributed as dd
from rlray.learner.rl import Learner
from tests.test_learner import episodes_for

# Prompts of different lengths, completions of different lengths: the split by tokens
# gives the two learners different row counts.
GROUPS = {
    "12+34=": {"46": 1.0, "57": 0.0, "3": 0.0, "6899": 0.5},
    "7+8=": {"15": 1.0, "1": 0.0, "150": 0.0, "16": 0.0},
    "123+456+7=": {"586": 1.0, "58": 0.0, "5860": 0.0, "9": 0.0},
}


def make_learner(checkpoint: str | None = None) -> Learner:
    """PPO with a critic (GAE) and a KL reference in the loss: all three models exist."""
    config = Config()
    config.learner.lr = 1e-4
    config.learner.critic_lr = 1e-3
    config.learner.episodes_per_step = 12
    config.learner.minibatch_size = 6  # two updates per epoch
    config.learner.micro_batch_size = 2  # several micro-batches per learner
    config.learner.micro_batch_tokens = 0  # of micro_batch_size episodes
    config.learner.max_grad_norm = 0.5
    config.algorithm.advantage = "gae"
    config.algorithm.kl_mode = "loss"
    config.algorithm.kl_estimator = "k3"
    config.algorithm.kl_coef = 0.1
    return Learner(
        resolve_model_path(config.model.path),
        config.model,
        config.algorithm,
        config.learner,
        max_new_tokens=config.rollout.max_new_tokens,
        samples_per_prompt=4,
        temperature=1.0,
        seed=0,
        checkpoint=checkpoint,
    )


def step_episodes(learner: Learner) -> list[Episode]:
    return [
        episode
        for index, (prompt, rewards) in enumerate(GROUPS.items())
        for episode in episodes_for(learner, rewards, prompt=prompt, prompt_index=index)
    ]


def whole_policy(learner: Learner) -> dict[str, torch.Tensor]:
    return dd.full_state_dict(learner.engine.policy)


def metrics_of(metrics) -> dict[str, float]:
    keys = ("policy_loss", "grad_norm", "kl", "value_loss", "entropy", "clip_fraction")
    return {key: getattr(metrics, key) for key in keys}


def group_member(rank: int, world_size: int, port: int, work: str) -> None:
    """One learner of the group: a step from the start (then a checkpoint), and a step
    from the single learner's checkpoint."""
    torch.set_num_threads(1)
    dd.join_group(rank, world_size, "127.0.0.1", port, "cpu", timeout_s=120)
    inputs = pickle.loads(Path(work, "inputs.pkl").read_bytes())
    fresh = make_learner()
    first = fresh.train_step(inputs["first"])
    saved = fresh.save_checkpoint(Path(work, "group-run"), prompt_cursor=3)
    first_state = whole_policy(fresh)
    del fresh
    resumed = make_learner(inputs["single_checkpoint"])
    second = resumed.train_step(inputs["second"])
    second_state = whole_policy(resumed)
    if rank == 0:
        result = {
            "first": metrics_of(first),
            "first_state": first_state,
            "second": metrics_of(second),
            "second_state": second_state,
            "checkpoint": str(saved),
        }
        torch.save(result, Path(work, "group.pt"))
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The single learner's two steps (and its checkpoint between them), then the group's."""
    work = tmp_path_factory.mktemp("learner-group")
    single = make_learner()
    start = whole_policy(single)
    first_episodes = step_episodes(single)
    first = single.train_step(first_episodes)
    checkpoint = single.save_checkpoint(work / "single-run", prompt_cursor=3)
    first_state = whole_policy(single)
    second_episodes = step_episodes(single)
    second = single.train_step(second_episodes)
    inputs = {"first": first_episodes, "second": second_episodes}
    inputs["single_checkpoint"] = str(checkpoint)
    (work / "inputs.pkl").write_bytes(pickle.dumps(inputs))
    mp.spawn(group_member, (2, dd.free_port(), str(work)), nprocs=2)
    return {
        "single": {
            "start": start,
            "first": metrics_of(first),
            "first_state": first_state,
            "second": metrics_of(second),
            "second_state": whole_policy(single),
            "second_episodes": second_episodes,
        },
        "group": torch.load(work / "group.pt"),
    }


def assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        # Measured: summation order moves Adam's update of an element by up to ~1e-6.
        assert torch.allclose(got[name], value, atol=2e-5, rtol=0), name


def assert_same_metrics(got: dict[str, float], want: dict[str, float]) -> None:
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_a_step_of_the_group_is_a_step_of_one_learner(runs):
    single, group = runs["single"], runs["group"]
    moved = max((single["first_state"][k] - v).abs().max() for k, v in single["start"].items())
    assert moved > 1e-4  # the step did something
    assert_same_metrics(group["first"], single["first"])
    assert group["first"]["kl"] is not None and group["first"]["value_loss"] > 0
    assert_same_weights(group["first_state"], single["first_state"])


def test_one_learners_checkpoint_resumes_in_a_group_to_the_same_next_step(runs):
    single, group = runs["single"], runs["group"]
    assert_same_metrics(group["second"], single["second"])
    assert_same_weights(group["second_state"], single["second_state"])


def test_a_groups_checkpoint_resumes_in_one_learner_to_the_same_next_step(runs):
    single, group = runs["single"], runs["group"]
    resumed = make_learner(group["checkpoint"])
    assert resumed.version == 1 and resumed.prompt_cursor == 3
    second = resumed.train_step(single["second_episodes"])
    assert_same_metrics(metrics_of(second), single["second"])
    assert_same_weights(whole_policy(resumed), single["second_state"])


def test_a_group_names_its_learners_and_survives_pickling():
    from rlray.cluster.learners import LearnerGroup, learner_names
    from rlray.cluster.start import Actors

    assert learner_names(0) == [] and learner_names(3) == ["learner", "learner-1", "learner-2"]
    # The run's Actors travel to the ingest actor pickled, learner group and all.
    actors = Actors(rollout=[], rollout_names=[], reward=[], reward_names=[], store="s")
    actors.learner = LearnerGroup(["h0", "h1"])
    back = pickle.loads(pickle.dumps(actors))
    assert back.learner.handles == ["h0", "h1"]
    assert [name for name, _ in back.all()] == ["store", "learner", "learner-1"]
    # A collect-only run has no learner and lists none.
    assert [name for name, _ in Actors([], [], [], [], store="s").all()] == ["store"]
