"""The training engine: forward passes, micro-batches and updates of the models a learner
holds, and the weights the rollout workers load.

An `Engine` holds the policy (fp32 master weights), and when asked a frozen reference
model and a critic (a trunk of the starting model plus a linear value head), built from
its `EngineSettings` (rlray/learner/engine_settings.py). It knows nothing of advantages
or losses: `train` runs epochs of mini-batches of micro-batches and asks a loss function
(the algorithm's, through the learner) for each micro-batch's loss. Its parts live
beside it: the models are built in rlray/learner/models.py, the batches and their split
into micro-batches are rlray/learner/batches.py's, the optimizer's offload for a shared
device rlray/learner/offload.py's, and checkpoints rlray/learner/checkpoint_io.py's.

A learner group (`learner.num_workers` > 1, rlray/learner/distributed.py): when the process is
one of a torch.distributed group, the policy, the reference and the critic are sharded
with FSDP2 across it, and every method here is collective: each learner calls it with
the whole batch, works on its share of the rows (split by tokens) and the results are
gathered, so every learner returns what one learner would. Outside a group the same
code runs with a group of one (nothing sharded, every row its own).

Memory: logits are computed only at the completion positions (prompts are left-padded
so that every completion starts at the same column and `logits_to_keep` cuts the rest),
for at most `micro_batch_size` rows (and `micro_batch_tokens` padded tokens) at a time;
the entropy graph is built only when the entropy enters the loss.

Padding: a micro-batch holds rows of like lengths (longest first) and runs on its own
columns only (MicroBatching in rlray/learner/batches.py).

Shared prompts: where a group's samples share a prompt and running each prompt once
saves a quarter of the positions or more (`shared_prompts`: short completions, or long
prompts), a micro-batch holds whole groups, runs each distinct prompt once with a KV
cache, and runs every row's completion on a copy of its prompt's keys and values. The
copy is differentiable, so the logprobs and the gradient are those of whole rows (to
float rounding, `tests/test_learner.py`). Not with gradient checkpointing, compiled
layers or a learner group.

bfloat16: weights and optimizer state stay float32; forward and backward passes run
under autocast in bfloat16, and the rollout workers get bfloat16 copies.

LoRA (`lora_rank > 0`, through PEFT): the policy is the frozen base model with adapters,
and only the adapters train and have AdamW state. The KL reference is the same model
with its adapters disabled, not a second copy. A checkpoint holds the adapters (to
resume) and the merged model as its HF policy (what vLLM and transformers load); a run
resumes from the starting model plus the adapters, so the reference stays the base. The
critic, when there is one, stays a full model: it is a second trunk either way, and
adapters on it would save only its optimizer state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.utils import logging as hf_logging

from rlray.algorithms import rl_math as rm
from rlray.learner import distributed as dd
from rlray.learner.batches import (
    MicroBatching,
    MiniBatchTotals,
    Outputs,
    SharedPrompts,
    TokenBatch,
    TokenCounts,
    shared_prompts,
    widen,
)
from rlray.learner.checkpoint_io import load_engine_state, save_engine
from rlray.learner.engine_settings import COMPUTE_DTYPES, EngineSettings
from rlray.learner.models import build_models
from rlray.learner.offload import OptimizerOffload

LossFn = Callable[[Outputs, torch.Tensor, MiniBatchTotals], tuple[torch.Tensor, dict[str, float]]]


class Engine:
    """Owns the models, the optimizer and the device; runs forward passes and updates."""

    def __init__(
        self,
        model_path: str,
        settings: EngineSettings,
        *,
        checkpoint: str | Path | None = None,
        lent_cores: Callable[[], int] | None = None,
    ):
        hf_logging.disable_progress_bar()  # checkpoint saves would print a bar each
        torch.manual_seed(settings.seed)
        self.settings = settings
        self.device = torch.device(settings.device)
        self.compute_dtype = COMPUTE_DTYPES[settings.dtype]
        self.lent_cores = lent_cores
        """How many cores this learner may use now beside its own, asked before each
        micro-batch (rlray.core.idle_cores: its node's idle rollout cores)."""
        self.own_threads = torch.get_num_threads()
        self.cores_lent_now = 0
        self.token_counts = TokenCounts()
        """Token positions this learner's passes computed, and the padding among them."""
        self.lora = settings.lora_rank > 0
        self.with_reference = settings.with_reference
        self.rank, self.world_size = dd.rank_and_size()
        models = build_models(model_path, settings, checkpoint, self.world_size)
        self.policy, self.reference, self.critic = models.policy, models.reference, models.critic
        self.share_prompts = not (
            settings.gradient_checkpointing or settings.compile_layers or self.world_size > 1
        )
        """Whether a micro-batch runs each distinct prompt once (shared_prompts): not with
        gradient checkpointing (which turns the KV cache off), compiled layers (traced
        without a cache) or a sharded model (one forward pass per backward pass)."""
        self.micro_batching = MicroBatching(
            settings.micro_batch_size, settings.micro_batch_tokens, self.rank, self.world_size
        )
        self.optimizer = _adamw(self.trainable_parameters(), self.critic, settings)
        self.offload = OptimizerOffload(self.optimizer, self.device, self.world_size)
        self.shuffle = torch.Generator().manual_seed(settings.seed)
        if checkpoint:
            load_engine_state(self, Path(checkpoint))

    def trained_models(self) -> nn.ModuleDict:
        """The models the optimizer updates, by name (the keys of its saved state)."""
        models = {"policy": self.policy}
        if self.critic is not None:
            models["critic"] = self.critic
        return nn.ModuleDict(models)

    def trainable_parameters(self) -> list[nn.Parameter]:
        """Returns the policy's parameters that train: all of them, or with LoRA the
        adapters alone."""
        return [p for p in self.policy.parameters() if p.requires_grad]

    # ------------------------------------------------------------------ forward passes

    def _compute(self) -> contextlib.AbstractContextManager:
        """Autocast to the compute dtype (float32 master weights, bfloat16 arithmetic)."""
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)

    def _completion_logits(
        self, model: nn.Module, batch: TokenBatch, temperature: float | None = None
    ) -> torch.Tensor:
        """Returns (B, T, V) float32 logits at the positions that predict each completion
        token, divided by `temperature` (None: the sampling temperature); no other
        position's logits exist."""
        shared = self._shared_prompts(batch)
        if shared is None:
            logits = model(
                input_ids=batch.input_ids,
                attention_mask=batch.attention_mask,
                position_ids=batch.position_ids,
                logits_to_keep=batch.completion_columns + 1,
                use_cache=False,  # one pass over whole sequences: a KV cache is built for nothing
            ).logits[:, :-1]  # (B, T, V): column P - 1 + t predicts completion token t
        else:
            logits = self._logits_after_shared_prompts(model, batch, shared)
        return logits.float() / (self.settings.temperature if temperature is None else temperature)

    def _shared_prompts(self, batch: TokenBatch) -> SharedPrompts | None:
        return shared_prompts(batch) if self.share_prompts else None

    def _logits_after_shared_prompts(
        self, model: nn.Module, batch: TokenBatch, shared: SharedPrompts
    ) -> torch.Tensor:
        """The (B, T, V) logits of `_completion_logits`, each distinct prompt run once:
        its keys and values are copied to the rows that share it (a copy autograd
        follows, so the gradient is the same sum over the rows), then every row's
        completion runs on top of them."""
        prompt_columns = batch.input_ids.shape[1] - batch.completion_columns
        firsts, prompt = shared.firsts, slice(None, prompt_columns)
        ran = model(
            input_ids=batch.input_ids[firsts, prompt],
            attention_mask=batch.attention_mask[firsts, prompt],
            position_ids=batch.position_ids[firsts, prompt],
            logits_to_keep=1,  # the last prompt position predicts the first completion token
            use_cache=True,
        )
        cache = ran.past_key_values
        cache.batch_select_indices(shared.of_row)
        completions = slice(prompt_columns, None)
        rest = model(
            input_ids=batch.input_ids[:, completions],
            attention_mask=batch.attention_mask,  # prompt and completion columns
            position_ids=batch.position_ids[:, completions],
            past_key_values=cache,
            use_cache=True,
        ).logits[:, :-1]  # completion column t predicts token t + 1; the last predicts none
        return torch.cat([ran.logits[shared.of_row], rest], dim=1)

    def forward(self, batch: TokenBatch, entropy_grad: bool = False) -> Outputs:
        """Returns the policy's logprobs and entropy (and the critic's values) of one
        micro-batch, with gradients; entropy has one only if `entropy_grad`."""
        with self._compute():
            logits = self._completion_logits(self.policy, batch)
            values = self._values(batch) if self.critic is not None else None
        logp = rm.token_logprobs(logits, batch.completion_ids)
        if entropy_grad:
            entropy = rm.entropy_from_logits(logits)
        else:
            with torch.no_grad():
                entropy = rm.entropy_from_logits(logits)
        return Outputs(logp, entropy, values)

    def _values(self, batch: TokenBatch) -> torch.Tensor:
        steps = batch.completion_columns
        values = self.critic(
            batch.input_ids, batch.attention_mask, batch.position_ids, keep=steps + 1
        )
        return values[:, :-1].float()  # (B, T): the state before each completion token

    def score(
        self, batch: TokenBatch, with_values: bool = True, temperature: float | None = None
    ) -> Outputs:
        """Returns the policy's logprobs (and the critic's values) of every row, without
        gradients, `micro_batch_size` rows at a time; logprobs at `temperature` (None:
        the sampling temperature)."""
        with_values = with_values and self.critic is not None

        def score_rows(micro: TokenBatch) -> dict[str, torch.Tensor]:
            with self._compute():
                logits = self._completion_logits(self.policy, micro, temperature)
                values = self._values(micro) if with_values else None
            logp = rm.token_logprobs(logits, micro.completion_ids)
            return {"logp": logp} if values is None else {"logp": logp, "values": values}

        scored = self._each_row(batch, score_rows)
        for model in self.trained_models().values():
            dd.reshard(model)  # no backward pass follows this one
        return Outputs(logp=scored["logp"], values=scored.get("values"))

    def reference_logprobs(self, batch: TokenBatch) -> torch.Tensor | None:
        """Returns the reference model's (B, T) logprobs, or None if none is held: the
        frozen starting model, or with LoRA the policy with its adapters disabled."""
        if not self.with_reference:
            return None
        model = self.reference if self.reference is not None else self.policy

        def reference_rows(micro: TokenBatch) -> dict[str, torch.Tensor]:
            with self._compute():
                logits = self._completion_logits(model, micro)
            return {"logp": rm.token_logprobs(logits, micro.completion_ids)}

        with self._reference_mode():
            logp = self._each_row(batch, reference_rows)["logp"]
        dd.reshard(model)  # no backward pass follows this one
        return logp

    @torch.no_grad()
    def _each_row(
        self, batch: TokenBatch, rows_fn: Callable[[TokenBatch], dict[str, torch.Tensor]]
    ) -> dict[str, torch.Tensor]:
        """Returns rows_fn's (B, T) outputs for every row of the batch: each learner runs
        it on its own rows, a micro-batch at a time, and the outputs are gathered."""
        rows = torch.arange(batch.size, device=self.device)
        # Gathered outputs travel pickled, through the CPU; a lone learner's stay put.
        travel = "cpu" if self.world_size > 1 else self.device
        own: list[tuple[torch.Tensor, dict[str, torch.Tensor]]] = []
        columns = batch.completion_columns
        for micro_rows in self._micro_batches(batch, rows):
            if micro_rows is None:  # nothing left here, but the group's passes go on
                rows_fn(self._micro(batch, rows[:1]))
                continue
            micro = self._micro(batch, micro_rows)
            self.token_counts.add(micro, self.cores_lent_now, self._shared_prompts(micro))
            outputs = {k: widen(v, columns).to(travel) for k, v in rows_fn(micro).items()}
            own.append((micro_rows.to(travel), outputs))
        result: dict[str, torch.Tensor] = {}
        for learner_rows in dd.gather_objects(own):
            for micro_rows, outputs in learner_rows:
                for key, value in outputs.items():
                    if key not in result:
                        result[key] = value.new_zeros(batch.size, *value.shape[1:])
                    result[key][micro_rows] = value
        return {key: value.to(self.device) for key, value in result.items()}

    def _micro_batches(self, batch: TokenBatch, rows: torch.Tensor) -> list[torch.Tensor | None]:
        """Returns this learner's micro-batches of `rows` (MicroBatching.split): None
        where it has no row left but the group's passes go on; whole groups together
        where their prompts run once."""
        return self.micro_batching.split(batch, rows, self._shared_prompts(batch.rows(rows)))

    def _micro(self, batch: TokenBatch, rows: torch.Tensor) -> TokenBatch:
        self._take_threads()
        return self.micro_batching.take(batch, rows)

    def _take_threads(self) -> None:
        """Computes the next micro-batch on the learner's own threads plus one for each
        core lent now (`lent_cores`)."""
        if self.lent_cores is not None:
            self.cores_lent_now = self.lent_cores()
            wanted = self.own_threads + self.cores_lent_now
            if wanted != torch.get_num_threads():
                torch.set_num_threads(wanted)

    def _reference_mode(self) -> contextlib.AbstractContextManager:
        """With LoRA, the policy without its adapters is the base model, exactly."""
        return self.policy.disable_adapter() if self.lora else contextlib.nullcontext()

    # ------------------------------------------------------------------ updates

    def train(
        self,
        batch: TokenBatch,
        loss_mask: torch.Tensor,
        loss_fn: LossFn,
        epochs: int,
        minibatch_size: int,
        entropy_grad: bool = False,
    ) -> list[dict[str, float]]:
        """Runs `epochs` passes over the batch in shuffled mini-batches of about
        `minibatch_size` rows (0: the whole batch, however many rows it has), one
        optimizer update each; gradients accumulate over micro-batches.
        `loss_fn(outputs, rows, totals)` returns a micro-batch's share of its mini-batch's
        loss and metrics that add up over micro-batches. Returns each update's summed
        metrics, with its gradient norm."""
        self.reclaim_device()  # a no-op unless a turn's release_device left state behind
        updates = []
        parts = max(1, round(batch.size / minibatch_size)) if minibatch_size else 1
        for _ in range(epochs):
            order = torch.randperm(batch.size, generator=self.shuffle).to(self.device)
            for minibatch in order.tensor_split(parts):
                mask = loss_mask[minibatch]
                totals = MiniBatchTotals(
                    tokens=float(mask.sum()),
                    sequences=float((mask.sum(dim=1) > 0).sum()),
                    sampled=float(len(minibatch)),
                )
                summed: dict[str, float] = {}
                for rows in self._micro_batches(batch, minibatch):
                    idle = rows is None  # this learner's rows are done; the group's are not
                    rows = minibatch[:1] if idle else rows
                    micro = self._micro(batch, rows)
                    if not idle:
                        shared = self._shared_prompts(micro)  # as forward() will
                        self.token_counts.add(micro, self.cores_lent_now, shared)
                    outputs = self.forward(micro, entropy_grad).widened(batch.completion_columns)
                    loss, metrics = loss_fn(outputs, rows, totals)
                    (loss * 0.0 if idle else loss).backward()
                    for key, value in {} if idle else metrics.items():
                        summed[key] = summed.get(key, 0.0) + value
                summed = _sum_over_learners(summed)
                summed["grad_norm"] = self._optimizer_step()
                updates.append(summed)
        return updates

    def _optimizer_step(self) -> float:
        # A sharded model's norm is the whole gradient's (a DTensor every learner agrees on).
        max_norm = self.settings.max_grad_norm
        norm = dd.whole(nn.utils.clip_grad_norm_(self.trainable_parameters(), max_norm))
        norms = {"policy": norm}
        if self.critic is not None:
            critic = nn.utils.clip_grad_norm_(self.critic.parameters(), max_norm)
            norms["critic"] = dd.whole(critic)
        for model, value in norms.items():
            if not torch.isfinite(value):  # a finite loss can still overflow backward
                self.optimizer.zero_grad(set_to_none=True)
                raise rm.NonFiniteError(f"{model} gradient norm is not finite ({float(value)})")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    # ------------------------------------------------------------------ turns on a shared device

    def release_device(self, offload_optimizer: bool) -> None:
        """The engine's turn on this learner's devices (the colocated placement):
        OptimizerOffload.release."""
        self.offload.release(offload_optimizer)

    def reclaim_device(self) -> None:
        """The learner's turn: brings back whatever release_device offloaded."""
        self.offload.reclaim()

    # ------------------------------------------------------------------ checkpoints

    def save(self, directory: Path, tokenizer: Any) -> None:
        """Writes the policy (HF format, with the tokenizer), the critic, the optimizer
        and the random states into `directory` (rlray/learner/checkpoint_io.py).
        Collective in a group."""
        save_engine(self, directory, tokenizer)


def _adamw(
    policy: list[nn.Parameter], critic: nn.Module | None, settings: EngineSettings
) -> torch.optim.AdamW:
    """Returns AdamW over the policy's trained parameters and the critic's, each at its
    own learning rate."""
    groups = [{"params": policy, "lr": settings.lr}]
    if critic is not None:
        groups.append({"params": list(critic.parameters()), "lr": settings.critic_lr})
    return torch.optim.AdamW(groups, weight_decay=0.0)


def _sum_over_learners(metrics: dict[str, float]) -> dict[str, float]:
    """Returns each metric summed over the learner group (its own values outside one)."""
    summed: dict[str, float] = {}
    for values in dd.gather_objects(metrics):
        for key, value in values.items():
            summed[key] = summed.get(key, 0.0) + value
    return summed
