"""What an Engine is built with: the learner's and model's config sections, read once
(rlray/learner/engine.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlray.config import Config, LearnerConfig, ModelConfig

COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class EngineSettings:
    """How an Engine builds its models and runs its passes and updates. The defaults
    are a bare policy on CPU in float32, for tests and benchmarks."""

    dtype: str = "float32"
    """Compute dtype (COMPUTE_DTYPES): weights and optimizer state stay float32."""
    device: str = "cpu"
    """Where the models, the optimizer's state and the passes live."""
    lr: float = 1e-5
    """AdamW learning rate of the policy (its adapters with LoRA)."""
    critic_lr: float = 1e-4
    """AdamW learning rate of the critic."""
    max_grad_norm: float = 1.0
    """Clipping norm of the policy's gradient, and of the critic's apart."""
    micro_batch_size: int = 64
    """Rows a forward/backward pass holds at most."""
    micro_batch_tokens: int = 0
    """Padded tokens a forward/backward pass holds at most; 0: only rows bound it."""
    temperature: float = 1.0
    """Sampling temperature the logits are divided by, as the rollout workers sampled."""
    with_reference: bool = False
    """Hold the frozen starting model for KL (with LoRA: the policy without adapters)."""
    with_critic: bool = False
    """Hold a critic: the starting model's trunk with a linear value head."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass instead of keeping them."""
    compile_layers: bool = False
    """torch.compile each decoder layer of every model held."""
    seed: int = 0
    """Seed of the initial weights drawn here and of the mini-batches' shuffle."""
    lora_rank: int = 0
    """Rank of the LoRA adapters the policy trains; 0: every weight trains."""
    lora_alpha: float = 16.0
    """LoRA scale numerator (alpha / rank)."""
    lora_targets: tuple[str, ...] = ("all-linear",)
    """Module names that get adapters."""

    def __post_init__(self) -> None:
        if self.dtype not in COMPUTE_DTYPES:
            raise ValueError(
                f"compute dtype {self.dtype!r}: expected one of {list(COMPUTE_DTYPES)}"
            )

    @classmethod
    def from_config(
        cls,
        model: ModelConfig,
        learner: LearnerConfig,
        *,
        temperature: float,
        seed: int,
        device: str,
        with_reference: bool,
        with_critic: bool,
    ) -> EngineSettings:
        """Returns the RL learner's settings: the model's and learner's sections, the
        rollout's sampling temperature, and the models its algorithm needs."""
        return cls(
            dtype=model.dtype,
            device=device,
            lr=learner.lr,
            critic_lr=learner.critic_lr,
            max_grad_norm=learner.max_grad_norm,
            micro_batch_size=learner.micro_batch_rows,
            micro_batch_tokens=learner.micro_batch_token_budget,
            temperature=temperature,
            with_reference=with_reference,
            with_critic=with_critic,
            gradient_checkpointing=learner.gradient_checkpointing,
            compile_layers=learner.compile,
            seed=seed,
            lora_rank=model.lora.rank,
            lora_alpha=model.lora.alpha,
            lora_targets=tuple(model.lora.target_modules),
        )

    @classmethod
    def for_preferences(cls, config: Config, device: str) -> EngineSettings:
        """Returns the DPO learner's settings: a reference model and no critic, every
        weight trained, logprobs at temperature 1 (pairs are not sampled here)."""
        learner = config.learner
        return cls(
            dtype=config.model.dtype,
            device=device,
            lr=learner.lr,
            max_grad_norm=learner.max_grad_norm,
            micro_batch_size=learner.micro_batch_rows,
            micro_batch_tokens=learner.micro_batch_token_budget,
            with_reference=True,
            gradient_checkpointing=learner.gradient_checkpointing,
            compile_layers=learner.compile,
            seed=config.seed,
        )
