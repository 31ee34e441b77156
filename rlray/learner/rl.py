"""Learner: one step of the configured algorithm on a batch of episodes.

A plain class: tests construct it in-process; rlray.cluster wraps it in a Ray actor.
It composes the engine (rlray/learner/engine.py: models, forward passes, micro-batches,
optimizer, checkpoints; built from its EngineSettings) and the algorithm
(rlray/algorithms/algorithm.py: advantages and losses), and turns episodes into the
tensors they exchange.

The ratio's old logprobs are the learner's own, computed before the update. vLLM's
logprobs enter only through the rollout-correction weight, and the step reports how
far they are from the learner's: that gap is rollout/learner mismatch (bf16 kernels,
a corrupted sync) plus staleness.
"""

from __future__ import annotations

import itertools
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from rlray.algorithms import rl_math as rm
from rlray.algorithms.algorithm import Advantages, Algorithm, MicroBatch, StepInputs
from rlray.config import AlgorithmConfig, LearnerConfig, ModelConfig
from rlray.core.checkpoints import (
    publish_sealed,
    resume_point,
    seal_checkpoint,
    staging_directory,
)
from rlray.core.episode import Episode, ModelLimits, validate_episodes
from rlray.core.files import writing
from rlray.core.groups import check_whole_groups, group_indexes, sample_indexes
from rlray.core.parity import ParitySample
from rlray.core.stats import StepMetrics, component_means, staleness_max, staleness_mean
from rlray.data.models import resolve_model_path
from rlray.learner import distributed as dd
from rlray.learner.batches import MiniBatchTotals, Outputs, TokenBatch, TokenCounts, collate
from rlray.learner.engine import Engine, LossFn
from rlray.learner.engine_settings import EngineSettings
from rlray.weights.packing import publishable_weights, tied_output_name

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

PARITY_EPISODES = 2
"""Episodes of a step's batch that the parity check after its weight sync scores."""


@dataclass
class PreparedStep:
    """A step's tensors, (B, ...) each, computed once before the update."""

    batch: TokenBatch
    inputs: StepInputs
    rollout_logp: torch.Tensor  # (B, T) vLLM's logprobs (0 where unknown)
    known: torch.Tensor  # (B,) bool: the episode came with vLLM logprobs
    correction: torch.Tensor  # (B, T) rollout-correction weights
    advantages: Advantages
    truncated: torch.Tensor  # (B,) bool: cut off at the length limit
    loss_mask: torch.Tensor  # (B, T) tokens that enter the loss

    @property
    def known_mask(self) -> torch.Tensor:
        """(B, T) completion tokens that have vLLM logprobs."""
        return self.batch.mask * self.known[:, None]


