"""LoRA adapters (PEFT) on the policy: added, merged for publishing, saved and loaded."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from rlray.weights.packing import merged_parameters, tied_output_name


def with_lora(model: nn.Module, rank: int, alpha: float, targets: list[str]) -> nn.Module:
    """Returns the model wrapped by PEFT with LoRA adapters on `targets`; only the
    adapters require gradients. B starts at 0, so the policy starts as the base model."""
    # peft loads only when model.lora.rank > 0
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        # PEFT takes "all-linear" as a string; a list would be read as module names.
        target_modules="all-linear" if targets == ["all-linear"] else targets,
        lora_dropout=0.0,  # the ratio of two forward passes must not be noise
        bias="none",
    )
    return get_peft_model(model, config)


def save_merged(model: nn.Module, directory: Path) -> None:
    """Writes the PEFT model's merged weights (base + adapters, plain HF names) as an HF
    model directory that vLLM and transformers load as a plain model."""
    plain = model.get_base_model()
    weights = dict(merged_parameters(model))
    tied = tied_output_name(model)
    if tied is not None:  # saved once, under the input embedding's name
        weights.pop(tied, None)
    plain.save_pretrained(directory, state_dict=weights)


def load_adapter(model: nn.Module, directory: Path) -> None:
    """Loads a checkpoint's adapter weights into the PEFT model; raises ValueError if
    they do not match its adapters (another rank or other target modules)."""
    # as in with_lora
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file  # beside peft: only LoRA checkpoints need it

    result = set_peft_model_state_dict(model, load_file(directory / "adapter_model.safetensors"))
    missing = [key for key in result.missing_keys if ".lora_" in key]
    if result.unexpected_keys or missing:
        raise ValueError(f"{directory}: its adapters do not match model.lora's")
