"""Learner: PPO on a transformers causal LM with a critic and a frozen reference.

A plain class: tests construct it in-process; rlray.actors wraps it in a Ray actor.
The loss math lives in rlray.ppo_math; this module turns episodes into tensors, runs
the forward passes and the optimizer, and saves and loads checkpoints.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlray import ppo_math as pm
from rlray.config import AlgorithmConfig, LearnerConfig, ModelConfig
from rlray.episode import Episode
from rlray.models import resolve_model_path

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LATEST = "latest"


class ValueModel(nn.Module):
    """Critic: the base transformer of the starting model plus a linear value head."""

    def __init__(self, trunk: nn.Module, hidden_size: int):
        super().__init__()
        self.trunk = trunk
        self.head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.trunk(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.head(hidden).squeeze(-1)  # (B, L)


@dataclass
class TokenBatch:
    """Episodes as right-padded tensors. L: prompt + completion length; T: completion."""

    input_ids: torch.Tensor  # (B, L)
    attention_mask: torch.Tensor  # (B, L)
    completion_ids: torch.Tensor  # (B, T)
    mask: torch.Tensor  # (B, T) 1.0 on real completion tokens
    positions: torch.Tensor  # (B, T) index in L of the logits that predict each completion token
    rollout_logprobs: torch.Tensor  # (B, T)
    has_logprobs: torch.Tensor  # (B,) False for posted episodes that came without logprobs

    def rows(self, index: torch.Tensor) -> TokenBatch:
        """Returns the sub-batch of the given episode rows."""
        return TokenBatch(*(getattr(self, f)[index] for f in self.__dataclass_fields__))


def collate(episodes: list[Episode], pad_token_id: int) -> TokenBatch:
    """Returns the episodes as a right-padded TokenBatch."""
    lengths = [len(e.prompt_token_ids) + len(e.completion_token_ids) for e in episodes]
    width = max(lengths)
    steps = max(max(len(e.completion_token_ids) for e in episodes), 1)
    batch = len(episodes)
    input_ids = torch.full((batch, width), pad_token_id, dtype=torch.long)
    attention = torch.zeros(batch, width, dtype=torch.long)
    completion = torch.full((batch, steps), pad_token_id, dtype=torch.long)
    mask = torch.zeros(batch, steps)
    positions = torch.zeros(batch, steps, dtype=torch.long)
    logprobs = torch.zeros(batch, steps)
    has_logprobs = torch.zeros(batch, dtype=torch.bool)
    for i, e in enumerate(episodes):
        p, c = len(e.prompt_token_ids), len(e.completion_token_ids)
        input_ids[i, : p + c] = torch.tensor(e.prompt_token_ids + e.completion_token_ids)
        attention[i, : p + c] = 1
        completion[i, :c] = torch.tensor(e.completion_token_ids)
        mask[i, :c] = 1.0
        positions[i, :c] = torch.arange(p - 1, p + c - 1)
        if len(e.rollout_logprobs) == c:
            logprobs[i, :c] = torch.tensor(e.rollout_logprobs)
            has_logprobs[i] = True
    return TokenBatch(input_ids, attention, completion, mask, positions, logprobs, has_logprobs)


@dataclass
class StepMetrics:
    """What one learner step reports (a line of metrics.jsonl, with the driver's part)."""

    step: int
    policy_version: int
    episodes: int
    reward_mean: float
    reward_components: dict[str, float]
    """Mean of each reward component over the episodes it scored."""
    policy_loss: float
    value_loss: float
    kl: float
    entropy: float
    clip_fraction: float
    value_clip_fraction: float
    explained_variance: float
    staleness_mean: float
    logprob_parity_error: float | None
    learner_tokens_per_s: float
    learner_seconds: float
    completion_length_mean: float


class Learner:
    """PPO learner: policy, critic, frozen reference and one AdamW optimizer."""

    def __init__(
        self,
        model_path: str,
        model: ModelConfig,
        algorithm: AlgorithmConfig,
        learner: LearnerConfig,
        temperature: float,
        seed: int,
        device: str = "cpu",
        checkpoint: str | None = None,
    ):
        from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # checkpoint saves would print a bar each

        torch.manual_seed(seed)
        from types import SimpleNamespace  # temporary: the engine/algorithm split replaces it

        ppo = SimpleNamespace(**asdict(algorithm), **asdict(learner))
        ppo.clip = algorithm.clip_low or 0.2
        self.ppo = ppo
        self.temperature = temperature
        self.device = torch.device(device)
        model_path = resolve_model_path(model_path)  # the embedded model: built on this node
        self.model_path = model_path
        dtype = _DTYPES[model.dtype]
        policy_path = f"{checkpoint}/policy" if checkpoint else model_path
        self.tokenizer = AutoTokenizer.from_pretrained(policy_path)
        self.pad_token_id = self.tokenizer.pad_token_id
        if self.pad_token_id is None:
            self.pad_token_id = self.tokenizer.eos_token_id
        self.policy = AutoModelForCausalLM.from_pretrained(policy_path, dtype=dtype).to(self.device)
        self.reference = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(
            self.device
        )
        self.reference.requires_grad_(False).eval()
        critic_trunk = AutoModel.from_pretrained(
            f"{checkpoint}/critic" if checkpoint else model_path, dtype=dtype
        )
        self.critic = ValueModel(critic_trunk, self.policy.config.hidden_size).to(
            self.device, dtype
        )
        self.optimizer = torch.optim.AdamW(
            [
                {"params": self.policy.parameters(), "lr": ppo.lr},
                {"params": self.critic.parameters(), "lr": ppo.critic_lr},
            ],
            weight_decay=0.0,
        )
        self.shuffle = torch.Generator().manual_seed(seed)
        self.version = 0
        self.prompt_cursor = 0
        self.probe_parity: float | None = None
        if checkpoint:
            self._load_state(Path(checkpoint))

    # ------------------------------------------------------------------ forward passes

    def _completion_logits(self, model: nn.Module, batch: TokenBatch) -> torch.Tensor:
        logits = model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask
        ).logits  # (B, L, V)
        index = batch.positions.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
        return logits.gather(1, index).float() / self.temperature  # (B, T, V)

    def _completion_values(self, batch: TokenBatch) -> torch.Tensor:
        values = self.critic(batch.input_ids, batch.attention_mask)  # (B, L)
        return values.gather(1, batch.positions).float()  # (B, T)

    def _token_logprobs(self, model: nn.Module, batch: TokenBatch) -> torch.Tensor:
        """Returns (B, T) logprobs of the completion tokens under `model`, no gradient."""
        with torch.no_grad():
            return pm.token_logprobs(self._completion_logits(model, batch), batch.completion_ids)

    def logprobs(self, episodes: list[Episode]) -> list[list[float]]:
        """Returns the policy's logprob of every completion token of each episode."""
        batch = self._to_device(collate(episodes, self.pad_token_id))
        logp = self._token_logprobs(self.policy, batch)
        return [logp[i, : len(e.completion_token_ids)].tolist() for i, e in enumerate(episodes)]

    def _to_device(self, batch: TokenBatch) -> TokenBatch:
        return TokenBatch(*(getattr(batch, f).to(self.device) for f in batch.__dataclass_fields__))

    # ------------------------------------------------------------------ one PPO step

    def train_step(self, episodes: list[Episode]) -> StepMetrics:
        """Runs one PPO update (epochs x mini-batches) on the episodes; returns metrics.

        Episodes without a reward (dropped by a failing reward component under
        reward.on_failure=drop_episode) are left out; if none is left, raises ValueError
        rather than silently train on nothing."""
        started = time.perf_counter()
        ppo = self.ppo
        episodes = [e for e in episodes if e.reward is not None]
        if not episodes:
            raise ValueError("every episode of this step was dropped by a failing reward")
        batch = self._to_device(collate(episodes, self.pad_token_id))
        mask = batch.mask
        current_logp = self._token_logprobs(self.policy, batch)
        ref_logp = self._token_logprobs(self.reference, batch)
        with torch.no_grad():
            old_values = self._completion_values(batch)
        parity = self._parity_error(episodes, current_logp, batch)
        if parity is None:  # nothing fresh in this batch: report the post-sync probe
            parity = self.probe_parity
        self.probe_parity = None
        # The behaviour policy's logprobs (vLLM's) make the importance ratio exact for
        # stale episodes too; on fresh ones they equal current_logp (parity check).
        # Posted episodes without logprobs start from the learner's own (ratio 1).
        old_logp = torch.where(batch.has_logprobs[:, None], batch.rollout_logprobs, current_logp)
        kl = pm.kl_estimate(old_logp, ref_logp, ppo.kl_estimator)
        rewards = torch.tensor([float(e.reward or 0.0) for e in episodes], device=self.device)
        reward_kl_coef = ppo.kl_coef if ppo.kl_mode == "reward" else 0.0
        token_rewards = pm.token_rewards(rewards, kl, mask, reward_kl_coef)
        advantages, returns = pm.gae(token_rewards, old_values, mask, ppo.gamma, ppo.lam)
        if ppo.whiten_advantages:
            advantages = pm.masked_whiten(advantages, mask)
        totals = self._run_epochs(batch, old_logp, ref_logp, old_values, advantages, returns)
        self.version += 1
        seconds = time.perf_counter() - started
        tokens = int(batch.attention_mask.sum()) * ppo.epochs
        return StepMetrics(
            step=self.version,
            policy_version=self.version,
            episodes=len(episodes),
            reward_mean=float(rewards.mean()),
            reward_components=component_means(episodes),
            policy_loss=totals["policy_loss"],
            value_loss=totals["value_loss"],
            kl=float(pm.masked_mean(kl, mask)),
            entropy=totals["entropy"],
            clip_fraction=totals["clip_fraction"],
            value_clip_fraction=totals["value_clip_fraction"],
            explained_variance=pm.explained_variance(old_values, returns, mask),
            staleness_mean=staleness_mean(episodes, self.version - 1),
            logprob_parity_error=parity,
            learner_tokens_per_s=tokens / seconds,
            learner_seconds=seconds,
            completion_length_mean=float(mask.sum(dim=1).mean()),
        )

    def check_parity(self, episodes: list[Episode]) -> float | None:
        """Records (and returns) the parity error of a probe batch made right after a
        weight sync. With max_staleness >= 1 training batches are usually a version old,
        so without a probe a corrupted sync would go unseen; the next train_step reports
        it when its own batch has no fresh episodes."""
        batch = self._to_device(collate(episodes, self.pad_token_id))
        current_logp = self._token_logprobs(self.policy, batch)
        self.probe_parity = self._parity_error(episodes, current_logp, batch)
        return self.probe_parity

    def _parity_error(
        self, episodes: list[Episode], current_logp: torch.Tensor, batch: TokenBatch
    ) -> float | None:
        """Returns max |vLLM logprob - learner logprob| over episodes made by the current
        weights (None if there are none): a corrupted weight sync shows up here."""
        fresh = torch.tensor(
            [e.policy_version == self.version for e in episodes], device=self.device
        )
        if not bool(fresh.any()):
            return None
        gap = (current_logp - batch.rollout_logprobs).abs() * batch.mask
        return float(gap[fresh].max())

    def _run_epochs(
        self, batch, old_logp, ref_logp, old_values, advantages, returns
    ) -> dict[str, float]:
        ppo = self.ppo
        size = batch.input_ids.shape[0]
        sums: dict[str, float] = dict.fromkeys(
            ("policy_loss", "value_loss", "entropy", "clip_fraction", "value_clip_fraction"), 0.0
        )
        weight_total = 0.0
        for _ in range(ppo.epochs):
            order = torch.randperm(size, generator=self.shuffle).to(self.device)
            for start in range(0, size, ppo.minibatch_size):
                minibatch = order[start : start + ppo.minibatch_size]
                token_count = float(batch.mask[minibatch].sum())
                for micro_start in range(0, len(minibatch), ppo.micro_batch_size):
                    rows = minibatch[micro_start : micro_start + ppo.micro_batch_size]
                    parts = self._micro_batch_loss(
                        batch.rows(rows),
                        old_logp[rows],
                        ref_logp[rows],
                        old_values[rows],
                        advantages[rows],
                        returns[rows],
                        token_count,
                    )
                    parts.pop("loss").backward()
                    share = float(batch.mask[rows].sum())
                    for key, value in parts.items():
                        sums[key] += value * share
                    weight_total += share
                nn.utils.clip_grad_norm_(self.policy.parameters(), ppo.max_grad_norm)
                nn.utils.clip_grad_norm_(self.critic.parameters(), ppo.max_grad_norm)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
        return {key: value / max(weight_total, 1.0) for key, value in sums.items()}

    def _micro_batch_loss(
        self, batch, old_logp, ref_logp, old_values, advantages, returns, token_count
    ):
        ppo = self.ppo
        logits = self._completion_logits(self.policy, batch)
        logp = pm.token_logprobs(logits, batch.completion_ids)
        entropy = pm.entropy_from_logits(logits)
        values = self._completion_values(batch)
        policy_loss, clip_fraction = pm.policy_loss(
            logp, old_logp, advantages, batch.mask, ppo.clip, token_count
        )
        value_loss, value_clip_fraction = pm.value_loss(
            values, old_values, returns, batch.mask, ppo.value_clip, token_count
        )
        entropy_mean = pm.masked_mean(entropy, batch.mask, token_count)
        loss = policy_loss + ppo.vf_coef * value_loss - ppo.entropy_coef * entropy_mean
        if ppo.kl_mode == "loss":
            kl = pm.kl_estimate(logp, ref_logp, ppo.kl_estimator)
            loss = loss + ppo.kl_coef * pm.masked_mean(kl, batch.mask, token_count)
        # Per-token means for reporting (the loss terms above are scaled to the mini-batch).
        share = token_count / max(float(batch.mask.sum()), 1.0)
        return {
            "loss": loss,
            "policy_loss": policy_loss.item() * share,
            "value_loss": value_loss.item() * share,
            "entropy": entropy_mean.item() * share,
            "clip_fraction": float(clip_fraction),
            "value_clip_fraction": float(value_clip_fraction),
        }

    # ------------------------------------------------------------------ weights and checkpoints

    def policy_weights(self) -> dict[str, torch.Tensor]:
        """Returns the policy's HF-named weights on CPU, for the rollout workers."""
        # Tied lm_head.weight is sent too: vLLM's CPU backend keeps a separately packed
        # copy of it, which goes stale (logprob error ~2) if only the embedding loads.
        return {
            name: tensor.detach().to("cpu") for name, tensor in self.policy.state_dict().items()
        }

    def save_checkpoint(self, run_dir: str | Path, prompt_cursor: int) -> Path:
        """Writes checkpoints/step-NNNNNN (HF policy + tokenizer, critic, optimizer, RNG,
        cursor) atomically and points checkpoints/latest at it; returns its path."""
        root = Path(run_dir) / "checkpoints"
        final = root / f"step-{self.version:06d}"
        staging = root / f".staging-{self.version:06d}"
        shutil.rmtree(staging, ignore_errors=True)
        self.policy.save_pretrained(staging / "policy")
        self.tokenizer.save_pretrained(staging / "policy")
        self.critic.trunk.save_pretrained(staging / "critic")
        torch.save(self.critic.head.state_dict(), staging / "critic" / "value_head.pt")
        self.prompt_cursor = prompt_cursor
        torch.save(
            {
                "optimizer": self.optimizer.state_dict(),
                "shuffle_rng": self.shuffle.get_state(),
                "torch_rng": torch.random.get_rng_state(),
                "python_rng": random.getstate(),
            },
            staging / "trainer_state.pt",
        )
        state = {
            "version": self.version,
            "step": self.version,
            "prompt_cursor": prompt_cursor,
            "reference_model": self.model_path,
        }
        (staging / "state.json").write_text(json.dumps(state, indent=2))
        shutil.rmtree(final, ignore_errors=True)
        staging.rename(final)
        (root / f"{LATEST}.tmp").write_text(final.name)
        (root / f"{LATEST}.tmp").rename(root / LATEST)
        return final

    def _load_state(self, checkpoint: Path) -> None:
        state = json.loads((checkpoint / "state.json").read_text())
        head = torch.load(checkpoint / "critic" / "value_head.pt", map_location=self.device)
        self.critic.head.load_state_dict(head)
        trainer = torch.load(
            checkpoint / "trainer_state.pt", map_location="cpu", weights_only=False
        )
        self.optimizer.load_state_dict(trainer["optimizer"])
        self.shuffle.set_state(trainer["shuffle_rng"])
        torch.random.set_rng_state(trainer["torch_rng"])
        random.setstate(trainer["python_rng"])
        self.version = int(state["version"])
        self.prompt_cursor = int(state["prompt_cursor"])

    def state(self) -> dict[str, Any]:
        """Returns version and prompt cursor (small)."""
        return {"version": self.version, "prompt_cursor": self.prompt_cursor}


