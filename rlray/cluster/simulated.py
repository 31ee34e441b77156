"""The Ray faces of the simulated engine and learner (rollout.backend and learner.backend
simulated, for control-plane benchmarks: docs/scale.md). They stand where RolloutActor
and LearnerActor stand, with the same remote methods, so that the driver, buffer,
store, reward workers, weight publication, restarts and checkpoints run as they do
with a model."""

from __future__ import annotations

from typing import Any

from rlray.cluster.calls import ActorRestarted, _restarted
from rlray.cluster.learners import LearnerActor
from rlray.config import Config
from rlray.core.episode import Episode
from rlray.core.evaluation import EvalEpisodes
from rlray.core.prompt import PromptRow
from rlray.core.stats import EvalResult
from rlray.simulator.engine import SimulatedEngine
from rlray.simulator.learner import SimulatedLearner
from rlray.simulator.tokens import SimulatedWeights


class SimulatedRolloutActor(SimulatedEngine):
    """A SimulatedEngine; restarted by Ray, it refuses to generate until it loaded the
    learner's weights, as a RolloutActor does."""

    def __init__(self, *args: Any, awaits_weights: bool = True, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.awaiting_weights = awaits_weights and _restarted()

    def _check_weights(self) -> None:
        if self.awaiting_weights:
            raise ActorRestarted(f"{self.name} was restarted and has not loaded weights since")

    def generate(self, rows: list[PromptRow], first_prompt_index: int) -> Any:
        self._check_weights()
        return super().generate(rows, first_prompt_index)

    def eval_episodes(
        self, rows: list[PromptRow], samples: int = 0, temperature: float = 1.0, examples: int = 3
    ) -> tuple[EvalEpisodes, EvalResult]:
        self._check_weights()
        return super().eval_episodes(rows, samples, temperature, examples)

    def token_logprobs(self, episodes: list[Episode]) -> list[list[float]]:
        self._check_weights()
        return super().token_logprobs(episodes)

    def load_published(self, published: tuple[int, SimulatedWeights]) -> tuple[int, float]:
        loaded = super().load_published(published)
        self.awaiting_weights = False
        return loaded

    def overrun(self) -> float:
        """Seconds this worker's calls took beyond their modelled time, so far."""
        return self.overrun_s


class SimulatedLearnerActor(LearnerActor):
    """A LearnerActor whose Learner is a SimulatedLearner: it publishes the simulated
    weights object (the version in its bytes) instead of packed tensors."""

    def __init__(self, run_id: str, config: Config, checkpoint: str | None = None):
        super().__init__(run_id, 0, 1)
        self.config, self.checkpoint = config, checkpoint

    def rendezvous(self) -> tuple[str, int]:
        return "", 0  # one learner, no group to join

    def setup(self, address: str, port: int, timeout_s: float) -> None:
        config = self.config
        self.learner = SimulatedLearner(
            config.simulator,
            config.rollout.num_workers,
            config.rollout.samples_per_prompt,
            config.learner.epochs,
            self.checkpoint,
        )

    def publish_weights(self) -> tuple[int, SimulatedWeights]:  # type: ignore[override]
        return self.learner.version, self.learner.published()

    def overrun(self) -> float:
        """Seconds the steps took beyond their modelled time, so far."""
        return self.learner.overrun_s
