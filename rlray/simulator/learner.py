"""SimulatedLearner: a learner without a model, for control-plane benchmarks
(learner.backend simulated). It answers what LearnerActor asks of a Learner: a step takes
the time the profile models for its tokens, weights are published as an object of the
modelled size whose bytes say their version, and checkpoints are real (small) ones, so
that restarts and resumes run the real code."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from rlray.config import SimulatorConfig
from rlray.core.checkpoints import (
    publish_sealed,
    resume_point,
    seal_checkpoint,
    staging_directory,
)
from rlray.core.episode import Episode
from rlray.core.groups import check_whole_groups
from rlray.core.parity import ParitySample
from rlray.core.stats import StepMetrics, component_means, staleness_max, staleness_mean
from rlray.simulator.profile import ModelledTime, load_profile
from rlray.simulator.tokens import SimulatedWeights, token_logprobs

PARITY_EPISODES = 4
"""Episodes of a step that the next weight sync's parity check scores."""


class SimulatedLearner:
    """Counts versions and takes the modelled time; trains nothing."""

    tied_output = None

    def __init__(
        self,
        simulator: SimulatorConfig,
        engines: int,
        samples_per_prompt: int,
        epochs: int,
        checkpoint: str | None = None,
    ):
        """`engines`: the rollout workers, whose GPUs set the training GPUs' count."""
        self.profile = load_profile(simulator.profile)
        self.time = ModelledTime(simulator.time_scale)
        self.weight_bytes = simulator.weight_bytes or self.profile.weight_bytes
        self.engines, self.samples_per_prompt, self.epochs = engines, samples_per_prompt, epochs
        self.version, self.prompt_cursor = resume_point(checkpoint)
        self.parity_episodes: list[Episode] = []
        self.overrun_s = 0.0

    def train_step(self, episodes: list[Episode]) -> StepMetrics:
        """One step: whole groups, as the Learner checks; the modelled time of every
        epoch's pass over their tokens."""
        started = time.perf_counter()
        check_whole_groups(episodes, self.samples_per_prompt)
        episodes = [e for e in episodes if e.reward is not None]
        if not episodes:
            raise ValueError("every episode of this step was dropped by a failing reward")
        tokens = sum(len(e.prompt_token_ids) + len(e.completion_token_ids) for e in episodes)
        modelled = self.profile.train_seconds(tokens * self.epochs, self.engines)
        self.overrun_s += self.time.wait(modelled, started)
        self.parity_episodes = episodes[:PARITY_EPISODES]
        fresh = [e for e in episodes if e.policy_version == self.version]
        gaps = [
            max(abs(a - b) for a, b in zip(e.rollout_logprobs, self._logprobs(e), strict=True))
            for e in fresh
            if e.completion_token_ids
        ]
        self.version += 1
        return self._metrics(episodes, max(gaps, default=None), time.perf_counter() - started)

    def _logprobs(self, episode: Episode) -> list[float]:
        return token_logprobs(self.version, episode.prompt_token_ids, episode.completion_token_ids)

    def _metrics(
        self, episodes: list[Episode], parity: float | None, seconds: float
    ) -> StepMetrics:
        rewards = [e.reward or 0.0 for e in episodes]
        completion = [len(e.completion_token_ids) for e in episodes]
        tokens = sum(completion) + sum(len(e.prompt_token_ids) for e in episodes)
        return StepMetrics(
            step=self.version,
            policy_version=self.version,
            episodes=len(episodes),
            groups=len({e.prompt_index for e in episodes}),
            reward_mean=sum(rewards) / len(rewards),
            reward_components=component_means(episodes),
            policy_loss=0.0,
            clip_fraction=0.0,
            entropy=0.0,
            grad_norm=0.0,
            advantage_abs_mean=0.0,
            zero_advantage_share=0.0,
            value_loss=None,
            value_clip_fraction=None,
            explained_variance=None,
            kl=None,
            staleness_mean=staleness_mean(episodes, self.version - 1),
            staleness_max=staleness_max(episodes, self.version - 1),
            logprob_parity_error=parity,
            rollout_logprob_diff_mean=None,
            rollout_logprob_diff_max=None,
            rollout_ratio_outside_share=None,
            rollout_correction_weight_mean=1.0,
            episodes_without_logprobs=0,
            truncated_share=sum(e.finish_reason == "length" for e in episodes) / len(episodes),
            learner_tokens_per_s=tokens * self.epochs / seconds,
            learner_seconds=seconds,
            completion_length_mean=sum(completion) / len(completion),
            optimizer_updates=self.epochs,
        )

    def logprobs(self, episodes: list[Episode]) -> list[list[float]]:
        return [self._logprobs(e) for e in episodes]

    def parity_sample(self) -> ParitySample:
        """A few of the last step's episodes with this version's logprobs."""
        episodes = self.parity_episodes
        return ParitySample(episodes, self.logprobs(episodes), self.version)

    def published(self) -> SimulatedWeights:
        """This version's weights object (simulator.weight_bytes, else the model's)."""
        return SimulatedWeights.of(self.version, self.weight_bytes)

    def save_checkpoint(
        self,
        run_dir: str | Path,
        prompt_cursor: int,
        publish: bool = True,
        replay_prompts: list[int] | None = None,
    ) -> Path:
        """Writes checkpoints/step-NNNNNN as the Learner does, with a small file in place
        of the model's, staged (not published) without `publish`; returns its path."""
        self.prompt_cursor = prompt_cursor
        staging = staging_directory(run_dir, self.version)
        (staging / "simulated.json").write_text(json.dumps({"version": self.version}))
        state = {
            "version": self.version,
            "step": self.version,
            "prompt_cursor": prompt_cursor,
            "replay_prompts": list(replay_prompts or []),
            "simulated": True,
        }
        seal_checkpoint(staging, state)
        return publish_sealed(staging) if publish else staging

    def publish_staged(self, run_dir: str | Path, version: int, keep: bool) -> Path | None:
        staging = staging_directory(run_dir, version, create=False)
        if keep:
            return publish_sealed(staging)
        shutil.rmtree(staging, ignore_errors=True)
        return None

    def state(self) -> dict[str, Any]:
        return {"version": self.version, "prompt_cursor": self.prompt_cursor}
