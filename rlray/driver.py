"""The driver's side of a run: hand out prompts, move references, step the learner.

The driver holds ObjectRefs and small records only. A rollout batch goes
rollout actor -> object store -> reward actor -> object store, the buffer holds its
reference, and the learner fetches it. What the driver sees of it is a GenerateStats
and a ScoreStats of a few numbers each.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import yaml

from rlray.actors import ActorFailure, Actors, wait_for
from rlray.buffer import BufferedBatch, TakenBatches
from rlray.checkpoints import latest_checkpoint
from rlray.config import (
    Config,
    ConfigError,
    EvalConfig,
    config_to_dict,
    eval_rewards,
    weight_sync,
)
from rlray.data import (
    PromptRow,
    PromptSource,
    check_prompts_fit,
    eval_rows,
    lost_characters_warning,
    train_prompts,
)
from rlray.episode import ModelLimits
from rlray.evaluation import EvalSample, EvalSummary, fully_scored, summarize
from rlray.interrupts import interrupts_held
from rlray.models import model_limits, read_prompts, resolve_model_path
from rlray.multiturn import load_environment
from rlray.rewards import ScoreStats, absolute_spec_path, check_rewards
from rlray.rewards.worker import TRACE_COLUMN
from rlray.rollout import EvalResult, GenerateStats
from rlray.step_metrics import metrics_dict
from rlray.store import StoreStats
from rlray.telemetry import Telemetry
from rlray.timing import PhaseClock
from rlray.tracking import Trackers

logger = logging.getLogger(__name__)

PARITY_PROBE_PROMPTS = 2


@dataclass
class RunPlan:
    """Everything checked before any actor starts."""

    config: Config
    run_dir: Path
    run_id: str
    model_path: str
    prompts: PromptSource
    eval_rows: list[PromptRow]
    checkpoint: Path | None
    """Checkpoint to continue from (a resumed run), else None."""


def plan_run(config: Config, resume_dir: Path | None) -> RunPlan:
    """Returns the checked plan of a run, or raises ConfigError naming the bad input.

    Resolves the model (building the embedded one on first use), reads the prompts,
    checks that every prompt fits the context window and that reward functions load.
    The cheap checks (checkpoint, run directory) come first.
    """
    checkpoint = None
    if resume_dir is not None:
        checkpoint = latest_checkpoint(resume_dir)
        if checkpoint is None:
            raise ConfigError(f"--resume: no complete checkpoint under {resume_dir}/checkpoints")
    run_dir = Path(config.run_dir or f"runs/ppo-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    _check_writable(run_dir)
    prompts = train_prompts(config.data, config.seed)
    held_out = eval_rows(config.data)
    config.reward.functions = [absolute_spec_path(s, Path.cwd()) for s in config.reward.functions]
    config.eval.rewards = [absolute_spec_path(s, Path.cwd()) for s in config.eval.rewards]
    check_rewards(config.reward.functions, {*prompts.row(0).columns, TRACE_COLUMN})
    check_eval_rows(config, held_out)
    if config.rollout.environment:
        load_environment(config.rollout.environment)
    model_path = resolve_model_path(config.model.path)
    limits = model_limits(model_path, config.model.max_model_len)
    _check_stop_token_ids(config.rollout.stop_token_ids, limits)
    sources = {"data.train": prompts.longest_prompts(), "data.eval": held_out}
    readings = read_prompts(model_path, [[r.prompt for r in rows] for rows in sources.values()])
    for (source, rows), read in zip(sources.items(), readings, strict=True):
        counts = [tokens.count for tokens in read]
        check_prompts_fit(
            rows, counts, config.completion_budget, config.model.max_model_len, source
        )
        if warning := lost_characters_warning(rows, [t.read_as for t in read], source):
            logger.warning("warning: %s", warning)
    config.run_dir = str(run_dir)
    return RunPlan(config, run_dir, run_dir.name, model_path, prompts, held_out, checkpoint)


def check_eval_rows(config: Config, rows: list[PromptRow]) -> None:
    """Raises ConfigError unless there are at least 2 held-out prompts (a standard error
    needs 2) and the eval rewards can score them (the columns they need)."""
    if len(rows) < 2:
        raise ConfigError(
            f"data.eval: {len(rows)} held-out prompt(s); an evaluation needs at least 2"
        )
    field = "eval.rewards" if config.eval.rewards else "reward.functions"
    columns = set.intersection(*(set(r.columns) for r in rows))
    check_rewards(eval_rewards(config), {*columns, TRACE_COLUMN}, field, "data.eval")


def _check_stop_token_ids(token_ids: list[int], limits: ModelLimits | None) -> None:
    """Raises ConfigError if a stop token id is not in the model's vocabulary (a hub
    model's vocabulary is not known before vLLM loads it)."""
    for i, token in enumerate(token_ids):
        if limits is not None and token >= limits.vocab_size:
            raise ConfigError(
                f"rollout.stop_token_ids[{i}]: {token} is not a token id of the model "
                f"(vocabulary of {limits.vocab_size})"
            )


