"""The learner group's update equals one learner's: 4 processes in one gloo group,
the embedded model sharded with FSDP2, one AdamW update with gradient clipping on a
batch of uneven sequences split by tokens, against the same update in one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from rlray.algorithms import rl_math as rm
from rlray.config import Config
from rlray.data.models import resolve_model_path
from rlray.learner import distributed as dd
from rlray.learner.batches import TokenBatch, collate

MICRO_BATCH = 3
ROWS = 10
# Small enough that clipping acts: the group must clip by the norm of the whole gradient.
MAX_GRAD_NORM = 0.05


def token_batch(vocab: int) -> tuple[TokenBatch, torch.Tensor]:
    """Returns a batch of prompts and completions of uneven lengths and its advantages."""
    generator = torch.Generator().manual_seed(7)
    prompts, completions = [], []
    for row in range(ROWS):
        prompt = torch.randint(3, vocab, (2 + row % 4,), generator=generator).tolist()
        completion = torch.randint(3, vocab, (1 + (row * 7) % 9,), generator=generator).tolist()
        prompts.append(prompt)
        completions.append(completion)
    batch = collate(prompts, completions, pad_token_id=0)
    advantages = torch.randn(batch.mask.shape, generator=generator)
    return batch, advantages


def one_update(
    model: torch.nn.Module, batch: TokenBatch, advantages: torch.Tensor, owned: list[list[int]]
) -> tuple[float, dict[str, torch.Tensor]]:
    """Runs one token-mean policy-gradient update of `model` on this learner's rows
    (`owned[rank]`); returns the gradient norm and the clipped gradients, whole. A
    group's learners each run it."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    count = dd.micro_batch_count([len(rows) for rows in owned], MICRO_BATCH)
    total_tokens = float(batch.mask.sum())  # the whole batch's, the same on every learner
    for rows in dd.micro_batches(owned[rank], count):
        index = torch.tensor(rows or [0])
        micro, weight = batch.rows(index), advantages[index]
        mask = micro.mask if rows else torch.zeros_like(micro.mask)  # a row that adds 0
        steps = micro.completion_columns
        logits = model(
            input_ids=micro.input_ids,
            attention_mask=micro.attention_mask,
            position_ids=micro.position_ids,
            logits_to_keep=steps + 1,
        ).logits[:, :-1]
        logp = rm.token_logprobs(logits.float(), micro.completion_ids)
        loss = -(logp * weight * mask).sum() / total_tokens
        loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
    gradients = {name: whole(p.grad).clone() for name, p in model.named_parameters()}
    optimizer.step()
    return float(whole(norm)), gradients


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """Returns a tensor whole: a sharded one (a DTensor) gathered from every learner."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def load_model() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(Config().model.path)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def learner_process(rank: int, world_size: int, port: int, out: str) -> None:
    """One learner of the group: joins, shards, updates, and rank 0 saves the result."""
    torch.set_num_threads(1)
    dd.join_group(rank, world_size, "127.0.0.1", port, "cpu", timeout_s=120)
    model = load_model()
    batch, advantages = token_batch(model.config.vocab_size)
    owned = dd.split_by_tokens(batch.attention_mask.sum(dim=1).tolist(), world_size)
    dd.shard(model, "cpu")
    norm, gradients = one_update(model, batch, advantages, owned)
    state = dd.full_state_dict(model)  # every learner takes part in the gather
    if rank == 0:
        torch.save({"state": state, "norm": norm, "gradients": gradients, "owned": owned}, out)
    torch.distributed.destroy_process_group()


def group_update(world_size: int, tmp_path: Path) -> dict:
    out = str(tmp_path / f"group-{world_size}.pt")
    mp.spawn(learner_process, (world_size, dd.free_port(), out), nprocs=world_size)
    return torch.load(out)


@pytest.fixture(scope="module")
def single_update() -> dict:
    model = load_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch, advantages = token_batch(model.config.vocab_size)
    norm, gradients = one_update(model, batch, advantages, [list(range(ROWS))])
    return {"state": model.state_dict(), "norm": norm, "gradients": gradients, "before": before}


# 2 learners: tests/test_learner_group.py, with the real Learner (policy, critic and
# reference sharded) in place of this bare update.
@pytest.mark.parametrize("world_size", [4])
def test_one_update_of_the_group_equals_one_update_of_a_single_learner(
    world_size, single_update, tmp_path
):
    group = group_update(world_size, tmp_path)
    # Every learner had rows, and the split balanced tokens (not rows).
    assert all(group["owned"])
    assert sorted(r for rows in group["owned"] for r in rows) == list(range(ROWS))
    # Clipping acted, on the norm of the whole gradient.
    assert single_update["norm"] > MAX_GRAD_NORM
    assert group["norm"] == pytest.approx(single_update["norm"], rel=1e-5)
    # The gradient of every parameter is the whole mini-batch's: summed over the group.
    # (With FSDP2's default, the mean, every layer's came out halved at 2 learners, and
    # AdamW's first step, which barely depends on the gradient's scale, hid it.)
    for name, gradient in single_update["gradients"].items():
        assert torch.allclose(group["gradients"][name], gradient, atol=1e-8, rtol=1e-4), name
    moved = max((v - single_update["before"][k]).abs().max() for k, v in group["state"].items())
    assert moved > 1e-3  # the update did something
    # AdamW divides by the root of the squared gradient: where that is tiny, summation
    # order moves an element by up to 6e-6 (measured at 2 learners; updates are 1e-2).
    for name, value in single_update["state"].items():
        assert torch.allclose(group["state"][name], value, atol=2e-5, rtol=0), name


def test_split_by_tokens_balances_tokens_longest_first():
    # 9 to learner 0; 5 to 1; 4 to 1 (5 < 9); 3 to 0 (9 and 9: the lower rank)
    assert dd.split_by_tokens([3, 9, 4, 5], 2) == [[0, 1], [2, 3]]
    assert dd.split_by_tokens([1, 1, 1, 1, 1, 1], 3) == [[0, 3], [1, 4], [2, 5]]
    assert dd.split_by_tokens([5], 3) == [[0], [], []]
    split = dd.split_by_tokens([10, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], 2)
    assert split == [[0], list(range(1, 11))]  # 10 tokens each, not 6 rows each


def test_every_learner_runs_as_many_micro_batches_as_the_busiest():
    assert dd.micro_batch_count([5, 2, 0], 2) == 3
    assert dd.micro_batch_count([0, 0], 4) == 1
    assert dd.micro_batches([1, 2, 3, 4, 5], 3) == [[1, 2], [3, 4], [5]]
    assert dd.micro_batches([7], 3) == [[7], [], []]
    assert dd.micro_batches([], 2) == [[], []]


def test_rows_go_longest_first_by_completion_then_prompt():
    prompt, completion = [2, 5, 2, 3], [4, 4, 9, 1]
    assert dd.longest_first([0, 1, 2, 3], prompt, completion) == [2, 1, 0, 3]
    assert dd.longest_first([3, 0], prompt, completion) == [0, 3]


def test_a_groups_rows_stay_side_by_side_longest_group_first():
    # Rows 0, 2, 4 share prompt 0 (completions 1, 6, 3); rows 1, 3 prompt 1 (5, 5);
    # row 5 prompt 2 (6), a longer prompt than prompt 0's.
    group, prompt = [0, 1, 0, 1, 0, 2], [2, 2, 2, 2, 2, 3]
    completion = [1, 5, 6, 5, 3, 6]
    assert dd.groups_together(range(6), group, prompt, completion) == [5, 2, 4, 0, 1, 3]
    assert dd.groups_together([4, 1, 0], group, prompt, completion) == [1, 4, 0]


def test_a_token_budget_bounds_each_micro_batch_with_its_padding():
    prompt, completion = [2, 2, 2, 2, 2], [20, 10, 5, 4, 1]
    # Row 0 (22 tokens) is over the budget: alone. Row 1 (12): alone, as 2 x 12 > 16.
    # Rows 2 and 3 pad to 7 each: 14; row 4 would make 3 x 7 = 21.
    batches = dd.token_budget_batches([0, 1, 2, 3, 4], prompt, completion, 16)
    assert batches == [[0], [1], [2, 3], [4]]
    # The padded size counts the longest prompt and the longest completion together.
    assert dd.token_budget_batches([0, 1], [9, 1], [1, 9], 20) == [[0], [1]]
    assert dd.token_budget_batches([], prompt, completion, 16) == []


def test_a_micro_batch_holds_at_most_max_rows_within_its_token_budget():
    prompt, completion = [1] * 7, [1] * 7  # 2 tokens a row: 14 padded in all
    rows = list(range(7))
    assert dd.token_budget_batches(rows, prompt, completion, 100) == [rows]
    assert dd.token_budget_batches(rows, prompt, completion, 100, 3) == [[0, 1, 2], [3, 4, 5], [6]]
    # The tighter bound wins: 3 rows of 2 tokens are 6, over a budget of 4.
    assert dd.token_budget_batches(rows, prompt, completion, 4, 3) == [[0, 1], [2, 3], [4, 5], [6]]
