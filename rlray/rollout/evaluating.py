"""Held-out evaluation and the weight sync's parity check, on a rollout worker's engine."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from rlray.core.episode import Episode
from rlray.core.evaluation import EvalEpisodes
from rlray.core.parity import ParitySample, parity_gap
from rlray.core.prompt import PromptRow
from rlray.core.stats import EvalResult
from rlray.rewards.text import exact_match
from rlray.rewards.trace import environment_total
from rlray.rollout.engine_loop import EngineLoop
from rlray.rollout.sampling import request_params


def _exact_match_accuracy(greedy: list[Episode], rows: list[PromptRow]) -> float | None:
    """Returns the share of greedy completions that match their row's answer exactly;
    None unless every row is a text prompt with an answer (a chat reply is read by the
    eval rewards: an answer in tags, a boxed number)."""
    if not all("answer" in r.columns and isinstance(r.prompt, str) for r in rows):
        return None
    answers = [str(r.columns["answer"]) for r in rows]
    scores = exact_match([e.prompt for e in greedy], [e.completion for e in greedy], answer=answers)
    return sum(scores) / len(scores)


def _shown_prompt(row: PromptRow, episode: Episode) -> str:
    """Returns a prompt as an evaluation's example shows it: a text prompt whole, a chat
    prompt by its last message (its rendering repeats the template's system prompt)."""
    if isinstance(row.prompt, str):
        return episode.prompt
    return f"{row.prompt[-1]['content']} "


class Evaluation:
    """Evaluates held-out prompts (greedy and sampled episodes) and scores given tokens
    by prefill (the parity check of a weight sync).

    A part of RolloutWorker (rlray.rollout.worker), which sets the attributes annotated
    here and provides policy_version, release_batch_garbage, multi_turn_episodes
    (rlray.rollout.turns) and _sampled (rlray.rollout.model_calls)."""

    loop: EngineLoop
    """Every request goes through it (rlray.rollout.engine_loop)."""
    make_environment: Callable[[], Any] | None
    """Makes one trajectory's environment (rollout.environment); None: single-turn."""

    def eval_episodes(
        self, rows: list[PromptRow], samples: int = 0, temperature: float = 1.0, examples: int = 3
    ) -> tuple[EvalEpisodes, EvalResult]:
        """Returns each held-out prompt's greedy episode and `samples` sampled ones at
        `temperature` (prompt_index -len(rows) + i for row i, as seeds and scores name
        it), and the greedy exact-match accuracy with a few examples.

        Sampling seeds depend on the run seed, the prompt and the sample only, so that
        every model evaluated with one seed draws with the same random numbers: their
        differences are the models', not the draws'."""
        try:
            return self._eval_episodes(rows, samples, temperature, examples)
        finally:
            self.release_batch_garbage()

    def _eval_episodes(
        self, rows: list[PromptRow], samples: int, temperature: float, examples: int
    ) -> tuple[EvalEpisodes, EvalResult]:
        first = -len(rows)
        if self.make_environment is not None:

            def run(count: int, temp: float) -> list[Episode]:
                return self.multi_turn_episodes(rows, first, samples=count, temperature=temp)

            greedy = run(1, 0.0)
            accuracy = sum(environment_total(e.spans) or 0.0 for e in greedy) / len(greedy)
        else:

            def run(count: int, temp: float) -> list[Episode]:
                return self._sampled(rows, first, count, temp)

            greedy = run(1, 0.0)
            accuracy = _exact_match_accuracy(greedy, rows)
        sampled = run(samples, temperature) if samples else []
        answers = [str(r.columns.get("answer", "")) for r in rows]
        shown = [
            (_shown_prompt(r, e), e.completion, a)
            for r, e, a in zip(rows, greedy, answers, strict=True)
        ]
        result = EvalResult(accuracy, self.policy_version, shown[:examples])
        return EvalEpisodes(greedy, sampled), result

    def evaluate(self, rows: list[PromptRow], examples: int = 3) -> EvalResult:
        """Returns the greedy exact-match accuracy against each row's 'answer' (None
        without answers; with an environment: the mean reward it gave greedy
        trajectories)."""
        return self.eval_episodes(rows, examples=examples)[1]

    def parity_gap(self, sample: ParitySample) -> float | None:
        """Returns how far this engine's logprobs of the sample's tokens are from the
        learner's (rlray.core.parity): a weight sync's check, made once the weights the
        learner had then are loaded."""
        return parity_gap(sample, self.token_logprobs(sample.episodes))

    def token_logprobs(self, episodes: list[Episode]) -> list[list[float]]:
        """Returns this engine's logprob of each episode's completion tokens, each after
        its prompt and the tokens before it, at temperature 1: the tokens go in as one
        prompt and vLLM gives its prompt logprobs (computed before any sampling
        processor, and never from a prefix cached under other weights). A prefill, no
        generation: how a weight sync is checked on a batch's own tokens."""
        if not episodes:  # the sync before any step: nothing to check
            return []
        attempt = uuid.uuid4().hex[:8]
        requests = [
            (
                f"parity-{attempt}-{i}",
                {"prompt_token_ids": [*e.prompt_token_ids, *e.completion_token_ids]},
                request_params(max_tokens=1, prompt_logprobs=0, detokenize=False),
            )
            for i, e in enumerate(episodes)
        ]
        outputs = self.loop.generate(requests)
        scored = []
        for episode, (output, _) in zip(episodes, outputs, strict=True):
            steps = output.prompt_logprobs[len(episode.prompt_token_ids) :]
            tokens = episode.completion_token_ids
            scored.append([step[token].logprob for step, token in zip(steps, tokens, strict=True)])
        return scored
