"""Direct Preference Optimization on the learning core: the same Engine (one learner or
a learner group), micro-batches and checkpoints as the RL algorithms.

A batch of B pairs is 2B rows of one TokenBatch: the chosen completions, then the
rejected ones. The reference model's logprobs are computed once per batch; the
policy's, without gradients, right before the update. From them come the margins h,
the loss (rlray/algorithms/rl_math.py: sigmoid DPO with label smoothing, or IPO) and its
derivative with respect to each row's sequence logprob. The update then runs as every
rlray update does (`Engine.train`: micro-batches, a group's split by tokens) on a
surrogate, sum over rows of (that derivative, held constant) x (the row's logprob),
whose gradient at the current weights is exactly the DPO loss's. One optimizer update
per batch, as TRL's DPOTrainer takes one per (accumulated) batch; the price is one
forward pass without gradients per batch.

Sequence logprobs are sums over the completion's tokens for DPO and means for IPO (its
margin target 1/(2 beta) is meant per token, as in TRL).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoTokenizer

from rlray.algorithms import rl_math as rm
from rlray.config import Config
from rlray.core.checkpoints import publish_checkpoint, staging_directory
from rlray.data.chat import render_prompt
from rlray.data.models import resolve_model_path
from rlray.data.preferences import Completion, PreferencePair, preference_batches
from rlray.learner import distributed as dd
from rlray.learner.batches import MiniBatchTotals, Outputs, TokenBatch, collate
from rlray.learner.engine import Engine
from rlray.learner.engine_settings import EngineSettings
from rlray.weights.packing import (
    PackedWeights,
    pack_weights,
    publishable_weights,
    tied_output_name,
)

PREFERENCE_LOSSES = ("sigmoid", "ipo")


@dataclass
class PairScores:
    """A batch of pairs scored: (B,) margins and implicit rewards, and the loss."""

    margins: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    loss: torch.Tensor  # (B,)

    def metrics(self) -> dict[str, float]:
        """Mean loss, reward margin, implicit-reward accuracy (pairs ranked right), and
        the implicit rewards of chosen and rejected completions."""
        return {
            "loss": float(self.loss.mean()),
            "reward_margin": float((self.chosen_rewards - self.rejected_rewards).mean()),
            "accuracy": float((self.margins > 0).float().mean()),
            "chosen_reward": float(self.chosen_rewards.mean()),
            "rejected_reward": float(self.rejected_rewards.mean()),
        }


class DpoTrainer:
    """DPO (or IPO) updates of an Engine's policy on batches of preference pairs. The
    engine must hold a reference model (`with_reference=True`)."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        loss: str = "sigmoid",
        beta: float = 0.1,
        label_smoothing: float = 0.0,
    ):
        if loss not in PREFERENCE_LOSSES:
            raise ValueError(f"preference loss {loss!r}: expected one of {PREFERENCE_LOSSES}")
        if not engine.with_reference:
            raise ValueError("DPO needs the engine's reference model (with_reference=True)")
        self.engine = engine
        self.tokenizer = tokenizer
        self.loss_name = loss
        self.beta = beta
        self.label_smoothing = label_smoothing
        self.pad_token_id = tokenizer.pad_token_id
        if self.pad_token_id is None:
            self.pad_token_id = tokenizer.eos_token_id

    # ------------------------------------------------------------------ tensors

    def token_batch(self, pairs: list[PreferencePair]) -> TokenBatch:
        """Returns the pairs as 2B rows: chosen completions, then rejected ones."""
        prompts = [render_prompt(self.tokenizer, pair.prompt).token_ids for pair in pairs]
        chosen = [self._completion_ids(pair.chosen) for pair in pairs]
        rejected = [self._completion_ids(pair.rejected) for pair in pairs]
        batch = collate(prompts + prompts, chosen + rejected, self.pad_token_id)
        return batch.to(self.engine.device)

    def _completion_ids(self, completion: Completion) -> list[int]:
        """A completion's tokens as the model would generate them: its text, then EOS."""
        text = (
            completion
            if isinstance(completion, str)
            else "".join(message["content"] for message in completion)
        )
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        return [*ids, self.tokenizer.eos_token_id]

    def _sequence_logprobs(self, logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Returns (rows,) sums (DPO) or means (IPO) of the tokens' logprobs."""
        total = rm.masked_sum(logp, mask, dim=1)
        return total / mask.sum(dim=1) if self.loss_name == "ipo" else total

    # ------------------------------------------------------------------ the loss

    def scores(self, policy: torch.Tensor, reference: torch.Tensor) -> PairScores:
        """Returns the pairs' scores from (2B,) policy and reference sequence logprobs."""
        pairs = policy.shape[0] // 2
        margins = rm.preference_margins(
            policy[:pairs], policy[pairs:], reference[:pairs], reference[pairs:]
        )
        if self.loss_name == "ipo":
            loss = rm.ipo_loss(margins, self.beta)
        else:
            loss = rm.dpo_loss(margins, self.beta, self.label_smoothing)
        return PairScores(
            margins=margins,
            chosen_rewards=rm.implicit_rewards(policy[:pairs], reference[:pairs], self.beta),
            rejected_rewards=rm.implicit_rewards(policy[pairs:], reference[pairs:], self.beta),
            loss=loss,
        )

    def row_weights(self, policy: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
        """Returns (2B,) d(mean pair loss) / d(each row's sequence logprob) at these
        logprobs, by autograd through the loss itself."""
        policy = policy.detach().clone().requires_grad_(True)
        self.scores(policy, reference.detach()).loss.mean().backward()
        return policy.grad

    # ------------------------------------------------------------------ steps

    def evaluate(self, pairs: list[PreferencePair]) -> dict[str, float]:
        """Returns the pairs' loss, reward margin and implicit-reward accuracy; no update."""
        batch = self.token_batch(pairs)
        policy, reference = self._logprobs(batch)
        return self.scores(policy, reference).metrics()

    def step(self, pairs: list[PreferencePair]) -> dict[str, float]:
        """Runs one update on the pairs; returns the batch's metrics before it (loss,
        margin, accuracy, implicit rewards) and the update's gradient norm."""
        batch = self.token_batch(pairs)
        policy, reference = self._logprobs(batch)
        scores = self.scores(policy, reference)
        rm.check_finite("DPO loss", scores.loss)
        weights = self.row_weights(policy, reference)
        (update,) = self.engine.train(
            batch, batch.mask, self._surrogate(batch, weights), epochs=1, minibatch_size=batch.size
        )
        return {**scores.metrics(), "grad_norm": update["grad_norm"]}

    def _logprobs(self, batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (2B,) policy and reference sequence logprobs, without gradients."""
        policy = self.engine.score(batch, with_values=False).logp
        reference = self.engine.reference_logprobs(batch)
        return (
            self._sequence_logprobs(policy, batch.mask),
            self._sequence_logprobs(reference, batch.mask),
        )

    def _surrogate(
        self, batch: TokenBatch, weights: torch.Tensor
    ) -> Callable[[Outputs, torch.Tensor, MiniBatchTotals], tuple[torch.Tensor, dict]]:
        def loss_fn(outputs: Outputs, rows: torch.Tensor, totals: MiniBatchTotals):
            logp = self._sequence_logprobs(outputs.logp, batch.mask[rows])
            return (weights[rows] * logp).sum(), {}

        return loss_fn


def dpo_trainer(config: Config, model_path: str, device: str = "cpu") -> tuple[DpoTrainer, Any]:
    """Returns the DPO trainer of a config (an Engine with its reference model, sharded
    across the learner group if one is joined) and the model's tokenizer."""
    preference = config.preference
    engine = Engine(model_path, EngineSettings.for_preferences(config, device))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    trainer = DpoTrainer(
        engine, tokenizer, preference.loss, preference.beta, preference.label_smoothing
    )
    return trainer, tokenizer


class PreferenceLearner:
    """One learner of jobs/dpo.py: the DPO trainer, its batches and held-out pairs. Each
    learner of a group builds every step's pairs itself from the config (seeded: the
    same pairs in every learner), so no pair passes through the driver; every method is
    called on every learner of the group, as each takes part in its collectives, and
    rank 0's result is the group's.

    Greedy exact match on held-out prompts with answers is an evaluation actor's (vLLM),
    which loads the weights the group publishes (`publish_weights`)."""

    def __init__(self, config: Config, model_path: str, device: str = "cpu"):
        model_path = resolve_model_path(model_path)  # the embedded model: built on this node
        self.batches, self.held_out = preference_batches(config)
        self.trainer, self.tokenizer = dpo_trainer(config, model_path, device)
        self.model_path = model_path
        self.dtype = getattr(torch, config.model.dtype)

    def step(self, step: int) -> dict[str, float]:
        """Runs the update of step `step` (1, 2, ...) on its pairs; returns its metrics."""
        return {"step": step, **self.trainer.step(self.batches(step))}

    def evaluate(self, step: int) -> dict[str, float]:
        """Returns the held-out pairs' loss, margin and implicit-reward accuracy."""
        pairs = self.trainer.evaluate(self.held_out)
        return {f"pairs/{key}": value for key, value in pairs.items()}

    def publish_weights(self, step: int) -> tuple[int, PackedWeights | None]:
        """Returns (step, the policy's weights packed for a rollout actor) on rank 0 and
        (step, None) on the others; every learner gathers them."""
        policy, keep = self.trainer.engine.policy, self.trainer.engine.rank == 0
        weights = publishable_weights(policy, self.dtype, keep=keep)
        return step, pack_weights(weights, tied_output_name(policy)) if keep else None

    def save_checkpoint(self, run_dir: str, step: int) -> None:
        """Writes checkpoints/step-NNNNNN (HF policy and tokenizer, optimizer state: each
        learner its shard) and points checkpoints/latest at it."""
        writer = self.trainer.engine.rank == 0
        staging = staging_directory(run_dir, step, create=writer)
        dd.barrier()  # the staging directory exists for every learner
        self.trainer.engine.save(staging, self.tokenizer)
        dd.barrier()  # every learner's shard is written
        if writer:
            state = {"version": step, "step": step, "reference_model": self.model_path}
            publish_checkpoint(staging, state)
