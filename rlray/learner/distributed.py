"""The learner group's plumbing: one torch.distributed process group over the learner
processes (gloo on CPU, NCCL on GPU: the same code), FSDP2 sharding of a model across
it, and the split of a batch across the learners by tokens.

How the group's update equals one learner's: every learner holds the whole batch (the
same object-store references) and computes the same split, so they agree on it without
talking. Each learner's loss is its rows' share of the whole mini-batch's loss (divided
by the mini-batch's token count over every learner), so the mini-batch's gradient is
the SUM of the learners' gradients, not their mean: every sharded module's reduction
is set to a plain sum (FSDP2 divides by the group size by default; checked on torch
2.13 with gloo, where pytorch#162338 reported a sum instead, it does divide). FSDP2
gathers each layer's parameters for every forward and backward pass, so every learner
must run the same number of micro-batches: one with no rows of its own runs a row with
an all-zero loss mask.
"""

from __future__ import annotations

import heapq
import socket
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard


def free_port() -> int:
    """Returns a TCP port that was free a moment ago (for the group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def backend_for(device_type: str) -> str:
    """Returns the process group backend of a device type: nccl for cuda, else gloo."""
    return "nccl" if device_type == "cuda" else "gloo"


def join_group(
    rank: int, world_size: int, address: str, port: int, device_type: str, timeout_s: float
) -> None:
    """Joins the learners' process group; rank 0's address and port are the rendezvous.
    Every learner blocks here until all `world_size` have joined, at most `timeout_s`."""
    dist.init_process_group(
        backend_for(device_type),
        init_method=f"tcp://{address}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def rank_and_size() -> tuple[int, int]:
    """Returns this learner's rank and the group's size: (0, 1) outside a group."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """Returns a tensor whole: a sharded one (a DTensor) all-gathered from every learner,
    so every learner must call it at the same point; any other tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def gather_objects(value: object) -> list[object]:
    """Returns every learner's `value`, by rank ([value] outside a group)."""
    if not dist.is_initialized():
        return [value]
    values: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def barrier() -> None:
    """Waits until every learner of the group is here (nothing outside a group)."""
    if dist.is_initialized():
        dist.barrier()


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """Returns the model's decoder layers: the modules of the classes transformers names
    in `_no_split_modules` (a critic's are on its trunk)."""
    layer_classes = {
        name
        for module in model.modules()
        for name in getattr(module, "_no_split_modules", None) or []
    }
    return [module for module in model.modules() if type(module).__name__ in layer_classes]


def shard(model: nn.Module, device_type: str) -> nn.Module:
    """Shards the model's parameters (and so its gradients and optimizer state) across
    the process group with FSDP2: each decoder layer on its own, so that only one layer
    is whole at a time, then the rest (embeddings, head, norms) together. Gradients are
    summed over the group, not averaged (see the module docstring)."""

    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # Each sharded module reduces its own gradients: set the sum on every one of them
    # (set on the root only, the layers' gradients were halved at 2 learners).
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def reshard(model: nn.Module) -> None:
    """Frees the whole parameters a sharded model's forward pass left gathered. FSDP2
    keeps the root's (embeddings, head, norms) whole after a forward pass for the
    backward pass to come; after a pass without one they stay so, and the next backward
    pass fails to free them once anything else has looked at them (seen after a DPO
    evaluation, then publishing the weights, then a step: "Trying to resize storage
    that is not resizable"). Nothing to do for a model that is not sharded."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Returns a copy of every parameter and buffer of a (sharded) model as a whole CPU
    tensor: all-gathered, so every learner of the group must call it."""
    state = model.state_dict().items()
    return {name: whole(value).detach().to("cpu", copy=True) for name, value in state}


def split_by_tokens(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Returns the row indexes of each of `parts` learners, their token counts balanced:
    rows are dealt longest first, each to the learner with the fewest tokens so far
    (the lower rank of equals). Each learner's rows are in ascending order. A learner
    may get no row when there are fewer rows than learners."""
    if parts < 1:
        raise ValueError(f"split into parts >= 1, got {parts}")
    loads = [(0, part) for part in range(parts)]
    owned: list[list[int]] = [[] for _ in range(parts)]
    for row in sorted(range(len(lengths)), key=lambda r: (-lengths[r], r)):
        tokens, part = heapq.heappop(loads)
        owned[part].append(row)
        heapq.heappush(loads, (tokens + lengths[row], part))
    return [sorted(rows) for rows in owned]


def micro_batch_count(rows_per_learner: Sequence[int], micro_batch_size: int) -> int:
    """Returns how many micro-batches every learner runs: as many as the learner with
    the most rows needs, at least one."""
    return max(1, max(-(-rows // micro_batch_size) for rows in rows_per_learner))


def longest_first(
    rows: Sequence[int], prompt: Sequence[int], completion: Sequence[int]
) -> list[int]:
    """Returns `rows` by completion length, then prompt length, longest first (equals in
    row order): consecutive micro-batches then hold rows of like lengths, which leave
    little padding once trimmed (TokenBatch.trimmed)."""
    return sorted(rows, key=lambda r: (-completion[r], -prompt[r], r))


def groups_together(
    rows: Sequence[int], group: Sequence[int], prompt: Sequence[int], completion: Sequence[int]
) -> list[int]:
    """Returns `rows` with the rows of each group (one prompt's samples) side by side, so
    that a micro-batch holds whole groups and runs each prompt once (shared_prompts in
    rlray/learner/batches.py): groups by their longest completion, then prompt length,
    longest first; a group's rows longest first (equals in row order)."""
    longest: dict[int, int] = {}
    for r in rows:
        longest[group[r]] = max(longest.get(group[r], 0), completion[r])
    return sorted(rows, key=lambda r: (-longest[group[r]], -prompt[r], group[r], -completion[r], r))


def token_budget_batches(
    rows: Sequence[int],
    prompt: Sequence[int],
    completion: Sequence[int],
    budget: int,
    max_rows: int | None = None,
) -> list[list[int]]:
    """Returns `rows` (in their order) in consecutive micro-batches whose padded size,
    rows x (longest prompt + longest completion), is at most `budget` tokens, and of at
    most `max_rows` rows if given; a row longer than the budget is a micro-batch of its
    own."""
    batches: list[list[int]] = []
    current: list[int] = []
    widest_prompt = widest_completion = 0
    for row in rows:
        grown_prompt = max(widest_prompt, prompt[row])
        grown_completion = max(widest_completion, completion[row])
        padded = (len(current) + 1) * (grown_prompt + grown_completion)
        if current and (padded > budget or len(current) == max_rows):
            batches.append(current)
            current, grown_prompt, grown_completion = [], prompt[row], completion[row]
        current.append(row)
        widest_prompt, widest_completion = grown_prompt, grown_completion
    if current:
        batches.append(current)
    return batches


def micro_batches(rows: Sequence[int], count: int) -> list[list[int]]:
    """Returns `rows` in `count` consecutive micro-batches as even as can be; some are
    empty when there are fewer rows than micro-batches."""
    size, extra = divmod(len(rows), count)
    batches, start = [], 0
    for i in range(count):
        end = start + size + (1 if i < extra else 0)
        batches.append(list(rows[start:end]))
        start = end
    return batches
