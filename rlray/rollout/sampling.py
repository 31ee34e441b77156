"""What every vLLM request of a run shares: its seed and its stop settings."""

from __future__ import annotations

from rlray.config import RolloutConfig

# Each turn of a trajectory samples with its own seed: turn k adds k times this.
TURN_SEED_STRIDE = 7919


def stop_settings(rollout: RolloutConfig) -> dict[str, list]:
    """Returns the SamplingParams arguments of the stop settings (rollout.stop,
    rollout.stop_token_ids): the same for generation, evaluation and every turn."""
    return {"stop": list(rollout.stop), "stop_token_ids": list(rollout.stop_token_ids)}


def sampling_seed(run_seed: int, prompt_index: int, sample_index: int, turn: int = 0) -> int:
    """Returns the per-request vLLM seed: sampling does not depend on batch composition,
    and each turn of a trajectory draws anew."""
    seed = run_seed * 1_000_003 + prompt_index * 131 + sample_index + TURN_SEED_STRIDE * turn
    return seed % (2**31 - 1)
