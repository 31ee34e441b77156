"""The simulated engine and learner (rlray/simulator), in-process: the profile's
arithmetic against hand-worked values, episodes and logprobs from seeds, weights whose
bytes a load checks, and the config rules that keep the simulator out of training."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rlray.config import Config, ConfigError, RolloutConfig, SimulatorConfig, validate
from rlray.core.checkpoints import checkpoint_problem, resume_point
from rlray.core.prompt import PromptRow
from rlray.simulator.engine import SimulatedEngine
from rlray.simulator.learner import SimulatedLearner
from rlray.simulator.profile import load_profile
from rlray.simulator.tokens import SimulatedWeights, token_logprobs

FAST = SimulatorConfig(time_scale=1e-6, weight_bytes=4096)


def rows(count: int, first: int = 0) -> list[PromptRow]:
    return [PromptRow(f"{i}+1=", {"answer": str(i + 1)}) for i in range(first, first + count)]


def engine(version: int = 0, **rollout: object) -> SimulatedEngine:
    settings = RolloutConfig(
        prompts_per_batch=4, samples_per_prompt=2, max_new_tokens=20, min_new_tokens=10
    )
    for key, value in rollout.items():
        setattr(settings, key, value)
    return SimulatedEngine("rollout-0", settings, FAST, "run", seed=7, policy_version=version)


def scored(episodes: list) -> list:
    for e in episodes:
        e.reward = float(e.completion == e.columns["answer"])
    return episodes


def test_the_default_profile_models_a_7b_batch_step_and_load_by_hand():
    profile = load_profile()
    assert profile.name == "7B on H100 80GB"
    # 16 episodes of 512 prompt tokens: prefill 8,192 / 28,000 s; decode bound by the
    # longest completion (1,024 / 150 = 6.83 s) over the engine's rate (16,384 / 4,000).
    seconds = profile.generate_seconds(16 * 512, [1024] * 16)
    assert seconds == pytest.approx(8192 / 28000 + 1024 / 150)
    # 256 episodes: the engine's rate binds (262,144 / 4,000 = 65.5 s).
    assert profile.generate_seconds(0, [1024] * 256) == pytest.approx(65.536)
    # 64 engines of one GPU, as many training GPUs: 1M tokens / (9,400 x 64).
    assert profile.train_seconds(1_000_000, 64) == pytest.approx(1e6 / (9400 * 64))
    assert profile.load_seconds() == pytest.approx(14e9 / 25e9)


def test_a_profile_entry_without_its_source_is_refused(tmp_path):
    text = tmp_path / "p.yaml"
    text.write_text("name: x\ngpus_per_engine: {value: 1}\n")
    with pytest.raises(ConfigError, match="gpus_per_engine needs a value and a source"):
        load_profile(str(text))
    with pytest.raises(ConfigError, match=r"simulator\.profile"):
        load_profile(str(tmp_path / "missing.yaml"))


def test_episodes_follow_from_the_seed_with_the_modelled_lengths():
    first, second = engine().generate(rows(4), 0), engine().generate(rows(4), 0)
    episodes, stats = first
    assert stats.episodes == len(episodes) == 8
    assert [(e.prompt_index, e.sample_index) for e in episodes] == [
        (i, s) for i in range(4) for s in range(2)
    ]
    assert all(10 <= len(e.completion_token_ids) <= 20 for e in episodes)
    assert all(len(e.prompt_token_ids) == 512 for e in episodes)
    assert [e.completion_token_ids for e in episodes] == [e.completion_token_ids for e in second[0]]
    assert len({e.episode_id for e in episodes + second[0]}) == 16  # a new attempt each call
    assert stats.completion_tokens == sum(len(e.completion_token_ids) for e in episodes)
    # Half the completions are the answer (CORRECT_SHARE), drawn per sample.
    assert 0 < sum(e.completion == e.columns["answer"] for e in episodes) < 8


def test_a_sync_that_delivered_its_version_checks_to_zero_and_a_stale_one_does_not():
    learner = SimulatedLearner(FAST, engines=1, samples_per_prompt=2, epochs=1)
    rollout = engine()
    episodes, _ = rollout.generate(rows(4), 0)
    metrics = learner.train_step(scored(episodes))
    assert metrics.policy_version == learner.version == 1
    assert metrics.logprob_parity_error == 0.0  # made by the version it trained
    sample = learner.parity_sample()
    assert rollout.parity_gap(sample) > 0.1  # the engine still holds version 0
    version, _ = rollout.load_published((learner.version, learner.published()))
    assert version == rollout.policy_version == 1
    assert rollout.parity_gap(sample) == 0.0


def test_weights_whose_bytes_changed_are_refused_at_load():
    weights = SimulatedWeights.of(5, 3 * 4096)  # checked: bytes 8, 4104, 8200 and the last
    assert weights.version_of() == 5
    weights.payload[4104] ^= 1
    with pytest.raises(ValueError, match=r"1 of 4 checked bytes differ .* at byte 4104"):
        engine().load_published((5, weights))
    weights.payload[4104] ^= 1
    weights.payload[-1] ^= 1  # a transfer that stopped short
    with pytest.raises(ValueError, match=r"at byte 12287"):
        weights.version_of()


def test_weights_of_another_version_are_refused_at_load():
    weights = SimulatedWeights.of(5, 4096)
    weights.payload[:8] = np.frombuffer((6).to_bytes(8, "little"), dtype=np.uint8)
    with pytest.raises(ValueError, match=r"of version 6: 2 of 2 checked bytes"):
        weights.version_of()


def test_logprobs_differ_between_versions_and_are_logprobs():
    first, second = token_logprobs(1, [3, 4], [5, 6, 7]), token_logprobs(2, [3, 4], [5, 6, 7])
    assert first != second
    assert all(-1.05 < lp <= -0.05 for lp in first + second)


def test_a_step_needs_whole_groups_and_its_checkpoint_resumes(tmp_path):
    learner = SimulatedLearner(FAST, engines=2, samples_per_prompt=2, epochs=1)
    episodes = scored(engine().generate(rows(2), 0)[0])
    with pytest.raises(ValueError):
        learner.train_step(episodes[:3])
    learner.train_step(episodes)
    staged = learner.save_checkpoint(tmp_path, prompt_cursor=2, publish=False)
    assert staged.name.startswith(".staging")
    published = learner.publish_staged(tmp_path, 1, keep=True)
    assert checkpoint_problem(published) is None
    assert resume_point(str(published)) == (1, 2)
    state = json.loads((published / "state.json").read_text())
    assert state["simulated"] is True
    again = SimulatedLearner(FAST, 2, 2, 1, checkpoint=str(published))
    assert (again.version, again.prompt_cursor) == (1, 2)


def test_evaluation_scores_the_greedy_episodes():
    episodes, result = engine().eval_episodes(rows(6), samples=2)
    assert len(episodes.greedy) == 6 and len(episodes.sampled) == 12
    right = sum(e.completion == e.columns["answer"] for e in episodes.greedy)
    assert result.accuracy == pytest.approx(right / 6)


def simulated(**sections: dict) -> Config:
    """A config with both backends simulated, then the given fields of each section."""
    config = Config()
    config.rollout.backend, config.learner.backend = "simulated", "simulated"
    for section, fields in sections.items():
        for name, value in fields.items():
            setattr(getattr(config, section), name, value)
    return config


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (simulated(learner={"backend": "torch"}), "learner.backend torch"),
        (simulated(rollout={"backend": "vllm"}), "rollout.backend vllm"),
        (simulated(ray={"placement": "colocated"}), "ray.placement colocated"),
        (simulated(rollout={"in_flight_updates": True}), "rollout.in_flight_updates"),
        (simulated(rollout={"weight_sync": "gloo"}), "rollout.weight_sync gloo"),
    ],
)
def test_the_simulator_is_refused_where_it_models_nothing(config, message):
    with pytest.raises(ConfigError, match=message):
        validate(config)
    validate(simulated())
