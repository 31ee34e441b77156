"""Single-turn requests of a rollout worker: a batch's groups of samples, whole or carried
across calls (partial rollouts), and an agent's model calls (rlray.agent)."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any, NamedTuple

from rlray.config import RolloutConfig
from rlray.core.episode import Episode
from rlray.core.prompt import PromptRow
from rlray.core.stats import GenerateStats
from rlray.data.chat import episode_columns
from rlray.rollout.engine_loop import EngineLoop, Versions
from rlray.rollout.partial import PartialBatches
from rlray.rollout.sampling import (
    Generated,
    ModelCall,
    new_attempt,
    request_params,
    sampling_seed,
    stop_settings,
)


class SampleKey(NamedTuple):
    """What makes a single-turn request's episode, besides vLLM's output."""

    row: PromptRow
    prompt: str
    """The prompt as the model read it (rendered)."""
    index: int
    """The prompt's index in the stream."""
    sample: int
    """The sample index of the request's first completion (the others follow it)."""
    attempt: str
    """The generation attempt's tag (new_attempt)."""


class SingleTurnCalls:
    """Samples single-turn requests and turns vLLM's outputs into episodes (a batch's
    groups) or choices (an agent's model calls).

    A part of RolloutWorker (rlray.rollout.worker), which sets the attributes annotated
    here and provides render, detokenizes, _completion_text and _stats."""

    name: str
    run_id: str
    seed: int
    rollout: RolloutConfig
    loop: EngineLoop
    """Every request goes through it (rlray.rollout.engine_loop)."""
    partial: PartialBatches
    """Groups a partial rollout left running (generate_carrying)."""
    tokenizer: Any
    tokenizer_lock: threading.Lock
    """Held while the tokenizer is used."""

    def _generate_sampled(
        self, rows: list[PromptRow], first_prompt_index: int
    ) -> tuple[list[Episode], GenerateStats]:
        """generate for single-turn requests."""
        started = time.perf_counter()
        rollout = self.rollout
        episodes = self._sampled(
            rows,
            first_prompt_index,
            rollout.samples_per_prompt,
            rollout.temperature,
            rollout.min_new_tokens,
        )
        seconds = time.perf_counter() - started
        tokens = sum(len(e.completion_token_ids) for e in episodes)
        return episodes, self._stats(episodes, tokens, seconds)

    def _sampled(
        self,
        rows: list[PromptRow],
        first_prompt_index: int,
        samples: int,
        temperature: float,
        min_tokens: int = 0,
    ) -> list[Episode]:
        """Returns `samples` single-turn episodes per prompt (temperature 0: greedy)."""
        attempt = new_attempt()
        requests = [
            request
            for offset, row in enumerate(rows)
            for request in self._group_requests(
                row,
                first_prompt_index + offset,
                samples,
                temperature,
                min_tokens,
                attempt,
                one_request=not self.rollout.in_flight_updates,
            )
        ]
        outputs = self.loop.generate([(rid, prompt, params) for rid, prompt, params, _ in requests])
        now = time.time()
        return [
            episode
            for (*_, key), (output, versions) in zip(requests, outputs, strict=True)
            for episode in self._episodes(key, output, versions, now)
        ]

    def _group_requests(
        self,
        row: PromptRow,
        index: int,
        samples: int,
        temperature: float,
        min_tokens: int,
        attempt: str,
        one_request: bool = False,
    ) -> list[tuple[str, Any, Any, SampleKey]]:
        """Returns (request id, prompt, sampling params, key) of the stream's prompt
        `index`'s samples, in generation attempt `attempt` (new_attempt): one request
        each, or with `one_request` one request of `samples`: vLLM then takes in the
        prompt once, not once a sample, and the samples draw the same tokens
        (sampling_seed; BENCHMARKS.md#rollout-throughput-against-plain-vllm). vLLM hands
        such a request's samples over when the last ends, with the versions of the
        request's first and last steps: each sample's own only where no weights load
        while requests run (rollout.in_flight_updates false)."""
        rendered = self.render(row)
        firsts = [0] if one_request else range(samples)
        return [
            (
                f"{attempt}-{index}-{first}",
                {"prompt_token_ids": rendered.token_ids},
                request_params(
                    n=samples if one_request else 1,
                    max_tokens=self.rollout.max_new_tokens,
                    min_tokens=min_tokens,
                    temperature=temperature,
                    logprobs=0,
                    seed=sampling_seed(self.seed, index, first),
                    detokenize=self.detokenizes,
                    **stop_settings(self.rollout),
                ),
                SampleKey(row, rendered.text, index, first, attempt),
            )
            for first in firsts
        ]

    def _carry_sampled(
        self, rows: list[PromptRow], first_prompt_index: int, carry_floor: int | None
    ) -> tuple[list[Episode], GenerateStats]:
        """generate_carrying for single-turn groups (rlray.rollout.partial)."""
        started = time.perf_counter()
        rollout = self.rollout
        indices = [first_prompt_index + offset for offset in range(len(rows))]
        attempt = new_attempt()
        for index, row in zip(indices, rows, strict=True):
            requests = self._group_requests(
                row,
                index,
                rollout.samples_per_prompt,
                rollout.temperature,
                rollout.min_new_tokens,
                attempt,
            )
            self.partial.add(index, requests)
        may_leave = int(len(rows) * rollout.in_flight_carry)
        groups = self.partial.take(indices, may_leave, carry_floor)
        now = time.time()
        episodes = [
            episode
            for group in groups
            for rid, key in group.keys.items()
            for episode in self._episodes(key, *group.outputs[rid], now)
        ]
        seconds = time.perf_counter() - started
        tokens = sum(len(e.completion_token_ids) for e in episodes)
        stats = self._stats(episodes, tokens, seconds)
        stats.returned_prompts = sorted({g.prompt_index for g in groups})
        stats.first_prompt_index = min(stats.returned_prompts, default=None)
        stats.carried_prompts = self.partial.carried_prompts()
        return episodes, stats

    def _episodes(
        self, key: SampleKey, output: Any, versions: Versions, now: float
    ) -> list[Episode]:
        """Returns the episode of each completion of a request's output."""
        return [
            self._episode(key, output, completion, versions, now) for completion in output.outputs
        ]

    def _episode(
        self, key: SampleKey, output: Any, completion: Any, versions: Versions, now: float
    ) -> Episode:
        sample = key.sample + completion.index
        token_ids = list(completion.token_ids)
        logprobs = [
            step[token].logprob for step, token in zip(completion.logprobs, token_ids, strict=True)
        ]
        return Episode(
            run_id=self.run_id,
            episode_id=f"{self.run_id}-{key.index}-{sample}-{key.attempt}",
            prompt_index=key.index,
            sample_index=sample,
            prompt=key.prompt,
            completion=self._completion_text(completion, self.detokenizes),
            prompt_token_ids=list(output.prompt_token_ids),
            completion_token_ids=token_ids,
            rollout_logprobs=logprobs,
            finish_reason=completion.finish_reason or "length",
            policy_version=versions.first,
            last_policy_version=versions.last,
            rollout_worker=self.name,
            columns=episode_columns(key.row),
            generated_at=now,
        )

    def complete(
        self,
        prompt_token_ids: list[int],
        n: int,
        temperature: float,
        max_tokens: int,
        stop: list[str],
        token_texts: bool = False,
    ) -> list[Generated]:
        """Samples `n` completions of one prompt given as token ids (an agent's model call,
        rlray.agent): the exact ids and logprobs vLLM sampled, the text, and the policy
        versions of the call's first and last steps. The run's stop settings apply too."""
        call = ModelCall(prompt_token_ids, n, temperature, max_tokens, stop, token_texts)
        (choices,) = self.complete_calls([call])
        return choices

    def complete_calls(self, calls: list[ModelCall]) -> list[list[Generated]]:
        """Samples several model calls in one engine session, as `complete` samples one:
        the calls an endpoint received together, in one actor call instead of one each.
        Returns each call's choices, in the order given, once every call ended."""
        requests = [self._call_request(call) for call in calls]
        outputs = self.loop.generate(requests)
        return [
            [
                self._generated(c, versions, call.token_texts, params.detokenize)
                for c in output.outputs
            ]
            for call, (_, _, params), (output, versions) in zip(
                calls, requests, outputs, strict=True
            )
        ]

    def _call_request(self, call: ModelCall) -> tuple[str, dict, Any]:
        """Returns (request id, prompt, sampling params) of one model call."""
        settings = stop_settings(self.rollout)
        stop_strings = settings["stop"] + list(call.stop)
        params = request_params(
            n=call.n,
            max_tokens=call.max_tokens,
            temperature=call.temperature,
            logprobs=0,
            stop=stop_strings,
            stop_token_ids=settings["stop_token_ids"],
            detokenize=bool(stop_strings),
        )
        request_id = f"call-{uuid.uuid4().hex[:12]}"
        return request_id, {"prompt_token_ids": call.prompt_token_ids}, params

    def _generated(
        self, completion: Any, versions: Versions, token_texts: bool, detokenized: bool
    ) -> Generated:
        token_ids = list(completion.token_ids)
        logprobs = [
            step[token].logprob for step, token in zip(completion.logprobs, token_ids, strict=True)
        ]
        tokens = []
        if token_texts:
            with self.tokenizer_lock:
                tokens = [self.tokenizer.decode([t]) for t in token_ids]
        return Generated(
            token_ids,
            logprobs,
            self._completion_text(completion, detokenized),
            completion.finish_reason or "length",
            tokens,
            versions.first,
            versions.last,
        )
