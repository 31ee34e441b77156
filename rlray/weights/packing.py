"""The weights a learner publishes to the rollout workers, and their trip through Ray's
object store.

`publishable_weights` casts every parameter, by HF name, to the rollout dtype, and names
a tied output embedding too; a LoRA policy (a PEFT model) publishes its merged weights.
`pack_weights` turns that into raw bytes, because the object store moves NumPy arrays
without copying but NumPy has no bfloat16; `unpack_weights` views those bytes as tensors
again on the rollout side, and `weights_for_vllm` leaves out the tied output name where
vLLM's model for the architecture has no such module.
That last decision needs vLLM's model classes, so it is made where vLLM is loaded
anyway: the learner never imports vLLM.
"""

from __future__ import annotations

import functools
import inspect
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn


def publishable_weights(
    model: nn.Module, dtype: torch.dtype, keep: bool = True
) -> dict[str, torch.Tensor]:
    """Returns every parameter of this transformers causal LM under its HF name, cast to
    `dtype`, on CPU; a tied output embedding also under its own name (`lm_head.weight`),
    sharing the input embedding's tensor. In a learner group every learner calls it
    (each tensor is gathered from all of them) and only the one that publishes keeps
    the weights: the others pass `keep=False` and get {}.

    Where no cast or move is needed the tensors share memory with the model's
    parameters: serialize them before the next optimizer step.
    """
    # Parameters only: buffers (rotary inv_freq, Gemma2's embed_scale) follow from the
    # config, are never trained, and vLLM builds its own.
    # One merged (or gathered) tensor at a time: each float32 one is freed once cast.
    weights = {}
    for name, tensor in merged_parameters(model):
        if keep:
            weights[name] = tensor.to("cpu", dtype)
    if not keep:
        return {}
    tied = _tied_output_embedding(_transformers_model(model))
    if tied is not None:
        output_name, input_name = tied
        weights[output_name] = weights[input_name]
    return weights


def tied_output_name(model: nn.Module) -> str | None:
    """Returns the name of the output embedding's weight if it is the input embedding's."""
    tied = _tied_output_embedding(_transformers_model(model))
    return None if tied is None else tied[0]


def input_embedding_name(model: nn.Module) -> str:
    """Returns the HF name of the input embedding's weight."""
    plain = _transformers_model(model)
    embedding = plain.get_input_embeddings()
    names = {id(module): name for name, module in plain.named_modules()}
    return f"{names[id(embedding)]}.weight"


def merged_parameters(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (HF name, tensor) of every parameter of the transformers model, detached. For
    a PEFT model with LoRA adapters that is the merged model: each adapted layer's weight
    is W + (alpha / r) B A under the layer's plain name, and the adapter tensors are left
    out. The merge is computed out of place: merging into the layer and unmerging after
    would leave rounding errors in the base weights, which are the KL reference."""
    # Merged here rather than sent to vLLM's LoRA support (enable_lora + a LoRARequest
    # per version): the merge costs one B @ A per adapted layer per sync, while vLLM's
    # LoRA path adds the adapters' matmuls to every token of every generate call. It also
    # keeps the rollout side as it is (names, shapes, reload_weights). The adapters alone
    # would be a much smaller message, which could win across slow links.
    for name, param, lora_layer in _published_parameters(model):
        if lora_layer is None:
            # A learner group's parameter is a shard (a DTensor): gathered here, one
            # tensor at a time, by every learner of the group at once.
            yield name, _whole(param.detach())
        else:
            # Not around the yield: the caller would run without gradients meanwhile.
            with torch.no_grad():
                deltas = (lora_layer.get_delta_weight(a) for a in lora_layer.active_adapters)
                merged = param + sum(deltas)
            yield name, merged


def published_shapes(model: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """Returns (HF name, whole shape) of what `merged_parameters` yields, in its order,
    without gathering or merging anything (a shard's shape is its whole tensor's)."""
    return [(name, tuple(param.shape)) for name, param, _ in _published_parameters(model)]


def _published_parameters(
    model: nn.Module,
) -> Iterator[tuple[str, torch.Tensor, nn.Module | None]]:
    """Yields (HF name, parameter, LoRA layer to merge it with or None), adapters left out."""
    plain = _transformers_model(model)
    layers = dict(plain.named_modules())
    for name, param in plain.named_parameters():
        if _ADAPTER_TENSOR.search(name):
            continue
        layer, found, leaf = name.rpartition(".base_layer.")
        if not found:
            yield name, param, None
        elif leaf != "weight":  # a bias: LoRA adapts weights only
            yield f"{layer}.{leaf}", param, None
        else:
            yield f"{layer}.{leaf}", param, layers[layer]


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


# PEFT's adapter tensors: lora_A/lora_B (linear layers), lora_embedding_A/B, DoRA's
# magnitude vector; the adapted layer's own weights live under `.base_layer.`.
_ADAPTER_TENSOR = re.compile(r"\.lora_(A|B|embedding_A|embedding_B|magnitude_vector)\.")


def _transformers_model(model: nn.Module) -> nn.Module:
    """Returns the transformers model inside a PEFT model (the model itself otherwise)."""
    # Duck-typed: rollout workers import this module and need not import PEFT.
    return model.get_base_model() if hasattr(model, "peft_config") else model


def weights_for_vllm(
    weights: dict[str, torch.Tensor], tied_output: str | None, architecture: str
) -> dict[str, torch.Tensor]:
    """Returns the weights vLLM's `reload_weights` accepts for `architecture`: without the
    tied output name where vLLM's model has no module of that name (Gemma2 computes its
    logits with the input embedding, and a weight named lm_head.weight fails its load).

    Where vLLM does have the module (most models), the tied weight must be sent under
    that name: on CPU the module keeps a packed copy for its GEMM that is rebuilt only
    when a weight is loaded under its own name (reload_weights unties them while
    loading); without it the engine computes logits with the stale packed copy, and its
    logprobs drift from the learner's silently."""
    if tied_output is None:
        return weights
    module = tied_output.rpartition(".")[0]
    if module in _vllm_logits_modules(architecture):
        return weights
    return {name: tensor for name, tensor in weights.items() if name != tied_output}


