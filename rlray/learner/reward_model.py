"""Reward-model training: a sequence-classification head (one output) on a causal LM's
trunk, fit to preference pairs with the Bradley-Terry loss (rlray/algorithms/rl_math.py).

The model scores (prompt, completion) as the `classifier_reward` built-in reads it, through
the same function (rlray.rewards.model_based.classifier_inputs): the tokenizer's text pair
cut to `max_length` tokens, the score at the last token (transformers'
*ForSequenceClassification). The result is saved in HF format with its tokenizer, so
`classifier_reward` loads it and the reward workers score with it in batches, and
`jobs/ppo.py` can train against it.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer
from transformers.utils import logging as hf_logging

from rlray.algorithms import rl_math as rm
from rlray.data.chat import as_texts
from rlray.data.preferences import PreferencePair
from rlray.rewards.model_based import CLASSIFIER_MAX_LENGTH, classifier_inputs


class RewardModelTrainer:
    """Fits a one-output classifier to pairs: the chosen completion scored above the
    rejected one. AdamW in float32 with gradient clipping; given `steps`, the learning
    rate falls from `lr` to 1% of it along a cosine over that many steps (a fresh score
    head needs a large rate to start and a small one to settle). Pairs are read as
    `classifier_reward` reads them, cut to `max_length` tokens (its own default)."""

    def __init__(
        self,
        model_path: str,
        lr: float = 1e-4,
        steps: int | None = None,
        center_coef: float = 0.0,
        max_grad_norm: float = 1.0,
        micro_batch_size: int = 64,
        seed: int = 0,
        device: str = "cpu",
        max_length: int = CLASSIFIER_MAX_LENGTH,
    ):

        torch.manual_seed(seed)
        random.seed(seed)
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # "score.weight newly initialized": it is meant to be
        try:
            self.model = AutoModelForSequenceClassification.from_pretrained(
                model_path, num_labels=1, dtype=torch.float32
            )
        finally:
            hf_logging.set_verbosity(verbosity)
        # The model finds each sequence's last token through the pad token.
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.to(self.device).train()
        self.max_grad_norm = max_grad_norm
        self.center_coef = center_coef
        self.micro_batch_size = micro_batch_size
        self.max_length = max_length
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda done: cosine_factor(done, steps)
        )

    def scores(self, prompts: list[Any], completions: list[Any]) -> torch.Tensor:
        """Returns (N,) scores of (prompt, completion) text pairs, with gradients."""
        prompts, completions = as_texts(prompts, completions)
        inputs = classifier_inputs(self.tokenizer, prompts, completions, self.max_length)
        return self.model(**inputs.to(self.device)).logits[:, 0].float()

    def _pair_scores(self, pairs: list[PreferencePair]) -> tuple[torch.Tensor, torch.Tensor]:
        prompts = [p.prompt for p in pairs]
        chosen = self.scores(prompts, [p.chosen for p in pairs])
        rejected = self.scores(prompts, [p.rejected for p in pairs])
        return chosen, rejected

    def step(self, pairs: list[PreferencePair]) -> dict[str, float]:
        """One AdamW update on the pairs' mean Bradley-Terry loss (gradients accumulated
        over micro-batches); returns the batch's loss, accuracy and margin before it."""
        totals = {"loss": 0.0, "accuracy": 0.0, "margin": 0.0}
        for start in range(0, len(pairs), self.micro_batch_size):
            micro = pairs[start : start + self.micro_batch_size]
            chosen, rejected = self._pair_scores(micro)
            loss = rm.bradley_terry_loss(chosen, rejected, self.center_coef)
            rm.check_finite("reward model loss", loss)
            (loss.sum() / len(pairs)).backward()
            _add(totals, chosen.detach(), rejected.detach(), loss.detach(), len(pairs))
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        lr = self.schedule.get_last_lr()[0]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.schedule.step()
        return {**totals, "grad_norm": float(norm), "lr": lr}

    @torch.no_grad()
    def evaluate(self, pairs: list[PreferencePair]) -> dict[str, float]:
        """Returns the pairs' mean loss, pairwise accuracy (chosen scored above
        rejected) and mean score margin; no update."""
        self.model.eval()
        totals = {"loss": 0.0, "accuracy": 0.0, "margin": 0.0}
        for start in range(0, len(pairs), self.micro_batch_size):
            chosen, rejected = self._pair_scores(pairs[start : start + self.micro_batch_size])
            loss = rm.bradley_terry_loss(chosen, rejected, self.center_coef)
            _add(totals, chosen, rejected, loss, len(pairs))
        self.model.train()
        return totals

    def save(self, directory: str | Path) -> None:
        """Writes the model and tokenizer in HF format (what classifier_reward loads)."""
        self.model.save_pretrained(directory)
        self.tokenizer.save_pretrained(directory)


def cosine_factor(done: int, steps: int | None, floor: float = 0.01) -> float:
    """Returns the learning-rate factor after `done` of `steps` updates: 1 at the start,
    `floor` at the end, along half a cosine; always 1 without a step count."""
    if steps is None:
        return 1.0
    progress = min(done / steps, 1.0)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def _add(
    totals: dict[str, float],
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    loss: torch.Tensor,
    count: int,
) -> None:
    """Adds a micro-batch's share of the batch's mean loss, accuracy and margin."""
    totals["loss"] += float(loss.sum()) / count
    totals["accuracy"] += float((chosen > rejected).float().sum()) / count
    totals["margin"] += float((chosen - rejected).sum()) / count