def _check_writable(run_dir: Path) -> None:
    """Raises ConfigError (run_dir) unless the run directory exists as a writable
    directory or can be created: its nearest existing parent is a writable directory."""
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"run_dir: cannot create {run_dir}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"run_dir: cannot write to {existing}")


def write_config(plan: RunPlan) -> None:
    """Creates the run directory and writes config.yaml (a resumed run keeps its own)."""
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    target = plan.run_dir / "config.yaml"
    if plan.checkpoint is None or not target.exists():
        target.write_text(yaml.safe_dump(config_to_dict(plan.config), sort_keys=False))


@dataclass
class Evaluation:
    """One held-out evaluation: exact match and the metrics of the eval rewards."""

    result: EvalResult
    """Greedy exact-match accuracy (None without answers), version, examples."""
    summary: EvalSummary
    """Every metric (rlray.evaluation.summarize) with its standard error."""
    prompts_left_out: int
    """Held-out prompts left out because a reward failed on one of their completions."""

    def record(self) -> dict[str, Any]:
        """Returns the evaluation's fields of a metrics.jsonl line."""
        metrics = self.summary.metrics
        return {
            "eval_accuracy": self.result.accuracy,
            "eval_policy_version": self.result.policy_version,
            "eval": {name: m.value for name, m in metrics.items()},
            "eval_stderr": {name: m.stderr for name, m in metrics.items()},
            "eval_prompts_left_out": self.prompts_left_out,
        }


def summarize_evaluation(
    model: str, result: EvalResult, samples: list[EvalSample], settings: EvalConfig
) -> Evaluation:
    """Returns the evaluation of `model` from its exact-match result and its scored
    held-out completions. Prompts a reward failed on are left out (and logged); raises
    ActorFailure if fewer than 2 prompts are left to evaluate on."""
    kept, left_out = fully_scored(samples)
    prompts = len({s.prompt_id for s in samples})
    if left_out:
        logger.warning(
            "evaluation of %s: %d of %d held-out prompts left out: a reward failed on one "
            "of their completions",
            model,
            len(left_out),
            prompts,
        )
    if prompts - len(left_out) < 2:
        raise ActorFailure(
            f"evaluation of {model}: rewards failed on {len(left_out)} of {prompts} "
            "held-out prompts; fewer than 2 are left to evaluate on"
        )
    ks = settings.pass_k if settings.samples else []
    summary = summarize(model, kept, ks, settings.pass_threshold)
    return Evaluation(result, summary, len(left_out))


@dataclass
class InFlight:
    """A rollout batch on its way: generated by one actor, scored by another."""

    rows: list[PromptRow]
    first_prompt_index: int
    worker_index: int
    reward_index: int
    num_episodes: int
    generated_episodes: Any = None  # ObjectRef[list[Episode]], not yet scored
    generate_stats: Any = None  # ObjectRef[GenerateStats]
    episodes: Any = None  # ObjectRef[list[Episode]], scored
    score_stats: Any = None  # ObjectRef[ScoreStats]
    uniform: Any = None
    """ObjectRef[list[Episode]] of the groups dynamic sampling split off, if it is on."""
    generated: GenerateStats | None = None
    """Set when generation is done: the rollout worker is free while scoring runs."""
    scored: ScoreStats | None = None
    """Set when scoring is done; the batch goes to the buffer once every batch started
    before it has."""


@dataclass
class StoreWrite:
    """Batches sent to the store and not yet confirmed; resent (same key) if it dies."""

    batch_refs: list[list[Any]]
    trained_at: float | None
    ref: Any = None


