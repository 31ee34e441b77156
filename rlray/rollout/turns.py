"""Multi-turn rollouts of a rollout worker: trajectories generated turn by turn, each with
an environment of its own (rlray.rollout.multiturn), whole or carried across calls
(partial rollouts, rlray.rollout.partial)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from rlray.config import RolloutConfig
from rlray.core.episode import Episode
from rlray.core.prompt import PromptRow
from rlray.core.stats import GenerateStats
from rlray.data.chat import episode_columns
from rlray.rollout.engine_loop import EngineLoop
from rlray.rollout.multiturn import (
    Trajectory,
    TrajectoryRunner,
    TurnLimits,
    run_trajectories,
    tool_calls,
    turn_limits,
)
from rlray.rollout.partial import PartialTrajectories
from rlray.rollout.sampling import new_attempt, request_params, sampling_seed, stop_settings


class MultiTurnRollouts:
    """Generates multi-turn trajectories and turns them into episodes.

    A part of RolloutWorker (rlray.rollout.worker), which sets the attributes annotated
    here and provides policy_version, render, detokenizes, _completion_text and _stats."""

    name: str
    run_id: str
    seed: int
    rollout: RolloutConfig
    loop: EngineLoop
    """Every turn goes through it (rlray.rollout.engine_loop)."""
    make_environment: Callable[[], Any] | None
    """Makes one trajectory's environment (rollout.environment); None: single-turn."""
    partial_turns: PartialTrajectories
    """Trajectories a partial rollout left running (generate_carrying)."""
    tokenizer: Any
    tokenizer_lock: threading.Lock
    """Held while the tokenizer is used."""

    def _generate_turns(
        self, rows: list[PromptRow], first_prompt_index: int
    ) -> tuple[list[Episode], GenerateStats]:
        started = time.perf_counter()
        episodes = self.multi_turn_episodes(rows, first_prompt_index)
        seconds = time.perf_counter() - started
        tokens = sum(sum(e.completion_mask) for e in episodes)
        return episodes, self._stats(episodes, tokens, seconds, *tool_calls(episodes))

    def _carry_turns(
        self, rows: list[PromptRow], first_prompt_index: int, carry_floor: int | None
    ) -> tuple[list[Episode], GenerateStats]:
        """generate_carrying for multi-turn trajectories (rlray.rollout.partial)."""
        started = time.perf_counter()
        samples = self.rollout.samples_per_prompt
        trajectories = self._trajectories(
            rows, first_prompt_index, self.make_environment, new_attempt()
        )
        indices = [first_prompt_index + offset for offset in range(len(rows))]
        for offset, index in enumerate(indices):
            self.partial_turns.add(index, trajectories[offset * samples : (offset + 1) * samples])
        may_leave = int(len(rows) * self.rollout.in_flight_carry)
        groups = self.partial_turns.take(indices, may_leave, carry_floor)
        now = time.time()
        episodes = [self._trajectory_episode(t, now) for group in groups for t in group]
        seconds = time.perf_counter() - started
        tokens = sum(sum(e.completion_mask) for e in episodes)
        stats = self._stats(episodes, tokens, seconds, *tool_calls(episodes))
        stats.returned_prompts = sorted({g[0].prompt_index for g in groups})
        stats.first_prompt_index = min(stats.returned_prompts, default=None)
        stats.carried_prompts = self.partial_turns.carried_prompts()
        return episodes, stats

    def _trajectory_runner(self) -> TrajectoryRunner:
        """Returns a runner of this worker's training trajectories (partial rollouts)."""
        sampling = self._turns(self.rollout.temperature)
        return TrajectoryRunner(
            self.loop.session(), self._encode, self._turn_text, sampling, turn_limits(self.rollout)
        )

    def multi_turn_episodes(
        self,
        rows: list[PromptRow],
        first_prompt_index: int,
        make_environment: Callable[[], Any] | None = None,
        limits: TurnLimits | None = None,
        samples: int | None = None,
        temperature: float | None = None,
    ) -> list[Episode]:
        """Returns `samples` (default rollout.samples_per_prompt) multi-turn episodes per
        prompt at `temperature` (default rollout.temperature; 0 is greedy), each with a
        fresh environment (default rollout.environment's), generated turn by turn within
        `limits` (default the rollout settings'; rlray.rollout.multiturn)."""
        rollout = self.rollout
        make_environment = make_environment or self.make_environment
        limits = limits or turn_limits(rollout)
        temperature = rollout.temperature if temperature is None else temperature
        trajectories = self._trajectories(
            rows, first_prompt_index, make_environment, new_attempt(), samples
        )
        session = self.loop.session()
        sampling = self._turns(temperature)
        run_trajectories(session, self._encode, self._turn_text, trajectories, sampling, limits)
        now = time.time()
        return [self._trajectory_episode(t, now) for t in trajectories]

    def _trajectories(
        self,
        rows: list[PromptRow],
        first_prompt_index: int,
        make_environment: Callable[[], Any],
        attempt: str,
        samples: int | None = None,
    ) -> list[Trajectory]:
        """Returns `samples` (default rollout.samples_per_prompt) trajectories per row, in
        row order, each with a fresh environment."""
        samples = self.rollout.samples_per_prompt if samples is None else samples
        rendered = [self.render(row) for row in rows]  # chat prompts by the chat template
        return [
            Trajectory(
                key=f"{first_prompt_index + offset}-{sample}-{attempt}",
                row=row,
                prompt_token_ids=list(rendered[offset].token_ids),
                environment=make_environment(),
                prompt_index=first_prompt_index + offset,
                sample_index=sample,
                prompt_text=rendered[offset].text,
                attempt=attempt,
            )
            for offset, row in enumerate(rows)
            for sample in range(samples)
        ]

    def _turns(self, temperature: float) -> Callable[[Trajectory, int], Any]:
        """Returns the SamplingParams of a trajectory's next turn, given its token limit."""

        def sampling(t: Trajectory, max_tokens: int) -> Any:
            return request_params(
                max_tokens=max_tokens,
                temperature=temperature,
                logprobs=0,
                seed=sampling_seed(self.seed, t.prompt_index, t.sample_index, t.turns),
                detokenize=self.detokenizes,
                **stop_settings(self.rollout),
            )

        return sampling

    def _turn_text(self, completion: Any) -> str:
        """Returns a finished turn's text (its SamplingParams are _turns')."""
        return self._completion_text(completion, self.detokenizes)

    def _encode(self, text: str) -> list[int]:
        """Returns an observation's token ids (no special tokens added)."""
        with self.tokenizer_lock:
            return self.tokenizer(text, add_special_tokens=False).input_ids

    def _trajectory_episode(self, t: Trajectory, now: float) -> Episode:
        index, sample = t.prompt_index, t.sample_index
        return Episode(
            run_id=self.run_id,
            episode_id=f"{self.run_id}-{index}-{sample}-{t.attempt}",
            prompt_index=index,
            sample_index=sample,
            prompt=t.prompt_text,
            completion=t.completion,
            prompt_token_ids=t.prompt_token_ids,
            completion_token_ids=t.completion_token_ids,
            rollout_logprobs=t.rollout_logprobs,
            finish_reason=t.finish_reason,
            policy_version=t.versions.first if t.versions else self.policy_version,
            last_policy_version=t.versions.last if t.versions else self.policy_version,
            rollout_worker=self.name,
            columns=episode_columns(t.row),
            generated_at=now,
            spans=t.spans,
            completion_mask=t.completion_mask,
        )
