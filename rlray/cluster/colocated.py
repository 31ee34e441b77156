"""The colocated placement (ray.placement colocated): a rollout engine and a learner in
one process, on the same devices, taking turns with all of them.

Why one process rather than two actors sharing a placement bundle: the weights go from
the learner's tensors into the engine's with no serialisation and no object store, torch
is imported once, and the turns need no coordination: Ray runs one call of an actor at a
time, so generation (the engine's turn) and a learner step (the learner's) never overlap.
On CPU both use torch's one pool of intra-op threads, so each has every core of the
actor (learner.cpus + rollout.cpus_per_worker) in its turn. On GPU the engine sleeps
while the learner trains (vLLM's sleep mode: KV cache freed, weights offloaded to host
memory) and wakes for generation, and the learner gives its cached blocks back to the
device before the engine wakes (with learner.offload_optimizer, its optimizer's state
too, to host memory); `EngineTurns` keeps that state.

The driver needs no other path: the one handle is both a run's `rollout-<i>` and its
`learner`, and its calls queue in the order the driver makes them. With in-flight updates
(rollout.in_flight_updates) a turn ends once it has a batch of whole groups, and the
rest finish in later turns (partial rollouts, rlray.rollout.partial). A colocated actor is
not restarted by Ray (its learner's weights would be lost); the run resumes from its
checkpoint, as after a learner's death.

A learner group (learner.num_workers > 1) is a colocated actor per rank, each with its
own engine, as veRL lays it out. vLLM's engine sets up torch.distributed's default group
in its process unless one exists, and takes an existing one as data-parallel replicas
of itself (its tensor-parallel groups of one rank each; checked on vLLM 0.32's CPU
build: each rank generates on its own, and the learners' collectives run on the same
group). So in a group the learners join their group first and each builds its engine
after (`setup`); every rank gathers the whole weights for its own engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlray.cluster.learners import LearnerActor
from rlray.cluster.roles import RolloutActor
from rlray.core.episode import Episode
from rlray.core.evaluation import EvalEpisodes
from rlray.core.parity import ParitySample
from rlray.core.prompt import PromptRow
from rlray.core.stats import EvalResult, StepMetrics


class EngineTurns:
    """Whose turn the devices are: the engine's (awake: weights and KV cache on the
    device) or the learner's (engine asleep). `sleep` and `wake` are the engine's, or
    None where it cannot sleep (vLLM's CPU backend): then only the turn is kept.
    `release` and `reclaim` are the learner's (Learner.release_device): it gives up
    memory before the engine wakes, and takes it back once the engine sleeps."""

    def __init__(
        self,
        sleep: Callable[[], None] | None = None,
        wake: Callable[[], None] | None = None,
        release: Callable[[], None] | None = None,
        reclaim: Callable[[], None] | None = None,
    ):
        self.sleep, self.wake = sleep, wake
        self.release, self.reclaim = release, reclaim
        self.engine_awake = True
        self.turns: list[str] = []
        """Every change of turn, in order ("engine" or "learner"): what tests read."""

    def engine(self) -> None:
        """Gives the devices to the engine (before it generates or loads weights)."""
        if not self.engine_awake:
            _call(self.release)
            _call(self.wake)
            self.engine_awake = True
            self.turns.append("engine")

    def learner(self) -> None:
        """Gives the devices to the learner (before a step or a parity sample)."""
        if self.engine_awake:
            _call(self.sleep)
            _call(self.reclaim)
            self.engine_awake = False
            self.turns.append("learner")


def _call(function: Callable[[], None] | None) -> None:
    if function is not None:
        function()


class ColocatedActor(RolloutActor, LearnerActor):
    """A RolloutActor and a LearnerActor in one process (see the module's docstring)."""

    def __init__(
        self,
        rollout_args: tuple,
        learner_args: tuple,
        learner_kwargs: dict[str, Any],
        engine_log: str | None = None,
    ):
        LearnerActor.__init__(self, *learner_args, **learner_kwargs)
        self.rollout_args, self.engine_log = rollout_args, engine_log
        if self.world_size == 1:  # no group to join first: the engine starts with the actor
            self._start_engine()

    def _start_engine(self) -> None:
        on_gpu = self.rollout_args[3].gpus_per_worker > 0  # the RolloutConfig
        RolloutActor.__init__(
            self,
            *self.rollout_args,
            awaits_weights=False,
            engine_log=self.engine_log,
            sleep_mode=on_gpu,
        )
        # Level 1: the KV cache is freed and the weights go to host memory; the next
        # weight load overwrites them after the wake-up. "keep": requests a partial
        # rollout carries are preempted, not aborted, and recompute their KV once awake.
        self.turns = EngineTurns(
            (lambda: self.llm.sleep(level=1, mode="keep")) if on_gpu else None,
            self.llm.wake_up if on_gpu else None,
            # the learner is built after the engine (setup)
            lambda: self.learner.release_device(),
            lambda: self.learner.reclaim_device(),
        )

    def setup(self, address: str, port: int, timeout_s: float) -> None:
        """Joins the learner group, starts the engine if it waited for the group (see the
        module's docstring), then builds the Learner."""
        # as in LearnerActor.setup
        from rlray.learner.rl import Learner

        self._join(address, port, self.learner_kwargs.get("device", "cpu"), timeout_s)
        if not hasattr(self, "llm"):
            self._start_engine()
        self.learner = Learner(*self.learner_args, **self.learner_kwargs)
        self.learner.release_device()  # the engine's turn first (a resumed optimizer's state)

    # The engine's turn.

    def generate(
        self, rows: list[PromptRow], first_prompt_index: int, carry_floor: int | None = None
    ) -> Any:
        """Generates a batch; with `carry_floor` (partial rollouts: config's
        partial_rollouts) the turn ends once as many groups are whole, and groups still
        running that started at or after that version stay in the engine."""
        self.turns.engine()
        if carry_floor is None:
            return RolloutActor.generate(self, rows, first_prompt_index)
        self._check_weights()
        return self._counted(*self.generate_carrying(rows, first_prompt_index, carry_floor))

    def finish_carried(self) -> Any:
        """Finishes and returns every group a partial rollout left in the engine (the
        run's end)."""
        self.turns.engine()
        return self._counted(*self.generate_carrying([], 0, None))

    def eval_episodes(
        self, rows: list[PromptRow], samples: int = 0, temperature: float = 1.0, examples: int = 3
    ) -> tuple[EvalEpisodes, EvalResult]:
        self.turns.engine()
        return RolloutActor.eval_episodes(self, rows, samples, temperature, examples)

    def token_logprobs(self, episodes: list[Episode]) -> list[list[float]]:
        self.turns.engine()
        return RolloutActor.token_logprobs(self, episodes)

    def parity_gap(self, sample: ParitySample) -> float | None:
        self.turns.engine()
        return RolloutActor.parity_gap(self, sample)

    def load_learner_weights(self) -> tuple[int, float]:
        """Loads this process's learner's weights into the engine, in memory; returns
        the version now held and the seconds it took."""
        # torch loads in colocated processes only (the driver imports this module)
        from rlray.weights.packing import weights_for_vllm

        # The learner's device, then host memory; every rank of a group keeps them.
        weights = self.learner.published_weights(every_rank=True)
        self.turns.engine()
        architecture = self.llm.model_config.architecture
        weights = weights_for_vllm(weights, self.learner.tied_output, architecture)
        seconds = self.load_weights(self.learner.version, weights)
        return self.policy_version, seconds

    # The learner's turn.

    def train_on(self, batch_refs: list[list[Any]], timeout_s: float) -> StepMetrics:
        self.turns.learner()
        return LearnerActor.train_on(self, batch_refs, timeout_s)

    def parity_sample(self) -> ParitySample:
        self.turns.learner()
        return LearnerActor.parity_sample(self)

    def open_weight_transfer(self, *args: Any, **kwargs: Any) -> None:
        # Both faces have one (a worker joins a transfer; a learner opens one): here
        # neither applies.
        raise RuntimeError("a colocated engine takes its learner's weights in memory")

    def engine_turns(self) -> list[str]:
        """Returns every change of turn so far (tests read it)."""
        return list(self.turns.turns)
