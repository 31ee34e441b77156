"""SimulatedEngine: a rollout worker without a model, for control-plane benchmarks
(rollout.backend simulated). It answers the calls the driver makes of a RolloutWorker
(generate, load_published, parity_gap, eval_episodes) with episodes of the modelled
lengths and takes the time the profile models for them (rlray.simulator.profile)."""

from __future__ import annotations

import time
import uuid

from rlray.config import RolloutConfig, SimulatorConfig
from rlray.core.episode import Episode
from rlray.core.evaluation import EvalEpisodes
from rlray.core.parity import ParitySample, parity_gap
from rlray.core.prompt import PromptRow
from rlray.core.stats import EvalResult, GenerateStats
from rlray.data.chat import episode_columns
from rlray.simulator.profile import ModelledTime, load_profile
from rlray.simulator.tokens import (
    SimulatedWeights,
    completion_token_ids,
    prompt_token_ids,
    seeded,
    token_logprobs,
)

CORRECT_SHARE = 0.5
"""Share of simulated completions whose text is the row's answer (the rest a wrong
one): the reward workers score real text, and a group's rewards differ."""


class SimulatedEngine:
    """Episodes from seeds instead of a model; the time of the modelled engine."""

    def __init__(
        self,
        name: str,
        rollout: RolloutConfig,
        simulator: SimulatorConfig,
        run_id: str,
        seed: int,
        policy_version: int = 0,
    ):
        self.name, self.rollout, self.run_id, self.seed = name, rollout, run_id, seed
        self.profile = load_profile(simulator.profile)
        self.time = ModelledTime(simulator.time_scale)
        self.policy_version = policy_version
        self.overrun_s = 0.0
        """Seconds the calls took beyond their modelled time (their own work)."""

    def generate(
        self, rows: list[PromptRow], first_prompt_index: int
    ) -> tuple[list[Episode], GenerateStats]:
        """Returns samples_per_prompt episodes per prompt, after the modelled time."""
        started = time.perf_counter()
        samples, lengths = self.rollout.samples_per_prompt, self._lengths()
        episodes = self._episodes(rows, first_prompt_index, samples, lengths)
        completions = [len(e.completion_token_ids) for e in episodes]
        prompts = sum(len(e.prompt_token_ids) for e in episodes)
        self.overrun_s += self.time.wait(
            self.profile.generate_seconds(prompts, completions), started
        )
        stats = GenerateStats(
            self.name,
            self.policy_version,
            len(episodes),
            sum(completions),
            time.perf_counter() - started,
        )
        return episodes, stats

    def _lengths(self) -> tuple[int, int]:
        high = self.rollout.max_new_tokens
        return min(self.rollout.min_new_tokens or high, high), high

    def _episodes(
        self, rows: list[PromptRow], first: int, samples: int, lengths: tuple[int, int]
    ) -> list[Episode]:
        attempt, now = uuid.uuid4().hex[:8], time.time()
        episodes = []
        for offset, row in enumerate(rows):
            index = first + offset
            text = row.prompt if isinstance(row.prompt, str) else row.prompt[-1]["content"]
            prompt = prompt_token_ids(text, self.profile.prompt_tokens)
            answer = str(row.columns.get("answer", ""))
            for sample in range(samples):
                completion = completion_token_ids(self.seed, index, sample, lengths)
                right = seeded("correct", self.seed, index, sample).random() < CORRECT_SHARE
                episodes.append(
                    Episode(
                        run_id=self.run_id,
                        episode_id=f"{self.run_id}-{index}-{sample}-{attempt}",
                        prompt_index=index,
                        sample_index=sample,
                        prompt=text,
                        completion=answer if right else f"{answer}0",
                        prompt_token_ids=prompt,
                        completion_token_ids=completion,
                        rollout_logprobs=token_logprobs(self.policy_version, prompt, completion),
                        finish_reason="length" if len(completion) == lengths[1] else "stop",
                        policy_version=self.policy_version,
                        last_policy_version=self.policy_version,
                        rollout_worker=self.name,
                        columns=episode_columns(row),
                        generated_at=now,
                    )
                )
        return episodes

    def load_published(self, published: tuple[int, SimulatedWeights]) -> tuple[int, float]:
        """Loads published weights: reads the version their bytes hold (ValueError if a
        byte is wrong) after the modelled load time; returns it and the seconds taken."""
        started = time.perf_counter()
        _, weights = published
        self.policy_version = weights.version_of()
        self.overrun_s += self.time.wait(self.profile.load_seconds(), started)
        return self.policy_version, time.perf_counter() - started

    def token_logprobs(self, episodes: list[Episode]) -> list[list[float]]:
        """The logprobs of the weights held now."""
        return [
            token_logprobs(self.policy_version, e.prompt_token_ids, e.completion_token_ids)
            for e in episodes
        ]

    def parity_gap(self, sample: ParitySample) -> float | None:
        """The sync's check: 0 where the engine holds the sample's version's weights."""
        return parity_gap(sample, self.token_logprobs(sample.episodes))

    def eval_episodes(
        self, rows: list[PromptRow], samples: int = 0, temperature: float = 1.0, examples: int = 3
    ) -> tuple[EvalEpisodes, EvalResult]:
        """Held-out episodes as generate makes them (prompt indices -len(rows) on), one
        'greedy' per prompt and `samples` more, after their modelled time."""
        started = time.perf_counter()
        first, lengths = -len(rows), self._lengths()
        greedy = self._episodes(rows, first, 1, lengths)
        sampled = self._episodes(rows, first, samples, lengths) if samples else []
        made = greedy + sampled
        prompts = sum(len(e.prompt_token_ids) for e in made)
        completions = [len(e.completion_token_ids) for e in made]
        self.time.wait(self.profile.generate_seconds(prompts, completions), started)
        right = [e.completion == str(e.columns.get("answer", "")) for e in greedy]
        shown = [(e.prompt, e.completion, str(e.columns.get("answer", ""))) for e in greedy]
        accuracy = sum(right) / len(right) if right else None
        return EvalEpisodes(greedy, sampled), EvalResult(
            accuracy, self.policy_version, shown[:examples]
        )

    def evaluate(self, rows: list[PromptRow], examples: int = 3) -> EvalResult:
        return self.eval_episodes(rows, examples=examples)[1]