def staleness_mean(episodes: list[Episode], learner_version: int) -> float:
    """Returns how many versions behind the learner this run's episodes were, on average
    (posted episodes, with negative versions, are left out; 0.0 if none is left)."""
    own = [learner_version - e.policy_version for e in episodes if e.policy_version >= 0]
    return sum(own) / len(own) if own else 0.0


def component_means(episodes: list[Episode]) -> dict[str, float]:
    """Returns each reward component's mean over the episodes it has a value for."""
    values: dict[str, list[float]] = {}
    for episode in episodes:
        for name, value in episode.reward_components.items():
            if value is not None:
                values.setdefault(name, []).append(value)
    return {name: sum(v) / len(v) for name, v in values.items()}


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """Returns the run's most recent complete checkpoint, or None."""
    pointer = Path(run_dir) / "checkpoints" / LATEST
    if not pointer.is_file():
        return None
    path = pointer.parent / pointer.read_text().strip()
    return path if (path / "state.json").is_file() else None


def checkpoint_version(checkpoint: str | Path) -> int:
    """Returns the policy version saved in a checkpoint directory."""
    return int(json.loads((Path(checkpoint) / "state.json").read_text())["version"])


def metrics_dict(metrics: StepMetrics) -> dict[str, Any]:
    """Returns the metrics as a JSON-ready dict (NaN becomes None)."""
    return {
        k: (None if isinstance(v, float) and math.isnan(v) else v)
        for k, v in asdict(metrics).items()
    }