def _tied_output_embedding(model: nn.Module) -> tuple[str, str] | None:
    """Returns (output weight name, input weight name) if the model's output embedding
    is the very parameter of its input embedding, else None."""
    output, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if output is None or output.weight is not embedding.weight:
        return None
    names = {id(module): name for name, module in model.named_modules()}
    return f"{names[id(output)]}.weight", f"{names[id(embedding)]}.weight"


@functools.cache
def _vllm_logits_modules(architecture: str) -> frozenset[str]:
    """Returns the attribute names that vLLM's model class for `architecture` reads in
    `compute_logits`: it has a module of its own for the output embedding (`lm_head`,
    InternLM2's `output`) exactly when that module's name is among them."""
    # vLLM has no declared flag for this; its classes say it in code. With tied
    # embeddings most pass a ParallelLMHead tied to embed_tokens (`self.lm_head`);
    # Gemma2, Gemma3n and the Cohere models have no such module and pass
    # `self.model.embed_tokens`, so a weight named lm_head.weight fails their load_weights.
    # Called in rollout workers, where vLLM is already loaded.
    from vllm.model_executor.models.registry import ModelRegistry

    registered = ModelRegistry.models.get(architecture)
    if registered is None:
        raise ValueError(f"vLLM has no model class for architecture {architecture!r}")
    compute_logits = inspect.unwrap(registered.load_model_cls().compute_logits)
    return frozenset(compute_logits.__code__.co_names)


@dataclass
class PackedWeights:
    """Named tensors as raw bytes, for Ray's object store: it hands NumPy arrays to
    readers on the same node without a copy, but NumPy has no bfloat16."""

    names: list[str]
    dtypes: list[str]  # torch dtype names: "float32", "bfloat16", "float16"
    shapes: list[tuple[int, ...]]
    buffers: list[np.ndarray]  # uint8, one per name; tied names share one array
    tied_output: str | None = None
    """The output embedding's name when it is the input embedding (see weights_for_vllm)."""


def pack_weights(weights: dict[str, torch.Tensor], tied_output: str | None = None) -> PackedWeights:
    """Returns the CPU tensors as uint8 byte arrays with their names, dtypes and shapes;
    names that share a tensor share its array, so it is stored once."""
    arrays: dict[int, np.ndarray] = {}
    for tensor in weights.values():
        if id(tensor) not in arrays:
            # reshape(-1) first: a 0-dim tensor cannot be viewed as bytes.
            flat = tensor.detach().contiguous().reshape(-1)
            arrays[id(tensor)] = flat.view(torch.uint8).numpy()
    return PackedWeights(
        names=list(weights),
        dtypes=[str(t.dtype).removeprefix("torch.") for t in weights.values()],
        shapes=[tuple(t.shape) for t in weights.values()],
        buffers=[arrays[id(t)] for t in weights.values()],
        tied_output=tied_output,
    )


def unpack_weights(packed: PackedWeights) -> dict[str, torch.Tensor]:
    """Returns the named tensors, viewing the packed byte arrays without a copy."""
    with warnings.catch_warnings():
        # The object store hands out read-only arrays and torch warns about sharing
        # them; vLLM only reads these (it copies them into its own parameters).
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return {
            name: torch.from_numpy(buffer).view(getattr(torch, dtype)).reshape(shape)
            for name, dtype, shape, buffer in zip(
                packed.names, packed.dtypes, packed.shapes, packed.buffers, strict=True
            )
        }