@dataclass
class RolloutTally:
    """Rollout figures gathered between two learner steps."""

    completion_tokens: int = 0
    generate_seconds: float = 0.0
    reward_seconds: float = 0.0
    reward_wait_seconds: float = 0.0
    """Time the driver waited with every batch generated and only scoring pending."""
    reward_failures: dict[str, int] = field(default_factory=dict)
    reward_dropped: int = 0
    prompts_generated: int = 0
    uniform_groups: int = 0
    """Groups left out by dynamic sampling (all samples got the same reward)."""
    uniform_episodes: int = 0
    per_worker_version: dict[str, int] = field(default_factory=dict)
    tool_calls: int = 0
    tool_errors: int = 0

    def tool_call_success_rate(self) -> float | None:
        return 1 - self.tool_errors / self.tool_calls if self.tool_calls else None

    def tokens_per_s(self) -> float | None:
        return self.completion_tokens / self.generate_seconds if self.generate_seconds else None


class TrainingDriver:
    """Schedules generation, scoring, buffering, learning and weight syncs of one run.

    Generation runs ahead of the learner only as far as `buffer.max_staleness` allows:
    a batch is started only if the policy that makes it will be at most K versions
    behind the learner when that batch is trained on. K=0 is strictly on-policy.

    Rollout, reward, buffer and store actors are restarted by Ray when they die; the
    driver keeps what it needs to carry on without losing or doubling an episode: the
    rows of every batch in flight (regenerated, with new episode ids, if its rollout
    worker died; re-scored if its reward worker died), a copy of the buffer's references
    (restored into a restarted buffer), and every store write until the store confirms
    it (resent under the same key, which the store recognises). Episodes are stored as
    trained only after the learner step that used them succeeded.
    """

    def __init__(self, plan: RunPlan, actors: Actors, version: int, prompt_cursor: int):
        self.config = plan.config
        self.plan = plan
        self.actors = actors
        self.timeout = plan.config.ray.call_timeout_s
        self.learner_version = version
        self.worker_versions = [version] * len(actors.rollout)
        self.prompt_cursor = prompt_cursor
        self.in_flight: list[InFlight] = []
        self.buffered_episodes = 0
        self.buffered: dict[int, BufferedBatch] = {}
        """The buffer's batches of this driver (added, not yet taken), by batch id."""
        self.reserved_episodes = 0
        self.training: list[BufferedBatch] = []
        """The batches of the learner step under way (stored once it succeeded)."""
        self.next_reward = 0
        self.next_batch_id = 0
        self.tally = RolloutTally()
        self.published: Any = None  # ObjectRef of the last published weights
        self.transfer = weight_sync(plan.config)  # object_store, nccl or gloo
        self.transfer_open = False  # the learners' weight transfer to the workers
        self.parity_probe: Any = None  # held so a failed probe is not reported as unhandled
        self.store_writes: dict[str, StoreWrite] = {}
        self.restarts: dict[str, int] = {}
        """Actor restarts seen by this driver, by actor name."""
        self.telemetry = Telemetry(plan.run_id)
        self.clock = PhaseClock()

    # ------------------------------------------------------------------ generation

    def _busy_workers(self) -> set[int]:
        return {item.worker_index for item in self.in_flight if item.generated is None}

    def _may_generate(self, worker: int) -> bool:
        """Whether a batch started now on `worker` would still be fresh when trained."""
        per_step = self.config.learner.episodes_per_step
        ahead = self.buffered_episodes + sum(item.num_episodes for item in self.in_flight)
        trained_at_version = self.learner_version + ahead // per_step
        return trained_at_version - self.worker_versions[worker] <= self.config.buffer.max_staleness

    def fill(self) -> None:
        """Starts a batch on every idle rollout worker that may generate and has room."""
        batch_size = self.config.rollout_batch_episodes
        for worker in range(len(self.actors.rollout)):
            if worker in self._busy_workers() or not self._may_generate(worker):
                continue
            with interrupts_held():
                if not self._buffer_call(
                    lambda: self.actors.buffer.reserve.remote(batch_size), "reserve"
                ):
                    return  # full: producers wait until the learner takes a step
                self.reserved_episodes += batch_size
                self._start_batch(worker)

    def _start_batch(self, worker: int) -> None:
        count = self.config.rollout.prompts_per_batch
        first = self.prompt_cursor
        self.prompt_cursor += count
        item = InFlight(
            rows=[self.plan.prompts.row(first + i) for i in range(count)],
            first_prompt_index=first,
            worker_index=worker,
            reward_index=self.next_reward,
            num_episodes=count * self.config.rollout.samples_per_prompt,
        )
        self.next_reward = (self.next_reward + 1) % len(self.actors.reward)
        self.tally.prompts_generated += count
        self.in_flight.append(item)
        self._generate(item)

    def _generate(self, item: InFlight) -> None:
        """Starts (or starts again) the generation of a batch, then its scoring."""
        worker = self.actors.rollout[item.worker_index]
        item.generated_episodes, item.generate_stats = worker.generate.options(
            num_returns=2
        ).remote(item.rows, item.first_prompt_index)
        item.generated = None
        self._score(item)

    def _score(self, item: InFlight) -> None:
        """Starts (or starts again) the scoring of a generated batch."""
        scorer = self.actors.reward[item.reward_index]
        if self.config.algorithm.drop_uniform_groups:
            item.episodes, item.uniform, item.score_stats = scorer.score_and_split.options(
                num_returns=3
            ).remote(item.generated_episodes, self.learner_version)
        else:
            item.episodes, item.score_stats = scorer.score.options(num_returns=2).remote(
                item.generated_episodes, self.learner_version
            )

    def _rollout_name(self, item: InFlight) -> str:
        return self.actors.rollout_names[item.worker_index]

    def _reward_name(self, item: InFlight) -> str:
        return self.actors.reward_names[item.reward_index]

    def _collect(self) -> None:
        """Waits until some in-flight batch finishes generating (its worker is free again)
        or scoring (its reference goes to the buffer), and handles what finished."""
        if not self.in_flight:
            raise RuntimeError("nothing in flight and the buffer cannot fill a learner step")
        generating = [item.generate_stats for item in self.in_flight if item.generated is None]
        pending = generating + [i.score_stats for i in self.in_flight if i.scored is None]
        started = time.perf_counter()
        ready, _ = ray.wait(pending, num_returns=1, timeout=self.timeout)
        waited = time.perf_counter() - started
        self.clock.add("generation" if generating else "scoring", waited)
        if not generating:
            self.tally.reward_wait_seconds += waited
        if not ready:
            names = sorted(
                {f"{self._rollout_name(i)}/{self._reward_name(i)}" for i in self.in_flight}
            )
            raise ActorFailure(
                f"{', '.join(names)}: no batch progressed within {self.timeout:.0f} s"
            )
        ready_refs = set(ready)
        with interrupts_held():
            for item in list(self.in_flight):
                if item.generated is None and item.generate_stats in ready_refs:
                    self._generated(item)
                elif item.scored is None and item.score_stats in ready_refs:
                    self._scored(item)
            self._buffer_in_order()

    def _generated(self, item: InFlight) -> bool:
        """Takes a finished generation's stats; returns False if its worker died and the
        batch was started again on the restarted worker."""
        name = self._rollout_name(item)
        try:
            gen = wait_for(item.generate_stats, name, "generate", self.timeout)
        except ActorFailure as err:
            if not err.died:
                raise
            self._recover(name, err)
            self._generate(item)
            return False
        item.generated = gen
        self.tally.completion_tokens += gen.completion_tokens
        self.tally.tool_calls += gen.tool_calls
        self.tally.tool_errors += gen.tool_errors
        self.tally.generate_seconds += gen.seconds
        self.tally.per_worker_version[gen.worker] = gen.policy_version
        return True

    def _scored(self, item: InFlight) -> None:
        if item.generated is None and not self._generated(item):
            return
        try:
            score: ScoreStats = wait_for(
                item.score_stats, self._reward_name(item), "score", self.timeout
            )
        except ActorFailure as err:
            if not err.died:
                raise
            self._recover(self._reward_name(item), err)
            if err.lost:  # the generated episodes went with their node
                self._generate(item)
            else:
                self._score(item)
            return
        item.scored = score
        self.tally.reward_seconds += score.seconds
        self.tally.reward_dropped += score.dropped
        self.tally.uniform_groups += score.uniform_groups
        self.tally.uniform_episodes += score.uniform_episodes
        for name, count in score.failures.items():
            self.tally.reward_failures[name] = self.tally.reward_failures.get(name, 0) + count

    def _buffer_in_order(self) -> None:
        """Hands scored batches to the buffer in the order they were started. A batch
        may start only if it will be at most max_staleness versions old when trained,
        counting every batch started before it as trained first; handed over out of
        order, a batch that took longer could fall behind that bound and be dropped."""
        while self.in_flight and self.in_flight[0].scored is not None:
            self._to_buffer(self.in_flight.pop(0))

    def _to_buffer(self, item: InFlight) -> None:
        score = item.scored
        batch = BufferedBatch(
            ref=[item.episodes],
            policy_version=item.generated.policy_version,
            num_episodes=item.generated.episodes - score.uniform_episodes,
            first_prompt_index=item.first_prompt_index,
            batch_id=self.next_batch_id,
        )
        self.next_batch_id += 1
        reserved = item.generated.episodes
        self._buffer_call(lambda: self.actors.buffer.add.remote(batch, reserved), "add")
        self.reserved_episodes -= reserved
        if batch.num_episodes:
            self.buffered[batch.batch_id] = batch
        if item.uniform is not None and score.uniform_episodes:
            self._store([[item.uniform]], trained_at=None)  # never trained on, kept
        self.buffered_episodes += batch.num_episodes

    # ------------------------------------------------------------------ actor restarts

    def _recover(self, name: str, failure: ActorFailure) -> None:
        """Waits for Ray to restart the dead actor `name` and brings it up to date (a
        rollout worker loads the current weights; the buffer gets its batches back).
        Raises the failure, still marked died, if Ray does not restart it."""
        if failure.lost:
            logger.warning("%s; making it again", failure)
            return
        name = self.actors.name_of(failure.actor_id) or name  # the one that died
        if name.startswith("learner"):  # not restarted: its weights would be lost
            raise ActorFailure(f"learner died; {failure}", died=True) from failure
        logger.warning("%s; waiting for Ray to restart %s", failure, name)
        self._wait_until_up(name, failure)
        self.restarts[name] = self.restarts.get(name, 0) + 1
        if name in self.actors.rollout_names:
            if self.published is None:  # weights sent by transfer: publish them now
                self.published = self.actors.learner.publish_weights.remote()
            self._load_weights(self.actors.rollout_names.index(name))
            self.transfer_open = False  # its new engine joins at the next sync
        elif name == "buffer":
            batches = list(self.buffered.values())
            ref = self.actors.buffer.restore.remote(batches, self.reserved_episodes)
            self._call("buffer", ref, "restore")
        elif name == "store":
            for key, write in self.store_writes.items():
                self._submit_store_write(key, write)
        logger.warning("%s restarted (restart %d of this run)", name, self.restarts[name])

    def _wait_until_up(self, name: str, failure: ActorFailure) -> None:
        """Waits until the restarted actor answers; raises, naming it, if Ray gave up."""
        handle = self.actors.handle(name)
        deadline = time.monotonic() + self.config.ray.actor_start_timeout_s
        while True:
            try:
                wait_for(handle.__ray_ready__.remote(), name, "restart", self.timeout)
                return
            except ActorFailure as again:
                if not again.restarting or time.monotonic() > deadline:
                    raise ActorFailure(f"{failure} (not restarted: {again})", died=True) from None
            time.sleep(0.5)

    def _retrying(self, name: str, call: Callable[[], Any], what: str) -> Any:
        """Returns the result of `call()` (a remote call on actor `name`), made again on
        the restarted actor for as long as Ray restarts it."""
        while True:
            try:
                return wait_for(call(), name, what, self.timeout)
            except ActorFailure as err:
                if not err.died or err.lost:  # a lost input is not made again by a retry
                    raise
                self._recover(name, err)

    def _load_weights(self, worker: int) -> tuple[int, float]:
        """Loads the last published weights on one rollout worker; returns its version
        and load seconds."""
        rollout = self.actors.rollout[worker]
        version, seconds = self._retrying(
            self.actors.rollout_names[worker],
            lambda: rollout.load_published.remote(self.published),
            "weight load",
        )
        self.worker_versions[worker] = version
        return version, seconds

    # ------------------------------------------------------------------ learning

    def train_step(self) -> dict[str, Any]:
        """Fills the buffer to one learner step, trains on it, and returns the step's
        metrics (learner, buffer and rollout figures together)."""
        per_step = self.config.learner.episodes_per_step
        while True:
            self.fill()
            with interrupts_held():  # batches taken are in `training` before a Ctrl-C acts
                taken = self._buffer_call(
                    lambda: self.actors.buffer.take.remote(per_step, self.learner_version), "take"
                )
                if taken is not None:
                    train = self._start_training(taken)
                    break
            self._collect()
        if self.actors.ingest is not None:
            self.actors.ingest.set_step.remote(self.learner_version)
        self.fill()  # with max_staleness >= 1 generation overlaps training
        with self.clock.phase("training"):
            metrics = self._call("learner", train, "train step")
        # Only now are they trained on: a learner that died mid-step leaves them untrained.
        with interrupts_held():
            self._store([b.ref for b in self.training], trained_at=time.time())
            self.training = []
        buffer_stats = self._buffer_call(lambda: self.actors.buffer.stats.remote(), "stats")
        tally, self.tally = self.tally, RolloutTally()
        return {
            **metrics_dict(metrics),
            "buffer_depth": buffer_stats["buffer_depth"],
            "dropped_stale": buffer_stats["dropped_stale"],
            "dropped_stale_this_step": sum(b.num_episodes for b in taken.dropped),
            "rollout_tokens_per_s": tally.tokens_per_s(),
            "reward_seconds": tally.reward_seconds,
            "reward_wait_seconds": tally.reward_wait_seconds,
            "reward_failures": tally.reward_failures,
            "reward_dropped_episodes": tally.reward_dropped,
            "prompts_generated": tally.prompts_generated,
            "dropped_uniform_groups": tally.uniform_groups,
            "dropped_uniform_episodes": tally.uniform_episodes,
            "worker_policy_versions": tally.per_worker_version,
            "tool_calls": tally.tool_calls,
            "tool_call_success_rate": tally.tool_call_success_rate(),
            "actor_restarts": dict(self.restarts),
        }

    def _start_training(self, taken: TakenBatches) -> Any:
        """Moves the batches taken from the buffer to `training`, stores the stale ones
        and starts the learner step; returns the step's ObjectRef."""
        for batch in taken.batches + taken.dropped:
            self.buffered.pop(batch.batch_id, None)
        self.buffered_episodes -= sum(
            b.num_episodes for b in taken.batches + taken.dropped if not b.external
        )
        self.training = taken.batches
        train = self.actors.learner.train_on.remote([b.ref for b in taken.batches], self.timeout)
        self._store([b.ref for b in taken.dropped], trained_at=None)
        self.learner_version += 1
        return train

    def sync_weights(self) -> dict[str, Any]:
        """Publishes the learner's weights once and loads them on every rollout worker.

        The weights are one immutable object, complete before any worker reads it, so
        no worker can load half a version. Returns the wall time of the whole sync and
        the slowest worker's load time."""
        with self.clock.phase("weight_sync"):
            return self._sync_weights()

    def _sync_weights(self) -> dict[str, Any]:
        started = time.perf_counter()
        if self.transfer == "object_store":
            path, loaded = "object_store", self._publish_and_load()
        else:
            path, loaded = self._send_weights()
        if self.config.buffer.max_staleness > 0:
            self._probe_parity()
        seconds = time.perf_counter() - started
        self.telemetry.set("rlray_weight_sync_seconds", seconds)
        load_seconds = [s for _, s in loaded.values() if s is not None]
        return {
            "weight_sync": path,
            "weight_sync_seconds": seconds,
            "weight_load_seconds": max(load_seconds) if load_seconds else None,
            "weight_versions_loaded": {name: version for name, (version, _) in loaded.items()},
        }

    def _publish_and_load(self) -> dict[str, tuple[int, float | None]]:
        """The object-store sync: the learner publishes one object, and every worker loads
        it, all at once. A worker that died is waited for and loads it when restarted
        (its load seconds are then None)."""
        self.published = self.actors.learner.publish_weights.remote()
        names = self.actors.rollout_names
        loads = [worker.load_published.remote(self.published) for worker in self.actors.rollout]
        loaded: dict[str, tuple[int, float | None]] = {}
        for worker, (name, load) in enumerate(zip(names, loads, strict=True)):
            try:
                version, seconds = wait_for(load, name, "weight load", self.timeout)
            except ActorFailure as err:
                if not err.died or err.lost:
                    raise
                self._recover(name, err)  # loads the published weights on the new worker
                loaded[name] = (self.worker_versions[worker], None)
                continue
            self.worker_versions[worker] = version
            loaded[name] = (version, seconds)
        return loaded

    def _send_weights(self) -> tuple[str, dict[str, tuple[int, float | None]]]:
        """vLLM's weight transfer: the learners send (rank 0 broadcasting into every
        worker's engine); opened at the first sync and again after a worker's restart.
        Returns the path the weights took and, per worker, (version, load seconds).

        If the transfer fails while the learner lives (a worker died or failed mid-send),
        a lone learner closes it and this sync goes through the object store (a dead
        worker is waited for and loads there too). In a group that ends the attempt as a
        learner death does: its learners may be stuck in different gathers, so the job
        resumes from its checkpoint with new actors (ray.max_job_restarts)."""
        try:
            if not self.transfer_open:
                self._open_transfer()
            version = self._call("learner", self.actors.learner.send_weights.remote(), "sync")
        except ActorFailure as failure:
            if failure.died:  # the learner died: reported as such
                raise
            if self.config.learner.num_workers > 1:
                raise ActorFailure(f"weight transfer failed: {failure}", died=True) from failure
            logger.warning("weight transfer failed (%s); syncing through the object store", failure)
            self.transfer_open = False
            closed = self.actors.learner.close_weight_transfer.remote()
            self._call("learner", closed, "closing the weight transfer")
            return "object_store", self._publish_and_load()
        self.published = None  # the last published object is no longer the weights
        self.worker_versions = [version] * len(self.actors.rollout)
        return self.transfer, {name: (version, None) for name in self.actors.rollout_names}

    def _open_transfer(self) -> None:
        learners = self.actors.learner
        address, port = self._call("learner", learners.handles[0].rendezvous.remote(), "sync")
        ranks = self.config.rollout.tensor_parallel_size  # each worker's engine's ranks
        workers = list(zip(self.actors.rollout_names, self.actors.rollout, strict=True))
        opened = learners.open_weight_transfer.remote(
            self.transfer, address, port, workers, ranks, self.timeout
        )
        self._call("learner", opened, "opening the weight transfer")
        self.transfer_open = True

    def _probe_parity(self) -> None:
        """Has the learner check this sync's logprob parity on a few fresh episodes.

        With max_staleness >= 1 training batches are mostly a version old, so the
        learner cannot compare them with its current weights. A small batch of held-out
        prompts (negative prompt indexes; never trained on) generated right after the
        sync goes to the learner, which checks it before its next update: actor calls
        from this driver run in the order they were made."""
        rows = self.plan.eval_rows[:PARITY_PROBE_PROMPTS]
        worker = self.actors.rollout[0]
        episodes, _ = worker.generate.options(num_returns=2).remote(rows, -len(rows))
        self.parity_probe = self.actors.learner.check_parity.remote(episodes)

    def evaluate(self) -> Evaluation:
        """Returns the held-out evaluation of the current policy: rollout-0 generates
        (greedy and eval.samples sampled completions per prompt), reward-0 scores, and
        only the scores come back here."""
        rollout, reward = self.actors.rollout[0], self.actors.reward[0]
        settings = self.config.eval
        made: dict[str, Any] = {}

        def generate() -> Any:
            made["episodes"], result = rollout.eval_episodes.options(num_returns=2).remote(
                self.plan.eval_rows, settings.samples, settings.temperature
            )
            return result

        with self.clock.phase("evaluation"):
            result = self._retrying(self.actors.rollout_names[0], generate, "evaluate")
            samples = self._retrying(
                self.actors.reward_names[0],
                lambda: reward.evaluate.remote(made["episodes"], self.learner_version),
                "score evaluation",
            )
        return summarize_evaluation(f"step {self.learner_version}", result, samples, settings)

    def save_checkpoint(self) -> Path:
        """Saves a checkpoint; its prompt cursor is the first prompt not yet trained on,
        so a resumed run regenerates whatever was buffered or in flight."""
        with self.clock.phase("checkpoint"):
            pending = [item.first_prompt_index for item in self.in_flight]
            pending += [b.first_prompt_index for b in self.buffered.values() if not b.external]
            cursor = min(pending, default=self.prompt_cursor)
            ref = self.actors.learner.save_checkpoint.remote(str(self.plan.run_dir), cursor)
            return self._call("learner", ref, "save checkpoint")

    # ------------------------------------------------------------------ the store

    def _store(self, batch_refs: list[list[Any]], trained_at: float | None) -> None:
        """Sends batches to the episode store (it fetches them itself); its answers are
        checked later, without holding up the learner."""
        with self.clock.phase("store"), interrupts_held():
            if batch_refs:
                key = uuid.uuid4().hex
                self.store_writes[key] = StoreWrite(batch_refs, trained_at)
                self._submit_store_write(key, self.store_writes[key])
            self._confirm_store_writes(block=False)

    def _submit_store_write(self, key: str, write: StoreWrite) -> None:
        write.ref = self.actors.store.append_batches.remote(
            write.batch_refs, write.trained_at, self.timeout, key
        )

    def _confirm_store_writes(self, block: bool) -> None:
        """Forgets the writes the store confirmed (all of them, waiting, if `block`);
        a dead store is waited for and gets every unconfirmed write again."""
        writes = list(self.store_writes.items())
        if not block and writes:
            done, _ = ray.wait([w.ref for _, w in writes], num_returns=len(writes), timeout=0)
            writes = [(key, w) for key, w in writes if w.ref in set(done)]
        for key, write in writes:
            try:
                wait_for(write.ref, "store", "append", self.timeout)
            except ActorFailure as err:
                if err.lost:  # nothing left to send again
                    logger.error("episodes lost before they were stored: %s", err)
                    del self.store_writes[key]
                    continue
                if not err.died:
                    raise
                self._recover("store", err)  # resends every unconfirmed write
                return self._confirm_store_writes(block)
            del self.store_writes[key]
        return None

    def drain(self) -> None:
        """Waits for in-flight batches and sends them, and whatever the buffer still
        holds, to the store as never trained on: every scored episode is kept."""
        for item in list(self.in_flight):
            if self._scored_without_error(item):
                self._store([[item.episodes]], trained_at=None)
                if item.uniform is not None:
                    self._store([[item.uniform]], trained_at=None)
        self.in_flight.clear()
        if self.training:  # the learner step did not finish: not trained on
            self._store([b.ref for b in self.training], trained_at=None)
            self.training = []
        if self.actors.buffer is not None:
            leftovers = self._buffer_call(lambda: self.actors.buffer.drain.remote(), "drain")
            self._store([b.ref for b in leftovers], trained_at=None)
            self.buffered.clear()
        self._confirm_store_writes(block=True)

    def _scored_without_error(self, item: InFlight) -> bool:
        try:
            wait_for(item.score_stats, self._reward_name(item), "score", self.timeout)
            return True
        except ActorFailure as err:  # its actor failed; the error is reported elsewhere
            logger.warning("batch from prompt %d not stored: %s", item.first_prompt_index, err)
            return False

    def close_store(self) -> StoreStats | None:
        """Sends every episode not yet stored to the store, closes it (writing its
        buffered rows, waiting for uploads) and returns its stats; None if the store
        could not be closed (the reason is logged)."""
        try:
            self.drain()
            timeout = self.timeout + self.config.store.upload_timeout_s
            stats, spooled = wait_for(self.actors.store.close.remote(), "store", "close", timeout)
        except ActorFailure as err:
            logger.warning("episodes not yet written may be lost: %s", err)
            return None
        if spooled:
            logger.warning(
                "%d episode file(s) not uploaded; they wait in %s",
                len(spooled),
                Path(spooled[0]).parent,
            )
        return stats

    def _call(self, actor: str, ref: Any, what: str) -> Any:
        return wait_for(ref, actor, what, self.timeout)

    def _buffer_call(self, call: Callable[[], Any], what: str) -> Any:
        with self.clock.phase("buffer"):
            return self._retrying("buffer", call, what)


class MetricsLog:
    """metrics.jsonl, one JSON line per learner step, appended (a resumed run continues
    it); every line also goes to the trackers (TensorBoard, wandb) if given."""

    def __init__(self, run_dir: Path, trackers: Trackers | None = None):
        self.path = run_dir / "metrics.jsonl"
        self.trackers = trackers

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as out:
            out.write(json.dumps(record) + "\n")
        if self.trackers is not None:
            self.trackers.log(record)

    def keep_before(self, step: int) -> None:
        """Drops the lines of `step` and later: a resumed run logs them again, so that
        no step appears twice."""
        kept = [json.dumps(r) + "\n" for r in self.read() if r["step"] < step]
        if self.path.exists():
            self.path.write_text("".join(kept))

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