class Learner:
    """Composes an Engine and an Algorithm; keeps the policy version and prompt cursor.

    `lent_cores`: how many idle cores of its node's rollout workers the learner may use
    now (Engine's; learner.borrow_idle_cores). `fuse_old_logprobs`: whether steps with
    one update take the logprobs before it from their own forward pass
    (fuses_old_logprobs); tests turn it off to compare."""

    def __init__(
        self,
        model_path: str,
        model: ModelConfig,
        algorithm: AlgorithmConfig,
        learner: LearnerConfig,
        *,
        max_new_tokens: int,
        samples_per_prompt: int,
        temperature: float,
        seed: int,
        device: str = "cpu",
        checkpoint: str | None = None,
        lent_cores: Callable[[], int] | None = None,
    ):
        self.model_path = model_path = resolve_model_path(model_path)  # built on this node
        self.algorithm = Algorithm(algorithm, max_new_tokens)
        self.learner = learner
        self.samples_per_prompt = samples_per_prompt
        self.rollout_dtype = _DTYPES[model.dtype]
        settings = EngineSettings.from_config(
            model,
            learner,
            temperature=temperature,
            seed=seed,
            device=device,
            with_reference=self.algorithm.needs_reference,
            with_critic=self.algorithm.needs_critic,
        )
        self.engine = Engine(model_path, settings, checkpoint=checkpoint, lent_cores=lent_cores)
        self.device = self.engine.device
        tokenizer = f"{checkpoint}/policy" if checkpoint else model_path
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        self.pad_token_id = _pad_token_id(self.tokenizer)
        vocab_size = self.engine.policy.get_input_embeddings().num_embeddings
        self.limits = ModelLimits(vocab_size=vocab_size, max_model_len=model.max_model_len)
        self.version, self.prompt_cursor = resume_point(checkpoint)
        self.fuse_old_logprobs = True
        self.parity_episodes: list[Episode] = []  # the last step's, for the sync check
        self.sender: Any = None  # rlray.weights.transfer.TransferSender, once opened

    # ------------------------------------------------------------------ tensors

    def _batch(self, episodes: list[Episode]) -> TokenBatch:
        prompts = [e.prompt_token_ids for e in episodes]
        completions = [e.completion_token_ids for e in episodes]
        masks = [e.completion_mask for e in episodes]
        return collate(prompts, completions, self.pad_token_id, masks).to(self.device)

    def _rollout_logprobs(self, episodes: list[Episode], steps: int) -> tuple[torch.Tensor, ...]:
        """Returns vLLM's (B, T) logprobs and which rows have them (posted episodes may not)."""
        rows, known = [], []
        for e in episodes:
            has = bool(e.completion_token_ids) and len(e.rollout_logprobs) == len(
                e.completion_token_ids
            )
            logprobs = e.rollout_logprobs if has else []
            rows.append(logprobs + [0.0] * (steps - len(logprobs)))
            known.append(has)
        return (
            torch.tensor(rows, dtype=torch.float32, device=self.device),
            torch.tensor(known, dtype=torch.bool, device=self.device),
        )

    def logprobs(
        self, episodes: list[Episode], temperature: float | None = None
    ) -> list[list[float]]:
        """Returns the policy's logprob of every completion token of each episode (at
        the sampling temperature unless given)."""
        batch = self._batch(episodes)
        logp = self.engine.score(batch, with_values=False, temperature=temperature).logp
        return [logp[i, : len(e.completion_token_ids)].tolist() for i, e in enumerate(episodes)]

    # ------------------------------------------------------------------ one step

    def train_step(self, episodes: list[Episode]) -> StepMetrics:
        """Runs one update of the algorithm (epochs x mini-batches) on the episodes; returns
        metrics. Every group of this run's prompts must be whole (all samples_per_prompt
        samples), else ValueError. Episodes without a reward (a failing reward under
        reward.on_failure=drop_episode) are left out; if none is left, ValueError.

        Nothing is updated from a bad step: an episode the schema or the model cannot
        take raises EpisodeError naming it; NaN or infinite rewards, advantages or losses
        raise rl_math.NonFiniteError naming them, before any gradient of them is taken."""
        started = time.perf_counter()
        check_whole_groups(episodes, self.samples_per_prompt)
        episodes = [e for e in episodes if e.reward is not None]
        if not episodes:
            raise ValueError("every episode of this step was dropped by a failing reward")
        validate_episodes(episodes, self.limits, where=f"step {self.version + 1}: episodes")
        self.parity_episodes = self._parity_candidates(episodes)
        self.engine.token_counts = TokenCounts()
        fused = self.fuses_old_logprobs(len(episodes))
        step = self._prepare(episodes, fused)
        try:
            updates = self.engine.train(
                step.batch,
                step.loss_mask,
                self._loss_fn(step, fused),
                self.learner.epochs,
                self.learner.minibatch_size,
                entropy_grad=self.algorithm.needs_entropy_gradient,
            )
        except rm.NonFiniteError as err:  # the engine's gradient check: name the step too
            if str(err).startswith("step "):
                raise
            raise rm.NonFiniteError(f"step {self.version + 1}: {err}") from None
        # The logprobs before the update: the step's first pass's, or (fused) the update's.
        old_logp = step.inputs.old_logp
        # None when nothing in this batch is of the current version: the driver then
        # reports the check of the last sync (rlray.core.parity).
        parity = self._parity_error(episodes, old_logp, step.rollout_logp, step.known_mask)
        self.version += 1
        return self._metrics(episodes, step, updates, parity, time.perf_counter() - started)

    def fuses_old_logprobs(self, episodes: int) -> bool:
        """Whether a step of `episodes` takes the logprobs before its update from the
        update's own forward pass instead of a pass of its own: where they are the same
        numbers, with one update per step (one epoch, one mini-batch) and nothing else
        computed from them before it (no critic, no reference), on one learner. A pass
        over the batch saved: the step is a forward and a backward pass, without a
        forward pass before them. The gradient is the same: the ratio is exactly 1, as it
        is to float precision with a pass of its own."""
        whole = self.learner.minibatch_size in (0, None) or self.learner.minibatch_size >= episodes
        one_update = self.learner.epochs == 1 and whole
        algorithm = self.algorithm
        alone = not (algorithm.needs_critic or algorithm.needs_reference)
        return self.fuse_old_logprobs and one_update and alone and self.engine.world_size == 1

    def _prepare(self, episodes: list[Episode], fused: bool = False) -> PreparedStep:
        """Returns the step's tensors: the learner's logprobs before the update (and the
        critic's values, the reference's logprobs), vLLM's, the rollout correction and
        the algorithm's advantages. `fused`: the logprobs before the update, and the
        rollout correction computed from them, are filled in by the update's own forward
        pass (`_loss_fn`); until then they are zeros and ones."""
        batch = self._batch(episodes)
        if fused:
            before = Outputs(logp=torch.zeros_like(batch.mask), entropy=None, values=None)
        else:
            before = self.engine.score(batch, with_values=self.algorithm.needs_critic)
        rollout_logp, known = self._rollout_logprobs(episodes, batch.completion_columns)
        # Rows without vLLM logprobs take the learner's own: weight 1 (ratio 1).
        behaviour = torch.where(known[:, None], rollout_logp, before.logp)
        is_truncated = torch.tensor(
            [e.finish_reason == "length" for e in episodes], device=self.device
        )
        inputs = StepInputs(
            rewards=torch.tensor([float(e.reward) for e in episodes], device=self.device),
            group=torch.tensor(group_indexes(episodes), device=self.device),
            sample=torch.tensor(sample_indexes(episodes), device=self.device),
            mask=batch.mask,
            old_logp=before.logp,
            ref_logp=self.engine.reference_logprobs(batch),
            values=before.values,
        )
        step = f"step {self.version + 1}"
        rm.check_finite(f"{step}: rewards", inputs.rewards)
        rm.check_finite(f"{step}: the learner's logprobs", before.logp, batch.mask)
        advantages = self.algorithm.advantages(inputs)
        rm.check_finite(f"{step}: advantages", advantages.advantages, batch.mask)
        if advantages.returns is not None:
            rm.check_finite(f"{step}: returns", advantages.returns, batch.mask)
        return PreparedStep(
            batch=batch,
            inputs=inputs,
            rollout_logp=rollout_logp,
            known=known,
            correction=self.algorithm.correction_weights(before.logp, behaviour, batch.mask),
            advantages=advantages,
            truncated=is_truncated,
            loss_mask=self.algorithm.loss_mask(batch.mask, is_truncated),
        )

    def _loss_fn(self, step: PreparedStep, fused: bool = False) -> LossFn:
        """Returns the engine's loss function: the algorithm's loss on a micro-batch's rows
        (`fused`: first their logprobs before the update, and their rollout correction,
        from the micro-batch's forward pass)."""
        inputs, advantages = step.inputs, step.advantages

        def loss_fn(outputs: Outputs, rows: torch.Tensor, totals: MiniBatchTotals):
            if fused:
                self._fill_old_logprobs(step, outputs.logp.detach(), rows)
            micro = MicroBatch(
                logp=outputs.logp,
                mask=step.loss_mask[rows],
                old_logp=inputs.old_logp[rows],
                advantages=advantages.advantages[rows],
                correction=step.correction[rows],
                entropy=outputs.entropy,
                values=outputs.values,
                old_values=_rows(inputs.values, rows),
                returns=_rows(advantages.returns, rows),
                ref_logp=_rows(inputs.ref_logp, rows),
            )
            loss, metrics = self.algorithm.loss(
                micro, totals.tokens, totals.sequences, totals.sampled
            )
            rm.check_finite(f"step {self.version + 1}: loss", loss)  # before its backward
            return loss, metrics

        return loss_fn

    def _fill_old_logprobs(
        self, step: PreparedStep, logp: torch.Tensor, rows: torch.Tensor
    ) -> None:
        """Sets the rows' logprobs before the update (`logp`: their forward pass, without
        gradient, one update per step) and the rollout correction computed from them."""
        mask = step.batch.mask[rows]
        rm.check_finite(f"step {self.version + 1}: the learner's logprobs", logp, mask)
        step.inputs.old_logp[rows] = logp
        behaviour = torch.where(step.known[rows, None], step.rollout_logp[rows], logp)
        step.correction[rows] = self.algorithm.correction_weights(logp, behaviour, mask)

    def _metrics(
        self,
        episodes: list[Episode],
        step: PreparedStep,
        updates: list[dict[str, float]],
        parity: float | None,
        seconds: float,
    ) -> StepMetrics:
        mask, inputs, adv = step.batch.mask, step.inputs, step.advantages.advantages
        mean = {k: sum(u.get(k, 0.0) for u in updates) / len(updates) for k in updates[0]}
        critic = self.algorithm.needs_critic
        mismatch = None
        if bool(step.known.any()):
            gaps = rm.logprob_mismatch(inputs.old_logp, step.rollout_logp, step.known_mask)
            mismatch = {key: float(value) for key, value in gaps.items()}
        kl = step.advantages.kl
        tokens = int(step.batch.attention_mask.sum())
        return StepMetrics(
            step=self.version,
            policy_version=self.version,
            episodes=len(episodes),
            optimizer_updates=len(updates),
            groups=int(inputs.group.max()) + 1,
            reward_mean=float(inputs.rewards.mean()),
            reward_components=component_means(episodes),
            policy_loss=mean["policy_loss"],
            clip_fraction=mean["clip_fraction"],
            entropy=mean["entropy"],
            grad_norm=mean["grad_norm"],
            advantage_abs_mean=float(rm.masked_mean(adv.abs(), step.loss_mask)),
            zero_advantage_share=float(((adv * mask).abs().sum(dim=1) == 0).float().mean()),
            value_loss=mean["value_loss"] if critic else None,
            value_clip_fraction=mean["value_clip_fraction"] if critic else None,
            explained_variance=(
                rm.explained_variance(inputs.values, step.advantages.returns, mask)
                if critic
                else None
            ),
            kl=None if kl is None else float(rm.masked_mean(kl, mask)),
            staleness_mean=staleness_mean(episodes, self.version - 1),
            staleness_max=staleness_max(episodes, self.version - 1),
            logprob_parity_error=parity,
            rollout_logprob_diff_mean=mismatch and mismatch["mean"],
            rollout_logprob_diff_max=mismatch and mismatch["max"],
            rollout_ratio_outside_share=mismatch and mismatch["outside_share"],
            rollout_correction_weight_mean=float(rm.masked_mean(step.correction, mask)),
            episodes_without_logprobs=int((~step.known).sum()),
            truncated_share=float(step.truncated.float().mean()),
            learner_tokens_per_s=tokens * self.learner.epochs / seconds,
            learner_seconds=seconds,
            completion_length_mean=float(mask.sum(dim=1).mean()),
            learner_tokens_computed=self.engine.token_counts.computed,
            learner_padding_tokens=self.engine.token_counts.padding,
            learner_borrowed_tokens=self.engine.token_counts.borrowed,
        )

    def parity_sample(self) -> ParitySample:
        """Returns a few episodes of the last step's batch with the current weights'
        logprobs of their completion tokens at temperature 1: what a rollout engine
        holding the same weights gives those tokens (RolloutWorker.parity_gap compares).
        With max_staleness >= 1 a training batch is usually a version old, so its own
        logprobs cannot show a corrupted sync; this check can, with its own tokens: a
        forward pass here and a prefill in the engine over a few episodes, no
        generation."""
        episodes = self.parity_episodes
        logprobs = self.logprobs(episodes, temperature=1.0) if episodes else []
        return ParitySample(episodes, logprobs, self.version)

    def _parity_candidates(self, episodes: list[Episode]) -> list[Episode]:
        """The first PARITY_EPISODES episodes with a policy token that an engine can take
        whole as a prompt (one token short of the model's length: it samples one)."""
        room = self.limits.max_model_len - 1
        fit = (
            e
            for e in episodes
            if (not e.completion_mask or any(e.completion_mask))
            and e.completion_token_ids
            and len(e.prompt_token_ids) + len(e.completion_token_ids) <= room
        )
        return list(itertools.islice(fit, PARITY_EPISODES))

    def _parity_error(
        self,
        episodes: list[Episode],
        logp: torch.Tensor,
        rollout_logp: torch.Tensor,
        mask: torch.Tensor,
    ) -> float | None:
        """Returns max |vLLM logprob - learner logprob| over the `mask` tokens of episodes
        made by the current weights (None if there are none): a corrupted weight sync
        shows up here."""
        fresh = torch.tensor([e.policy_version == self.version for e in episodes])
        fresh = fresh.to(self.device) & (mask.sum(dim=1) > 0)
        if not bool(fresh.any()):
            return None
        gap = (logp - rollout_logp).abs() * mask
        return float(gap[fresh].max())

    # ------------------------------------------------------------------ turns (colocated)

    def release_device(self) -> None:
        """Gives this learner's devices to a colocated engine (Engine.release_device):
        cached blocks back, and the optimizer's state to host memory where
        learner.offload_optimizer says so."""
        self.engine.release_device(self.learner.offload_optimizer)

    def reclaim_device(self) -> None:
        """Takes the devices back for a step: what release_device offloaded returns."""
        self.engine.reclaim_device()

    # ------------------------------------------------------------------ weights and checkpoints

    def published_weights(self, every_rank: bool = False) -> dict[str, torch.Tensor]:
        """Returns the HF-named weights the rollout workers load, in their dtype, on CPU:
        on the group's rank 0 ({} on the others), or on `every_rank` (each colocated
        learner loads its own engine). Every learner of a group calls it at once."""
        keep = every_rank or self.engine.rank == 0
        return publishable_weights(self.engine.policy, self.rollout_dtype, keep=keep)

    def open_weight_transfer(
        self,
        backend: str,
        client: Any,
        address: str,
        port: int,
        world_size: int,
        tied_output: str | None,
        timeout_s: float,
    ) -> None:
        """Opens vLLM's weight transfer ("nccl" or "gloo", rlray.weights.transfer) to the
        rollout workers behind `client`; rank 0 of a group opens the transfer group at
        address:port. `tied_output` is the output embedding's name where the rollout model
        loads it (None: not sent). Closes an earlier transfer first."""
        # vLLM loads only where its weight transfer is used
        from rlray.weights.transfer import PolicySource, TransferSender

        self.close_weight_transfer()
        source = PolicySource(self.engine.policy, self.rollout_dtype, tied_output)
        rank = self.engine.rank
        self.sender = TransferSender(
            backend, source, client, rank, address, port, world_size, timeout_s
        )

    def send_weights(self) -> int:
        """Sends the current weights through the open transfer; returns their version."""
        if self.sender is None:
            raise RuntimeError("send_weights before open_weight_transfer")
        self.sender.send(self.version)
        return self.version

    def close_weight_transfer(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None

    @property
    def tied_output(self) -> str | None:
        """The output embedding's weight name if it is the input embedding (else None)."""
        return tied_output_name(self.engine.policy)

    def save_checkpoint(
        self,
        run_dir: str | Path,
        prompt_cursor: int,
        publish: bool = True,
        replay_prompts: list[int] | None = None,
    ) -> Path:
        """Writes checkpoints/step-NNNNNN (HF policy + tokenizer, critic, optimizer, RNG,
        the prompt cursor and the prompts handed out but not trained on, which a resumed
        run regenerates first: rlray.driver.prompt_queue) atomically and points
        checkpoints/latest at it; returns its path. In a learner group every learner
        calls it and writes its shard of the optimizer state (the run directory must be
        one that every learner sees); rank 0 the rest.

        Without `publish` the checkpoint stays whole in its staging directory, which it
        returns, until `publish_staged` keeps or discards it: a checkpoint taken before
        the evaluation that decides whether it is the best."""
        self.prompt_cursor = prompt_cursor
        writer = self.engine.rank == 0
        staging = staging_directory(run_dir, self.version, create=writer)
        dd.barrier()  # the staging directory exists for every learner
        with writing(staging):
            self.engine.save(staging, self.tokenizer)
        dd.barrier()  # every learner's shard is written
        state = {
            "version": self.version,
            "step": self.version,
            "prompt_cursor": prompt_cursor,
            "replay_prompts": list(replay_prompts or []),
            "reference_model": self.model_path,
        }
        if not writer:
            return staging.parent / f"step-{self.version:06d}"
        with writing(staging / "state.json"):
            seal_checkpoint(staging, state)
        return publish_sealed(staging) if publish else staging

    def publish_staged(self, run_dir: str | Path, version: int, keep: bool) -> Path | None:
        """Publishes the checkpoint of `version` that `save_checkpoint(publish=False)`
        left staged (returns its path), or discards it (None). Rank 0's work alone."""
        staging = staging_directory(run_dir, version, create=False)
        if self.engine.rank != 0:
            return None
        if keep:
            return publish_sealed(staging)
        shutil.rmtree(staging, ignore_errors=True)
        return None

    def state(self) -> dict[str, Any]:
        """Returns version and prompt cursor (small)."""
        return {"version": self.version, "prompt_cursor": self.prompt_cursor}


def _pad_token_id(tokenizer: Any) -> int:
    """Returns the tokenizer's padding id, its end-of-sequence id where it has none."""
    return tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id


def _rows(tensor: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    return None if tensor is None else tensor[rows]
