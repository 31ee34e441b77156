"""RewardWorker: scores episode batches with every configured reward, surviving faults.

A plain class: tests construct it in-process; rlray.cluster runs it as `reward-<i>`.
The reward functions run in a child process (rlray.rewards.process), so reward code that
exits or crashes fails its call instead of ending the worker; built-ins that need no such
guard run in the worker's own process. A component that raises,
exits, times out, or gives None, NaN or a score beyond ±MAX_ABS_REWARD (1e15: the
learner computes in float32) for an episode fails for that episode only: a batch
call that fails is retried one episode at a time to find which. Failures are counted per
component; the first of each is logged with its episode id.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from rlray.config import RewardSpec
from rlray.core.episode import MAX_ABS_REWARD, Episode, Score, Span
from rlray.core.evaluation import EvalEpisodes, EvalSample
from rlray.core.groups import (
    AGENT_TRACE_COLUMN,
    group_key,
    group_prompts,
    group_sizes,
    split_uniform_groups,
    trace_spans,
)
from rlray.core.stats import ScoreStats
from rlray.data.chat import MESSAGES_COLUMN, reward_inputs
from rlray.rewards.loading import scheduled_weight
from rlray.rewards.process import RewardCallError, reward_caller

logger = logging.getLogger(__name__)

MAX_DETAIL_CHARS = 65536
"""Longest explanation of a score kept on an episode (Episode.reward_details)."""


@dataclass
class ComponentScores:
    """One component's scores of a batch, with an error message where it failed and its
    explanation (JSON text) where it gave one (a Score's detail)."""

    values: list[float | None]
    errors: list[str | None]
    details: list[str | None] | None = None


class RewardWorker:
    """Sets each episode's per-component rewards and weighted total."""

    def __init__(
        self,
        name: str,
        specs: list[RewardSpec],
        on_failure: str = "skip_component",
        batch_size: int = 64,
        eval_specs: list[RewardSpec] | None = None,
    ):
        self.name = name
        self.specs = specs
        self.eval_specs = eval_specs
        self._eval_worker: RewardWorker | None = None
        self.process = reward_caller(specs)
        self.drop_on_failure = on_failure == "drop_episode"
        self.batch_size = batch_size
        self._logged: set[str] = set()

    def score(self, episodes: list[Episode], step: int = 0) -> tuple[list[Episode], ScoreStats]:
        """Returns the episodes with rewards set (weights as scheduled at learner `step`)
        and a stats record. An agent trace's episode whose agent posted its reward
        (rlray.agent) keeps it."""
        started = time.perf_counter()
        failures = dict.fromkeys((spec.name for spec in self.specs), 0)
        unscored = [e for e in episodes if not _posted(e)]
        # Over the whole batch: a chunk may hold a trace's later episodes without its first.
        spans = trace_spans(episodes)
        traces = {e.episode_id: s for e, s in zip(episodes, spans, strict=True)}
        for start in range(0, len(unscored), self.batch_size):
            chunk = unscored[start : start + self.batch_size]
            for index, spec in enumerate(self.specs):
                scores = self._component_scores(index, chunk, traces)
                details = scores.details or [None] * len(chunk)
                for episode, value, error, detail in zip(
                    chunk, scores.values, scores.errors, details, strict=True
                ):
                    episode.reward_components[spec.name] = value
                    if detail is not None:
                        episode.reward_details[spec.name] = detail
                    if error is not None:
                        failures[spec.name] += 1
                        self._log_first(spec.name, episode.episode_id, error)
        now = time.time()
        dropped = sum(self._set_total(e, step, failures) for e in unscored)
        for episode in episodes:
            episode.scored_at = now
        total = sum(e.reward for e in episodes if e.reward is not None)
        stats = ScoreStats(
            self.name, len(episodes), total, time.perf_counter() - started, failures, dropped
        )
        stats.group_sizes, stats.group_prompts = group_sizes(episodes), group_prompts(episodes)
        return episodes, stats

    def score_and_split(
        self, episodes: list[Episode], step: int = 0
    ) -> tuple[list[Episode], list[Episode], ScoreStats]:
        """Returns (episodes of groups whose rewards differ, episodes of uniform groups,
        stats): DAPO's dynamic sampling, done where the rewards are known so that the
        uniform groups can go straight to the store."""
        scored, stats = self.score(episodes, step)
        kept, uniform = split_uniform_groups(scored)
        stats.uniform_groups = len({group_key(e) for e in uniform})
        stats.uniform_episodes = len(uniform)
        stats.group_sizes, stats.group_prompts = group_sizes(kept), group_prompts(kept)
        return kept, uniform, stats

    def evaluate(self, episodes: EvalEpisodes, step: int = 0) -> list[EvalSample]:
        """Returns the scores of held-out episodes (weights as scheduled at learner
        `step`), by the eval rewards if given: small records for the driver, where
        rlray.evaluation.summarize turns them into metrics."""
        scorer = self._eval_scorer()
        samples = []
        for greedy, batch in ((True, episodes.greedy), (False, episodes.sampled)):
            scored, _ = scorer.score(batch, step) if batch else ([], None)
            samples += [
                EvalSample(e.prompt_index, e.reward, dict(e.reward_components), greedy)
                for e in scored
            ]
        return samples

    def _eval_scorer(self) -> RewardWorker:
        """Returns the worker that scores evaluations: this one, or one of the eval
        rewards (with a reward process of its own, started on first use)."""
        if not self.eval_specs or self.eval_specs == self.specs:
            return self
        if self._eval_worker is None:
            on_failure = "drop_episode" if self.drop_on_failure else "skip_component"
            self._eval_worker = RewardWorker(
                f"{self.name}-eval", self.eval_specs, on_failure, self.batch_size
            )
        return self._eval_worker

    def _set_total(self, episode: Episode, step: int, failures: dict[str, int]) -> bool:
        """Sets the weighted total; returns True if the episode is dropped instead. A
        component whose weighted score puts the total beyond ±MAX_ABS_REWARD fails."""
        weighted = {
            s.name: scheduled_weight(s, step) * episode.reward_components[s.name]
            for s in self.specs
            if episode.reward_components[s.name] is not None
        }
        while weighted and abs(sum(weighted.values())) > MAX_ABS_REWARD:
            name = max(weighted, key=lambda n: abs(weighted[n]))
            del weighted[name]
            episode.reward_components[name] = None
            failures[name] += 1
            self._log_first(name, episode.episode_id, "its weighted score is beyond the limit")
        if self.drop_on_failure and len(weighted) < len(self.specs):
            episode.reward = None
            return True
        episode.reward = sum(weighted.values())
        return False

    def _component_scores(
        self, index: int, episodes: list[Episode], traces: dict[str, list[Span]]
    ) -> ComponentScores:
        timeout_s = self.specs[index].timeout_s
        try:
            raw = self.process.call(index, _call_arguments(episodes, traces), timeout_s)
        except TimeoutError:
            message = f"timed out after {timeout_s:g} s"
            return ComponentScores([None] * len(episodes), [message] * len(episodes))
        except RewardCallError as err:
            if len(episodes) == 1:
                return ComponentScores([None], [str(err)])
            # Score one at a time so that only the episodes that make it fail fail.
            parts = [self._component_scores(index, [episode], traces) for episode in episodes]
            return ComponentScores(
                [v for p in parts for v in p.values],
                [e for p in parts for e in p.errors],
                [d for p in parts for d in p.details or [None]],
            )
        return checked_scores(raw, len(episodes))

    def _log_first(self, reward: str, episode_id: str, error: str) -> None:
        if reward in self._logged:
            return
        self._logged.add(reward)
        logger.warning(
            "%s: reward %s failed on episode %s: %s (further failures are counted, not logged)",
            self.name,
            reward,
            episode_id,
            error,
        )


def _posted(episode: Episode) -> bool:
    """Whether an agent posted the episode's reward (its trace's, or its call's)."""
    return episode.reward is not None and AGENT_TRACE_COLUMN in episode.columns


def _call_arguments(episodes: list[Episode], traces: dict[str, list[Span]]) -> dict[str, Any]:
    """Returns a reward call's arguments: prompts and completions (TRL's shape: a chat
    prompt's messages, and its completion as [{"role": "assistant", "content": text}]),
    every data column, plus `spans`, each episode's trace from `traces` (by episode id; an
    agent trace's for each of its episodes, though only the first stores it). The reward
    process passes on the columns the reward takes."""
    prompts, completions = reward_inputs(episodes)
    # A chat prompt's messages arrive as its prompt, as in TRL, not as a column too.
    names = dict.fromkeys(key for e in episodes for key in e.columns if key != MESSAGES_COLUMN)
    columns = {key: [e.columns.get(key) for e in episodes] for key in names}
    return {
        "prompts": prompts,
        "completions": completions,
        "columns": {**columns, TRACE_COLUMN: [traces[e.episode_id] for e in episodes]},
    }


TRACE_COLUMN = "spans"
"""The column that carries each episode's spans to the rewards that name it."""


def checked_scores(raw: Any, count: int) -> ComponentScores:
    """Returns the scores a reward returned, with each None/NaN/non-number marked failed
    (and all of them failed if it returned the wrong number of scores)."""
    if not isinstance(raw, (list, tuple)) or len(raw) != count:
        got = f"{len(raw)} scores" if isinstance(raw, (list, tuple)) else type(raw).__name__
        return ComponentScores([None] * count, [f"returned {got} for {count} episodes"] * count)
    values: list[float | None] = []
    errors: list[str | None] = []
    details: list[str | None] = []
    for score in raw:
        value = _as_float(score)
        values.append(value)
        errors.append(None if value is not None else f"returned {score!r}")
        details.append(_detail(score))
    return ComponentScores(values, errors, details)


def _detail(score: Any) -> str | None:
    """Returns a Score's detail as JSON text (its text where it does not encode)."""
    if not isinstance(score, Score) or score.detail is None:
        return None
    try:
        text = json.dumps(score.detail, allow_nan=False)
    except (TypeError, ValueError):
        text = json.dumps(repr(score.detail))
    # Too long, it is kept as a JSON string of its beginning.
    return text if len(text) <= MAX_DETAIL_CHARS else json.dumps(text[:MAX_DETAIL_CHARS])


def _as_float(score: Any) -> float | None:
    """Returns a score as a float; None for what the learner cannot take: a non-number,
    NaN, an infinity, or a finite value beyond ±MAX_ABS_REWARD (float32 overflows)."""
    if isinstance(score, bool) or not isinstance(score, (int, float)):
        return None
    try:
        value = float(score)
    except OverflowError:  # an int beyond float
        return None
    return value if math.isfinite(value) and abs(value) <= MAX_ABS_REWARD else None
