"""The models an Engine trains and reads: the policy, the frozen reference and the critic,
loaded in float32 without dropout, compiled and sharded across the learner group when
asked (rlray/learner/engine.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModel, AutoModelForCausalLM

from rlray.learner import distributed as dd
from rlray.learner.engine_settings import EngineSettings
from rlray.learner.lora import with_lora


def compile_decoder_layers(model: nn.Module) -> None:
    """Compiles each decoder layer's forward in place (torch.compile, inductor, dynamic
    shapes; parameter names unchanged). The layers share one compiled graph, and one
    more for passes without gradients. On CPU it fuses the norms', rotary's and
    activation's elementwise work (BENCHMARKS.md#the-learner-on-a-gpu). The compilation
    runs in this process (no pool of compile workers beside the learner)."""
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


@dataclass
class Models:
    """An engine's models: the policy, and the reference and critic where asked for."""

    policy: nn.Module
    reference: nn.Module | None
    critic: ValueModel | None


def build_models(
    model_path: str,
    settings: EngineSettings,
    checkpoint: str | Path | None,
    world_size: int,
) -> Models:
    """Returns the models the settings ask for, on their device: the policy (float32
    master weights whatever the compute dtype; with LoRA the starting model with
    adapters), the reference and the critic (a checkpoint's where it has them),
    compiled if asked and sharded across a learner group of `world_size` > 1."""
    device = torch.device(settings.device)
    lora = settings.lora_rank > 0
    checkpointing = settings.gradient_checkpointing
    # With LoRA the base is always the starting model; a checkpoint adds its adapters.
    policy_path = f"{checkpoint}/policy" if checkpoint and not lora else model_path
    policy = load_model(AutoModelForCausalLM, policy_path, device, checkpointing)
    if lora:
        policy = with_lora(
            policy, settings.lora_rank, settings.lora_alpha, list(settings.lora_targets)
        )
    # With LoRA the reference is the policy with its adapters off.
    with_reference = settings.with_reference and not lora
    reference = load_reference(model_path, device) if with_reference else None
    critic = None
    if settings.with_critic:
        hidden_size = policy.config.hidden_size
        critic = load_critic(model_path, checkpoint, hidden_size, device, checkpointing)
    models = Models(policy, reference, critic)
    held = [m for m in (policy, reference, critic) if m is not None]
    if settings.compile_layers:
        for model in held:
            compile_decoder_layers(model)
    if world_size > 1:
        if lora:
            raise ValueError("LoRA adapters in a learner group (learner.num_workers > 1)")
        # before the optimizer exists: its state is then sharded too
        for model in held:
            dd.shard(model, device.type)
    return models


def load_model(
    auto_class: Any, path: str, device: torch.device, gradient_checkpointing: bool
) -> nn.Module:
    """Returns the model at `path` in float32 on `device`, in training mode without
    dropout."""
    model = auto_class.from_pretrained(path, dtype=torch.float32).to(device)
    disable_dropout(model)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()  # gradient checkpointing acts in training mode only; no dropout left
    return model


def load_reference(model_path: str, device: torch.device) -> nn.Module:
    """Returns the frozen reference model: the starting model in float32 like the
    policy, so that KL is exactly 0 before the first update."""
    reference = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return reference.to(device).requires_grad_(False).eval()


def load_critic(
    model_path: str,
    checkpoint: str | Path | None,
    hidden_size: int,
    device: torch.device,
    gradient_checkpointing: bool,
) -> ValueModel:
    """Returns the critic: the checkpoint's, or the starting model's trunk with a zero
    value head. A checkpoint of a run without a critic (another estimator) has none."""
    has_critic = checkpoint is not None and Path(checkpoint, "critic").is_dir()
    trunk_path = f"{checkpoint}/critic" if has_critic else model_path
    trunk = load_model(AutoModel, trunk_path, device, gradient_checkpointing)
    critic = ValueModel(trunk, hidden_size).to(device)
    head_path = Path(trunk_path, "value_head.pt")
    if has_critic and head_path.is_file():
        critic.head.load_state_dict(torch.load(head_path, map_location=device))
    return critic
