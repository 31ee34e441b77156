"""An Engine's checkpoint on disk: the policy in HF format (with LoRA the merged model,
and the adapters apart), the critic, the optimizer's state (torch.distributed.checkpoint,
which a learner group of another size can load) and the random states.

    directory/policy/           HF model + tokenizer (what vLLM and transformers load)
    directory/adapter/          LoRA adapters, with LoRA only
    directory/critic/           the critic's trunk (HF) and value_head.pt
    directory/optimizer/        AdamW's state, a shard per learner
    directory/trainer_state.pt  the shuffle's, torch's and Python's random states
"""

from __future__ import annotations

import contextlib
import random
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

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

from rlray.learner.lora import load_adapter, save_merged

if TYPE_CHECKING:
    from rlray.learner.engine import Engine


def save_engine(engine: Engine, directory: Path, tokenizer: Any) -> None:
    """Writes the engine's models, tokenizer, optimizer and random states into
    `directory`. Collective in a group: rank 0 writes the whole models, gathered a
    tensor at a time, and every learner writes its shard of the optimizer's state."""
    policy = _whole_state(engine.policy, engine.rank, engine.world_size)
    critic = None
    if engine.critic is not None:
        critic = _whole_state(engine.critic, engine.rank, engine.world_size)
    if engine.rank == 0:
        _save_models(engine, directory, tokenizer, policy, critic)
    optimizer = get_optimizer_state_dict(engine.trained_models(), engine.optimizer)
    with _one_process_is_intended():
        save_sharded(
            {"optimizer": optimizer},
            checkpoint_id=directory / "optimizer",
            no_dist=engine.world_size == 1,
        )
    if engine.rank == 0:
        torch.save(
            {
                "shuffle_rng": engine.shuffle.get_state(),
                "torch_rng": torch.random.get_rng_state(),
                "python_rng": random.getstate(),
            },
            directory / "trainer_state.pt",
        )


def load_engine_state(engine: Engine, checkpoint: Path) -> None:
    """Loads what a checkpoint holds beside the models the engine was built from: the
    LoRA adapters, the optimizer's state and the random states."""
    adapter = checkpoint / "adapter"
    if engine.lora != adapter.is_dir():
        has, wants = ("without", "with") if engine.lora else ("with", "without")
        raise ValueError(
            f"{checkpoint}: a checkpoint of a run {has} LoRA adapters cannot resume a run "
            f"{wants} them (model.lora.rank)"
        )
    if engine.lora:
        load_adapter(engine.policy, adapter)
    _load_optimizer(engine, checkpoint / "optimizer")
    trainer = torch.load(checkpoint / "trainer_state.pt", map_location="cpu", weights_only=False)
    engine.shuffle.set_state(trainer["shuffle_rng"])
    torch.random.set_rng_state(trainer["torch_rng"])
    random.setstate(trainer["python_rng"])


def _whole_state(model: nn.Module, rank: int, world_size: int) -> dict[str, torch.Tensor] | None:
    """Returns the model's state dict whole on rank 0's CPU (None elsewhere); outside
    a group, None: the model saves itself."""
    if world_size == 1:
        return None

    # Collective: every learner gathers, and only rank 0 keeps (cpu_offload).
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    return state if rank == 0 else None


def _save_models(
    engine: Engine,
    directory: Path,
    tokenizer: Any,
    policy: dict[str, torch.Tensor] | None,
    critic: dict[str, torch.Tensor] | None,
) -> None:
    if engine.lora:
        engine.policy.save_pretrained(directory / "adapter")
        save_merged(engine.policy, directory / "policy")
    else:
        engine.policy.save_pretrained(directory / "policy", state_dict=policy)
    tokenizer.save_pretrained(directory / "policy")
    if engine.critic is not None:
        head = engine.critic.head.state_dict()
        trunk = None
        if critic is not None:  # gathered: split into the trunk's and the head's
            trunk = _under(critic, "trunk.")
            head = _under(critic, "head.")
        engine.critic.trunk.save_pretrained(directory / "critic", state_dict=trunk)
        torch.save(head, directory / "critic" / "value_head.pt")


def _load_optimizer(engine: Engine, directory: Path) -> None:
    """Loads the optimizer's state, resharded to this group whatever the size of the
    group that saved it."""

    models = engine.trained_models()
    state = {"optimizer": get_optimizer_state_dict(models, engine.optimizer)}
    with _one_process_is_intended():
        load_sharded(state, checkpoint_id=directory, no_dist=engine.world_size == 1)
    set_optimizer_state_dict(models, engine.optimizer, optim_state_dict=state["optimizer"])


@contextlib.contextmanager
def _one_process_is_intended() -> Iterator[None]:
    """Silences torch.distributed.checkpoint's warning that it runs in one process."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _under(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Returns the entries of a state dict under `prefix`, named without it."""
    return {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
