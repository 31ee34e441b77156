"""What every vLLM request of a run shares (its seed, its stop settings), and what one
sampled call gives back."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from rlray.config import RolloutConfig

# Each turn of a trajectory samples with its own seed: turn k adds k times this.
TURN_SEED_STRIDE = 7919


def stop_settings(rollout: RolloutConfig) -> dict[str, list]:
    """Returns the SamplingParams arguments of the stop settings (rollout.stop,
    rollout.stop_token_ids): the same for generation, evaluation and every turn."""
    return {"stop": list(rollout.stop), "stop_token_ids": list(rollout.stop_token_ids)}


def request_params(**settings: Any) -> Any:
    """Returns vLLM's SamplingParams of `settings` for one request, which alone uses them:
    vLLM then copies them shallowly where it would deep-copy them for every request, as
    its own OpenAI server asks (BENCHMARKS.md#rollout-throughput-against-plain-vllm).
    Called in rollout workers only, once vllm_env is set."""
    from vllm.sampling_params import SamplingParams  # not vllm's lazy top-level name

    return SamplingParams(**settings, skip_clone=True)


def new_attempt() -> str:
    """Returns a new generation attempt's tag, the last part of its episodes' ids: a batch
    regenerated after a failure, or by a resumed run, gets new ids, so the store never
    holds one id twice."""
    return uuid.uuid4().hex[:8]


def sampling_seed(run_seed: int, prompt_index: int, sample_index: int, turn: int = 0) -> int:
    """Returns the per-request vLLM seed: sampling does not depend on batch composition,
    and each turn of a trajectory draws anew. A prompt's samples draw with consecutive
    seeds, as vLLM seeds the samples of one request of n (the first's seed + i), so
    that a group sampled as one request draws what its samples drew one request each."""
    group = (run_seed * 1_000_003 + prompt_index * 131 + TURN_SEED_STRIDE * turn) % (2**31 - 1)
    return group + sample_index


@dataclass(frozen=True)
class ModelCall:
    """One agent's model call, as a rollout worker samples it (RolloutWorker.complete_calls)."""

    prompt_token_ids: list[int]
    n: int
    temperature: float
    max_tokens: int
    stop: list[str] = field(default_factory=list)
    """Stop strings of the call's own, on top of the run's (rollout.stop)."""
    token_texts: bool = False
    """Whether to give each sampled token's text (a response's logprobs)."""


@dataclass(frozen=True)
class Generated:
    """One sampled completion, exactly as the engine made it (an agent's model call)."""

    token_ids: list[int]
    logprobs: list[float]
    """The engine's logprob of each sampled token (after temperature)."""
    text: str
    finish_reason: str
    """stop or length, as vLLM says."""
    tokens: list[str] = field(default_factory=list)
    """Each token's text, for a response's logprobs (empty: not asked for)."""
    first_version: int = 0
    """The policy version of the call's first engine step."""
    last_version: int = 0
    """The policy version of its last step (newer if weights were loaded meanwhile)."""
