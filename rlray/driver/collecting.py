"""The collect-only driver: every prompt's samples generated, scored and stored by the
run's rollout, reward and store actors, with the training driver's recovery (a dead
rollout or reward worker's batch made again, a dead store's writes sent again); no
buffer and no learner. For datasets, baselines and evaluation (jobs/collect.py)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from rlray.cluster.start import Actors, actor_processes
from rlray.core.stats import StoreStats
from rlray.driver.plan import RunPlan
from rlray.driver.recovery import Recovery
from rlray.driver.rollouts import InFlight, Rollouts
from rlray.driver.store_writes import StoreWrites
from rlray.observe.timing import PhaseClock


@dataclass
class CollectSummary:
    """What a collect-only run did (summary.json)."""

    prompts: int
    episodes: int
    reward_mean: float
    wall_seconds: float
    episodes_per_second: float
    store: str
    """Where the episodes are: a directory or an s3:// prefix."""
    run_dir: str
    actor_restarts: dict[str, int] = field(default_factory=dict)
    """Restarts of each actor the run lived through."""
    episodes_stored: int | None = None


class CollectDriver:
    """Keeps every rollout worker busy until the prompts asked for are done; each scored
    batch goes from its reward actor to the store without passing through here."""

    def __init__(self, plan: RunPlan, actors: Actors):
        config = plan.config
        self.plan = plan
        clock = PhaseClock()
        self.recovery = Recovery(
            actors, config.ray.call_timeout_s, config.ray.actor_start_timeout_s
        )
        self.store = StoreWrites(actors.stores(), self.recovery, clock)
        self.rollouts = Rollouts(actors, plan.prompts, self.recovery, clock, deliver=self._store)
        processes = actor_processes(actors, config.ray.call_timeout_s)
        (plan.run_dir / "placement.json").write_text(json.dumps(processes, indent=2))

    def collect(self, prompt_count: int) -> CollectSummary:
        """Generates, scores and stores `prompt_count` prompts' samples; returns the
        summary."""
        rollout = self.plan.config.rollout
        started, cursor = time.perf_counter(), 0
        while cursor < prompt_count or self.rollouts.in_flight:
            for worker in self.rollouts.idle_workers():
                count = min(rollout.prompts_per_batch, prompt_count - cursor)
                if count > 0:
                    self.rollouts.start(worker, cursor, count, rollout.samples_per_prompt)
                    cursor += count
            self.rollouts.wait()
        wall = time.perf_counter() - started
        tally = self.rollouts.tally
        store = self.plan.config.store.path or str(self.plan.run_dir / "episodes")
        return CollectSummary(
            prompts=prompt_count,
            episodes=tally.episodes,
            reward_mean=tally.reward_sum / max(tally.episodes, 1),
            wall_seconds=wall,
            episodes_per_second=tally.episodes / wall,
            store=store,
            run_dir=str(self.plan.run_dir),
            actor_restarts=self.recovery.count_restarts(),
        )

    def _store(self, items: list[InFlight]) -> None:
        self.store.write([[item.episodes] for item in items], trained_at=None)
        print(f"collected {self.rollouts.tally.episodes} episodes", flush=True)

    def close_store(self) -> StoreStats | None:
        """Stores what is still in flight, closes the store and returns its stats; None
        if it could not be closed (the reason is logged)."""
        for item in self.rollouts.finished():
            self.store.write([[item.episodes]], trained_at=None)
        return self.store.close(self.plan.config.store.upload_timeout_s)
