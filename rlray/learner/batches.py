"""A learner's batches: episodes as tensors (TokenBatch), how a batch's rows split into
micro-batches (MicroBatching), and what a forward pass returns (Outputs).

Padding: a micro-batch holds rows of like lengths (longest first) and runs on its own
columns only (TokenBatch.trimmed), so a short row is padded to the longest of its
micro-batch, not of the batch; `TokenCounts` says how much padding is left.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import nn

from rlray.learner import distributed as dd


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


@dataclass
class MicroBatching:
    """How a learner splits a batch's rows into micro-batches: at most `max_rows` rows,
    and `max_tokens` padded tokens if above 0, of like lengths, each on its own columns.
    In a learner group each learner takes its share of the rows (`rank` of
    `world_size`)."""

    max_rows: int
    max_tokens: int = 0
    rank: int = 0
    world_size: int = 1

    def split(
        self, batch: TokenBatch, rows: torch.Tensor, shared: SharedPrompts | None
    ) -> list[torch.Tensor | None]:
        """Returns this learner's share of `rows` (balanced by tokens across the group;
        all of them outside one), longest first, in as many micro-batches as the
        busiest learner runs: None where this learner has no row left, as FSDP2 needs
        every learner to run the same forward and backward passes. With `shared` (the
        distinct prompts of `rows`), whole groups go in a micro-batch."""
        prompt_columns = batch.input_ids.shape[1] - batch.completion_columns
        present = batch.attention_mask[rows]
        prompt = present[:, :prompt_columns].sum(dim=1).tolist()
        completion = present[:, prompt_columns:].sum(dim=1).tolist()
        lengths = [p + c for p, c in zip(prompt, completion, strict=True)]
        groups = None if shared is None else shared.of_row.tolist()
        owned = [
            self.order(o, prompt, completion, groups)
            for o in dd.split_by_tokens(lengths, self.world_size)
        ]
        if self.max_tokens:
            split = [
                dd.token_budget_batches(o, prompt, completion, self.max_tokens, self.max_rows)
                for o in owned
            ]
            count = max(1, max(len(batches) for batches in split))
            mine = split[self.rank] + [[]] * (count - len(split[self.rank]))
        else:
            count = dd.micro_batch_count([len(o) for o in owned], self.max_rows)
            mine = dd.micro_batches(owned[self.rank], count)
        return [
            rows[torch.tensor(micro, dtype=torch.long, device=rows.device)] if micro else None
            for micro in mine
        ]

    def order(
        self,
        rows: list[int],
        prompt: list[int],
        completion: list[int],
        groups: list[int] | None,
    ) -> list[int]:
        """Returns a learner's rows in the order micro-batches take them: longest first,
        or with `groups` (each row's distinct prompt) whole groups together, so that each
        of their prompts runs once."""
        if groups is None:
            return dd.longest_first(rows, prompt, completion)
        return dd.groups_together(rows, groups, prompt, completion)

    def take(self, batch: TokenBatch, rows: torch.Tensor) -> TokenBatch:
        """Returns a micro-batch's rows on its own columns."""
        return batch.trimmed(rows)
