"""The training engine: models, devices, forward passes, micro-batches, the optimizer,
checkpoints and the weights the rollout workers load.

An `Engine` holds the policy (fp32 master weights), and when asked a frozen reference
model and a critic (a trunk of the starting model plus a linear value head). It knows
nothing of advantages or losses: `train` runs epochs of mini-batches of micro-batches
and asks a loss function (the algorithm's, through the learner) for each micro-batch's
loss.

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
columns only (TokenBatch.trimmed), so a short row is padded to the longest of its
micro-batch, not of the batch; `token_counts` says how much padding is left.

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
import random
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import load as load_sharded
from torch.distributed.checkpoint import save as save_sharded
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from transformers import AutoModel, AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from rlray.algorithms import rl_math as rm
from rlray.learner import distributed as dd
from rlray.learner.lora import load_adapter, save_merged, with_lora

COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def compile_decoder_layers(model: nn.Module) -> None:
    """Compiles each decoder layer's forward in place (torch.compile, inductor, dynamic
    shapes; parameter names unchanged). The layers share one compiled graph, and one
    more for passes without gradients. On CPU it fuses the norms', rotary's and
    activation's elementwise work, about a quarter of a step (BENCHMARKS.md). The
    compilation runs in this process (no pool of compile workers beside the learner)."""
    # imported only when asked: inductor adds to every learner process's memory
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = 1
    for layer in dd.decoder_layers(model):
        layer.compile(dynamic=True)


class ValueModel(nn.Module):
    """Critic: the base transformer of the starting model plus a linear value head."""

    def __init__(self, trunk: nn.Module, hidden_size: int):
        super().__init__()
        self.trunk = trunk
        self.head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids, attention_mask, position_ids, keep: int) -> torch.Tensor:
        hidden = self.trunk(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
        ).last_hidden_state[:, -keep:]
        # A new tensor, not a view: FSDP2 hooks a sharded module's output for backward.
        return self.head(hidden)[..., 0].clone()  # (B, keep)


@dataclass
class TokenBatch:
    """Episodes as tensors. Prompts are left-padded and completions right-padded, so every
    completion starts at column P (the longest prompt): L = P + T columns in all."""

    input_ids: torch.Tensor  # (B, L)
    attention_mask: torch.Tensor  # (B, L)
    position_ids: torch.Tensor  # (B, L) 0 at each row's first real token
    completion_ids: torch.Tensor  # (B, T)
    mask: torch.Tensor  # (B, T) 1.0 on the completion tokens the policy generated

    def rows(self, index: torch.Tensor) -> TokenBatch:
        """Returns the sub-batch of the given rows."""
        return TokenBatch(*(getattr(self, f.name)[index] for f in fields(self)))

    def trimmed(self, index: torch.Tensor) -> TokenBatch:
        """Returns the sub-batch of the given rows without the columns that are padding
        in every one of them: the prompts' common left padding and the completion
        columns past its longest completion. Its logprobs are the full batch's (masked
        columns change no attention), on fewer columns: widen() puts them back."""
        rows = self.rows(index)
        present = rows.attention_mask.any(dim=0)
        prompt_columns = self.input_ids.shape[1] - self.completion_columns
        first = int(present[:prompt_columns].long().argmax())  # every row has a prompt
        filled = present[prompt_columns:].nonzero()
        steps = int(filled[-1]) + 1 if len(filled) else 1  # one column at least, as collate
        end = prompt_columns + steps
        return TokenBatch(
            rows.input_ids[:, first:end],
            rows.attention_mask[:, first:end],
            rows.position_ids[:, first:end],
            rows.completion_ids[:, :steps],
            rows.mask[:, :steps],
        )

    def to(self, device: torch.device) -> TokenBatch:
        return TokenBatch(*(getattr(self, f.name).to(device) for f in fields(self)))

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def completion_columns(self) -> int:
        return self.completion_ids.shape[1]


def collate(
    prompts: list[list[int]],
    completions: list[list[int]],
    pad_token_id: int,
    completion_masks: list[list[int]] | None = None,
) -> TokenBatch:
    """Returns prompt and completion token ids as a TokenBatch. A completion's mask is 1
    on every token, or its entry of `completion_masks` where that is not empty (0 on
    the observation tokens between the turns of a multi-turn episode)."""
    width_prompt = max(len(p) for p in prompts)
    width_completion = max(max((len(c) for c in completions), default=0), 1)
    masks = completion_masks or [[] for _ in completions]
    # Rows padded as lists and converted once: a tensor per row costs more than the
    # default task's whole step of tiny sequences takes to collate this way.
    ids, present, completion_rows, mask_rows = [], [], [], []
    for p, c, policy_tokens in zip(prompts, completions, masks, strict=True):
        left, right = width_prompt - len(p), width_completion - len(c)
        ids.append([pad_token_id] * left + p + c + [pad_token_id] * right)
        present.append([0] * left + [1] * (len(p) + len(c)) + [0] * right)
        completion_rows.append(c + [pad_token_id] * right)
        mask_rows.append((policy_tokens or [1] * len(c)) + [0] * right)
    input_ids = torch.tensor(ids, dtype=torch.long)
    attention = torch.tensor(present, dtype=torch.long)
    completion_ids = torch.tensor(completion_rows, dtype=torch.long)
    mask = torch.tensor(mask_rows, dtype=torch.get_default_dtype())
    position_ids = (attention.cumsum(dim=1) - 1).clamp(min=0)
    return TokenBatch(input_ids, attention, position_ids, completion_ids, mask)


@dataclass
class SharedPrompts:
    """The distinct prompts of a micro-batch's rows: each runs once, and the rows that
    share it read its keys and values (Engine.share_prompts)."""

    firsts: torch.Tensor  # (U,) the first row of each distinct prompt
    of_row: torch.Tensor  # (B,) each row's index into `firsts`


def shared_prompts(batch: TokenBatch) -> SharedPrompts | None:
    """Returns the batch's distinct prompts when running each once saves at least a
    quarter of its token positions (a group's samples share one prompt), else None."""
    prompt_columns = batch.input_ids.shape[1] - batch.completion_columns
    present = batch.attention_mask[:, :prompt_columns].bool()
    # Padding counts as -1, so that a prompt that begins with the pad id is its own.
    keys = batch.input_ids[:, :prompt_columns].masked_fill(~present, -1)
    distinct, of_row = torch.unique(keys, dim=0, return_inverse=True)
    if 4 * (batch.size - len(distinct)) * prompt_columns < batch.input_ids.numel():
        return None
    rows = torch.arange(batch.size, device=of_row.device)
    firsts = torch.full_like(rows[: len(distinct)], batch.size)
    return SharedPrompts(firsts.scatter_reduce(0, of_row, rows, "amin"), of_row)


@dataclass
class Outputs:
    """Per-token outputs of a forward pass over a batch's completion tokens, (B, T) each."""

    logp: torch.Tensor
    entropy: torch.Tensor | None = None
    values: torch.Tensor | None = None

    def widened(self, columns: int) -> Outputs:
        """Returns the outputs of a trimmed batch on the full batch's `columns`
        completion columns: zeros on the columns it left out, where no row has a token."""
        kept = (self.logp, self.entropy, self.values)
        return Outputs(*(None if t is None else widen(t, columns) for t in kept))


def widen(tensor: torch.Tensor, columns: int) -> torch.Tensor:
    """Returns a (B, T) tensor right-padded with zeros to (B, columns)."""
    return nn.functional.pad(tensor, (0, columns - tensor.shape[1]))


@dataclass
class MiniBatchTotals:
    """Counts of a whole mini-batch, which each micro-batch's loss is divided by."""

    tokens: float
    sequences: float
    """Sequences with a token in the loss."""
    sampled: float
    """Every sequence of the mini-batch, in the loss or not: Dr. GRPO's G, which masking
    (mask_truncated) must not change."""


@dataclass
class TokenCounts:
    """Token positions a learner's forward passes computed, and how many of them were
    padding (a row's columns past its own tokens)."""

    computed: int = 0
    padding: int = 0
    borrowed: int = 0
    """Of those computed, the ones computed with cores lent (Engine's `lent_cores`)."""

    def add(
        self, micro: TokenBatch, lent_cores: int = 0, shared: SharedPrompts | None = None
    ) -> None:
        """Counts one micro-batch's positions; with `shared`, each distinct prompt once."""
        present = micro.attention_mask
        if shared is not None:
            prompt_columns = micro.input_ids.shape[1] - micro.completion_columns
            prompts, completions = (
                present[shared.firsts, :prompt_columns],
                present[:, prompt_columns:],
            )
            present = torch.cat([prompts.flatten(), completions.flatten()])
        computed = present.numel()
        self.computed += computed
        self.padding += computed - int(present.sum())
        self.borrowed += computed if lent_cores else 0


LossFn = Callable[[Outputs, torch.Tensor, MiniBatchTotals], tuple[torch.Tensor, dict[str, float]]]


def disable_dropout(model: nn.Module) -> None:
    """Sets every dropout probability to 0: the ratio of two forward passes must not be
    noise, and vLLM samples without dropout."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    config = getattr(model, "config", None)
    for name in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop"):
        if config is not None and isinstance(getattr(config, name, None), float):
            setattr(config, name, 0.0)


class Engine:
    """Owns the models, the optimizer and the device; runs forward passes and updates."""

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        lr: float = 1e-5,
        critic_lr: float = 1e-4,
        max_grad_norm: float = 1.0,
        micro_batch_size: int = 64,
        micro_batch_tokens: int = 0,
        temperature: float = 1.0,
        with_reference: bool = False,
        with_critic: bool = False,
        gradient_checkpointing: bool = False,
        compile_layers: bool = False,
        lent_cores: Callable[[], int] | None = None,
        seed: int = 0,
        checkpoint: str | Path | None = None,
        lora_rank: int = 0,
        lora_alpha: float = 16.0,
        lora_targets: tuple[str, ...] = ("all-linear",),
    ):

        hf_logging.disable_progress_bar()  # checkpoint saves would print a bar each
        if dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute dtype {dtype!r}: expected one of {list(COMPUTE_DTYPES)}")
        torch.manual_seed(seed)
        self.device = torch.device(device)
        self.compute_dtype = COMPUTE_DTYPES[dtype]
        self.micro_batch_size = micro_batch_size
        self.micro_batch_tokens = micro_batch_tokens
        self.lent_cores = lent_cores
        """How many cores this learner may use now beside its own, asked before each
        micro-batch (rlray.core.idle_cores: its node's idle rollout cores)."""
        self.own_threads = torch.get_num_threads()
        self.cores_lent_now = 0
        self.token_counts = TokenCounts()
        """Token positions this learner's passes computed, and the padding among them."""
        self.buckets_by_length = True
        """Whether a micro-batch holds rows of like lengths on its own columns; off, rows
        in mini-batch order padded to the batch's longest (as before; what
        benchmarks/padding.py compares against)."""
        self.max_grad_norm = max_grad_norm
        self.temperature = temperature
        self.lora = lora_rank > 0
        # With LoRA the base is always the starting model; a checkpoint adds its adapters.
        policy_path = f"{checkpoint}/policy" if checkpoint and not self.lora else model_path
        # Master weights in float32 whatever the compute dtype.
        self.policy = self._load(AutoModelForCausalLM, policy_path, gradient_checkpointing)
        if self.lora:
            self.policy = with_lora(self.policy, lora_rank, lora_alpha, list(lora_targets))
        self.with_reference = with_reference
        # With LoRA the reference is the policy with its adapters off.
        self.reference = self._reference(model_path) if with_reference and not self.lora else None
        self.critic = (
            self._critic(model_path, checkpoint, gradient_checkpointing) if with_critic else None
        )
        if compile_layers:
            for model in (self.policy, self.reference, self.critic):
                if model is not None:
                    compile_decoder_layers(model)
        self.rank, self.world_size = dd.rank_and_size()
        if self.world_size > 1:
            self._shard()
        self.share_prompts = not (gradient_checkpointing or compile_layers or self.world_size > 1)
        """Whether a micro-batch runs each distinct prompt once (shared_prompts): not with
        gradient checkpointing (which turns the KV cache off), compiled layers (traced
        without a cache) or a sharded model (one forward pass per backward pass)."""
        groups = [{"params": self.trainable_parameters(), "lr": lr}]
        if self.critic is not None:
            groups.append({"params": list(self.critic.parameters()), "lr": critic_lr})
        self.optimizer = torch.optim.AdamW(groups, weight_decay=0.0)
        self._host_buffers: dict[tuple[int, str], torch.Tensor] = {}
        self._offloaded: set[tuple[int, str]] = set()
        """The optimizer's state tensors now in host memory (release_device)."""
        self.shuffle = torch.Generator().manual_seed(seed)
        if checkpoint:
            self._load_state(Path(checkpoint))

    def _reference(self, model_path: str) -> nn.Module:
        """Returns the frozen reference model: the starting model in float32 like the
        policy, so that KL is exactly 0 before the first update."""
        reference = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        return reference.to(self.device).requires_grad_(False).eval()

    def _critic(
        self, model_path: str, checkpoint: str | Path | None, gradient_checkpointing: bool
    ) -> ValueModel:
        """Returns the critic: the checkpoint's, or the starting model's trunk with a zero
        value head. A checkpoint of a run without a critic (another estimator) has none."""
        has_critic = checkpoint is not None and Path(checkpoint, "critic").is_dir()
        trunk_path = f"{checkpoint}/critic" if has_critic else model_path
        trunk = self._load(AutoModel, trunk_path, gradient_checkpointing)
        critic = ValueModel(trunk, self.policy.config.hidden_size).to(self.device)
        head_path = Path(trunk_path, "value_head.pt")
        if has_critic and head_path.is_file():
            critic.head.load_state_dict(torch.load(head_path, map_location=self.device))
        return critic

    def _shard(self) -> None:
        """Shards every model across the learner group (before the optimizer exists: its
        state is then sharded too)."""
        if self.lora:
            raise ValueError("LoRA adapters in a learner group (learner.num_workers > 1)")
        for model in (self.policy, self.reference, self.critic):
            if model is not None:
                dd.shard(model, self.device.type)

    def _load(self, auto_class: Any, path: str, gradient_checkpointing: bool) -> nn.Module:
        model = auto_class.from_pretrained(path, dtype=torch.float32).to(self.device)
        disable_dropout(model)
        if gradient_checkpointing:
            model.gradient_checkpointing_enable()
        model.train()  # gradient checkpointing acts in training mode only; no dropout left
        return model

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
        return logits.float() / (self.temperature if temperature is None else temperature)

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
        """Returns this learner's share of `rows` (balanced by tokens across the group;
        all of them outside one), longest first, in as many micro-batches as the
        busiest learner runs: None where this learner has no row left, as FSDP2 needs
        every learner to run the same forward and backward passes. A micro-batch holds
        micro_batch_size rows at most, and micro_batch_tokens padded tokens at most if
        set."""
        prompt_columns = batch.input_ids.shape[1] - batch.completion_columns
        present = batch.attention_mask[rows]
        prompt = present[:, :prompt_columns].sum(dim=1).tolist()
        completion = present[:, prompt_columns:].sum(dim=1).tolist()
        lengths = [p + c for p, c in zip(prompt, completion, strict=True)]
        owned = dd.split_by_tokens(lengths, self.world_size)
        if self.buckets_by_length:
            shared = self._shared_prompts(batch.rows(rows))
            if shared is None:
                owned = [dd.longest_first(o, prompt, completion) for o in owned]
            else:  # whole groups in a micro-batch: each of their prompts runs once
                groups = shared.of_row.tolist()
                owned = [dd.groups_together(o, groups, prompt, completion) for o in owned]
        if self.micro_batch_tokens:
            split = [
                dd.token_budget_batches(
                    o, prompt, completion, self.micro_batch_tokens, self.micro_batch_size
                )
                for o in owned
            ]
            count = max(1, max(len(batches) for batches in split))
            mine = split[self.rank] + [[]] * (count - len(split[self.rank]))
        else:
            count = dd.micro_batch_count([len(o) for o in owned], self.micro_batch_size)
            mine = dd.micro_batches(owned[self.rank], count)
        return [
            rows[torch.tensor(micro, dtype=torch.long, device=rows.device)] if micro else None
            for micro in mine
        ]

    def _micro(self, batch: TokenBatch, rows: torch.Tensor) -> TokenBatch:
        self._take_threads()
        return batch.trimmed(rows) if self.buckets_by_length else batch.rows(rows)

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
        norm = dd.whole(nn.utils.clip_grad_norm_(self.trainable_parameters(), self.max_grad_norm))
        norms = {"policy": norm}
        if self.critic is not None:
            critic = nn.utils.clip_grad_norm_(self.critic.parameters(), self.max_grad_norm)
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
        """The engine's turn on this learner's devices (the colocated placement): the
        allocator's cached blocks go back to the device, so that a waking rollout engine
        can map them, and with `offload_optimizer` the optimizer's state goes to host
        memory (AdamW's two moments: twice the trained weights' bytes)."""
        if offload_optimizer and self.device.type != "cpu":
            self._move_optimizer_state(to_host=True)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def reclaim_device(self) -> None:
        """The learner's turn: brings back whatever release_device offloaded."""
        if self._offloaded:
            self._move_optimizer_state(to_host=False)

    def _move_optimizer_state(self, to_host: bool) -> None:
        """Copies the state tensors that live on the device into pinned host buffers,
        kept for the next turn (pinning costs more than the copy), or back. AdamW's
        `step` counters stay where the optimizer keeps them (on the host)."""
        if self.world_size > 1:  # config checks refuse it: a DTensor's shard is not moved
            raise ValueError("offloading a sharded optimizer's state is not built")
        for index, state in enumerate(self.optimizer.state.values()):
            for name, value in state.items():
                slot = (index, name)
                if to_host and value.device.type == self.device.type:
                    host = self._host_buffers.get(slot)
                    if host is None or host.shape != value.shape or host.dtype != value.dtype:
                        host = torch.empty_like(value, device="cpu", pin_memory=True)
                        self._host_buffers[slot] = host
                    state[name] = host.copy_(value, non_blocking=True)
                    self._offloaded.add(slot)
                elif not to_host and slot in self._offloaded:
                    state[name] = value.to(self.device, non_blocking=True)
        if not to_host:
            self._offloaded.clear()
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # the host copies are whole before the engine runs

    # ------------------------------------------------------------------ weights and checkpoints

    def save(self, directory: Path, tokenizer: Any) -> None:
        """Writes the policy (HF format, with the tokenizer; with LoRA the merged model,
        and the adapters apart), the critic, the optimizer and the random states into
        `directory`. Collective in a group: rank 0 writes the whole models, gathered a
        tensor at a time, and every learner writes its shard of the optimizer's state
        (torch.distributed.checkpoint, which a group of another size can load)."""

        policy = self._whole_state(self.policy)
        critic = self._whole_state(self.critic) if self.critic is not None else None
        if self.rank == 0:
            self._save_models(directory, tokenizer, policy, critic)
        optimizer = get_optimizer_state_dict(self.trained_models(), self.optimizer)
        with _one_process_is_intended():
            save_sharded(
                {"optimizer": optimizer},
                checkpoint_id=directory / "optimizer",
                no_dist=self.world_size == 1,
            )
        if self.rank == 0:
            torch.save(
                {
                    "shuffle_rng": self.shuffle.get_state(),
                    "torch_rng": torch.random.get_rng_state(),
                    "python_rng": random.getstate(),
                },
                directory / "trainer_state.pt",
            )

    def _whole_state(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """Returns the model's state dict whole on rank 0's CPU (None elsewhere); outside
        a group, None: the model saves itself."""
        if self.world_size == 1:
            return None

        # Collective: every learner gathers, and only rank 0 keeps (cpu_offload).
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(model, options=options)
        return state if self.rank == 0 else None

    def _save_models(
        self,
        directory: Path,
        tokenizer: Any,
        policy: dict[str, torch.Tensor] | None,
        critic: dict[str, torch.Tensor] | None,
    ) -> None:
        if self.lora:
            self.policy.save_pretrained(directory / "adapter")
            save_merged(self.policy, directory / "policy")
        else:
            self.policy.save_pretrained(directory / "policy", state_dict=policy)
        tokenizer.save_pretrained(directory / "policy")
        if self.critic is not None:
            head = self.critic.head.state_dict()
            trunk = None
            if critic is not None:  # gathered: split into the trunk's and the head's
                trunk = _under(critic, "trunk.")
                head = _under(critic, "head.")
            self.critic.trunk.save_pretrained(directory / "critic", state_dict=trunk)
            torch.save(head, directory / "critic" / "value_head.pt")

    def _load_state(self, checkpoint: Path) -> None:
        adapter = checkpoint / "adapter"
        if self.lora != adapter.is_dir():
            has, wants = ("without", "with") if self.lora else ("with", "without")
            raise ValueError(
                f"{checkpoint}: a checkpoint of a run {has} LoRA adapters cannot resume a run "
                f"{wants} them (model.lora.rank)"
            )
        if self.lora:
            load_adapter(self.policy, adapter)
        self._load_optimizer(checkpoint / "optimizer")
        trainer = torch.load(
            checkpoint / "trainer_state.pt", map_location="cpu", weights_only=False
        )
        self.shuffle.set_state(trainer["shuffle_rng"])
        torch.random.set_rng_state(trainer["torch_rng"])
        random.setstate(trainer["python_rng"])

    def _load_optimizer(self, directory: Path) -> None:
        """Loads the optimizer's state, resharded to this group whatever the size of the
        group that saved it."""

        models = self.trained_models()
        state = {"optimizer": get_optimizer_state_dict(models, self.optimizer)}
        with _one_process_is_intended():
            load_sharded(state, checkpoint_id=directory, no_dist=self.world_size == 1)
        set_optimizer_state_dict(models, self.optimizer, optim_state_dict=state["optimizer"])


@contextlib.contextmanager
def _one_process_is_intended() -> Iterator[None]:
    """Silences torch.distributed.checkpoint's warning that it runs in one process."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _under(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Returns the entries of a state dict under `prefix`, named without it."""
    return {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}


def _sum_over_learners(metrics: dict[str, float]) -> dict[str, float]:
    """Returns each metric summed over the learner group (its own values outside one)."""
    summed: dict[str, float] = {}
    for values in dd.gather_objects(metrics):
        for key, value in values.items():
            summed[key] = summed.get(key, 0.0) + value
    return summed
