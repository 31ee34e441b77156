"""Model paths and what a model can take: the built-in tiny models (rlray.data.tiny_models),
published models from packages (rlray.data.published), local HF-format directories and hub
names; each checked before any actor starts, and the
prompts read by the model's own tokenizer (in a child process: the driver imports no
transformers)."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from rlray.config import (
    BUILTIN_CALCULATOR_MODEL,
    BUILTIN_COUNTDOWN_MODEL,
    BUILTIN_MODEL,
    BUILTIN_SMOLLM2,
    ConfigError,
)
from rlray.core.episode import ModelLimits
from rlray.core.prompt import Prompt
from rlray.data.cache import cache_dir, write_atomically
from rlray.data.chat import render_prompt
from rlray.data.published import SMOLLM2, packaged_model
from rlray.data.tiny_models import ARITHMETIC, CALCULATOR, COUNTDOWN_MODEL, tiny_model

BUILTIN_MODELS = {
    BUILTIN_MODEL: ARITHMETIC,
    BUILTIN_CALCULATOR_MODEL: CALCULATOR,
    BUILTIN_COUNTDOWN_MODEL: COUNTDOWN_MODEL,
}
PACKAGED_MODELS = {BUILTIN_SMOLLM2: SMOLLM2}


def resolve_model_path(spec: str) -> str:
    """Returns a local model directory (or hub name) for the config's model.path.

    Builds a built-in model on first use. Raises ConfigError, naming the path, if a local
    directory is missing or is not an HF-format model, or a packaged model's package is
    not installed.
    """
    if spec in BUILTIN_MODELS:
        return str(tiny_model(BUILTIN_MODELS[spec]))
    if spec in PACKAGED_MODELS:
        return str(packaged_model(PACKAGED_MODELS[spec]))
    if spec.startswith("builtin:"):
        known = ", ".join([*BUILTIN_MODELS, *PACKAGED_MODELS])
        raise ConfigError(f"model.path: unknown built-in model {spec!r}; known: {known}")
    path = Path(spec).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.path: {spec} has no config.json (not an HF-format model)")
        return str(path.resolve())
    if _looks_like_hub_name(spec):
        return spec
    raise ConfigError(f"model.path: no such model directory: {spec}")


# vLLM's keys for a model's own context window (vllm/transformers_utils/
# model_arch_config_convertor.py, derive_max_model_len_and_key): the smallest one counts.
_WINDOW_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
# RoPE types whose max_position_embeddings is already scaled (vllm/config/model.py).
_PRESCALED_ROPE = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


def model_limits(path: str, max_model_len: int) -> ModelLimits | None:
    """Returns what a local model directory can take (its vocabulary, model.max_model_len),
    or None for a hub name; raises ConfigError naming model.path or model.max_model_len.

    Checks, without loading the model: config.json is readable JSON naming a causal-LM
    architecture vLLM generates with, the weights are present and their files whole, and
    max_model_len is within the model's own context window (as vLLM derives it; vLLM's
    VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 skips that check as it does vLLM's)."""
    directory = Path(path)
    if not directory.is_dir():
        return None
    config = _model_config(directory)
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    _check_architecture(config, path)
    _check_weights(directory)
    vocab_size = text.get("vocab_size", config.get("vocab_size"))
    if type(vocab_size) is not int or vocab_size <= 0:
        raise ConfigError(f"model.path: {path}/config.json has no positive vocab_size")
    window = _context_window(text, directory)
    allow_long = os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN") == "1"
    if window is not None and max_model_len > window[0] and not allow_long:
        raise ConfigError(
            f"model.max_model_len ({max_model_len}) is beyond the model's own context "
            f"window ({window[0]}: {window[1]} in {path})"
        )
    return ModelLimits(vocab_size=vocab_size, max_model_len=max_model_len)


def _model_config(directory: Path) -> dict:
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(
            f"model.path: {directory}/config.json is not readable JSON ({_first_line(err)})"
        ) from None
    if not isinstance(config, dict):
        raise ConfigError(f"model.path: {directory}/config.json is not a JSON object")
    return config


def _check_architecture(config: dict, path: str) -> None:
    names = config.get("architectures")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"model.path: {path}/config.json names no architectures")
    # *ForCausalLM names vLLM has, or runs through its Transformers backend; anything else
    # is looked up in vLLM's registry (in a child process: importing vLLM takes seconds).
    if any(n.endswith(("ForCausalLM", "LMHeadModel")) for n in names):
        return
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as child:
        if not child.submit(_vllm_generates_with, names).result():
            raise ConfigError(
                f"model.path: {path} is a {names[0]}, not a causal LM that vLLM generates "
                "with (e.g. Qwen2ForCausalLM, LlamaForCausalLM)"
            )


def _vllm_generates_with(names: list[str]) -> bool:
    # in a child process: vLLM stays out of the driver
    from vllm.model_executor.models.registry import _TEXT_GENERATION_MODELS

    return any(name in _TEXT_GENERATION_MODELS for name in names)


def _check_weights(directory: Path) -> None:
    """Raises ConfigError unless weight files are present and whole (safetensors headers
    parse and the file holds every tensor they list; indexed shards exist)."""
    index_files = sorted(directory.glob("*.index.json"))
    shards: set[str] = set()
    for index in index_files:
        try:
            shards |= set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise ConfigError(
                f"model.path: {index} is not a weight index ({_first_line(err)})"
            ) from None
    files = sorted(directory.glob("*.safetensors")) + sorted(directory.glob("pytorch_model*.bin"))
    if not files and not shards:
        raise ConfigError(
            f"model.path: {directory} holds no weights (*.safetensors or pytorch_model*.bin)"
        )
    for name in sorted(shards):
        if not (directory / name).is_file():
            raise ConfigError(f"model.path: weight shard {directory / name} is missing")
    for file in files:
        if file.suffix == ".safetensors":
            _check_safetensors(file)
        elif file.stat().st_size == 0:
            raise ConfigError(f"model.path: weight file {file} is empty")


def _check_safetensors(file: Path) -> None:
    try:
        with file.open("rb") as handle:
            size = file.stat().st_size
            header_length = int.from_bytes(handle.read(8), "little")
            if size < 8 or header_length > size - 8:
                raise ValueError(f"a header of {header_length} bytes in a {size}-byte file")
            header = json.loads(handle.read(header_length))
        ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"]
        if max(ends, default=0) > size - 8 - header_length:
            raise ValueError(f"truncated: {size} bytes hold tensors up to {max(ends)}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError) as err:
        raise ConfigError(
            f"model.path: weight file {file} is not readable safetensors ({_first_line(err)})"
        ) from None


def _context_window(config: dict, directory: Path) -> tuple[int, str] | None:
    """Returns the model's own context window and where it comes from, as vLLM derives
    it (the smallest length key, and tokenizer_config.json's model_max_length, times a
    RoPE scaling factor), or None if nothing sets one."""
    found = [(config[k], k) for k in _WINDOW_KEYS if isinstance(config.get(k), (int, float))]
    with contextlib.suppress(OSError, ValueError, AttributeError):
        limit = json.loads((directory / "tokenizer_config.json").read_text())["model_max_length"]
        if isinstance(limit, (int, float)):
            found.append((limit, "model_max_length of tokenizer_config.json"))
    if not found:
        return None
    window, key = min(found)
    rope = config.get("rope_scaling") or config.get("rope_parameters")
    if isinstance(rope, dict):
        kind = rope.get("rope_type", rope.get("type"))
        factor = rope.get("factor")
        if kind not in _PRESCALED_ROPE and isinstance(factor, (int, float)):
            window, key = window * factor, f"{key} x RoPE factor {factor}"
    return int(window), key


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _looks_like_hub_name(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "~"))


def prompt_token_counts(path: str, prompts: list[Prompt]) -> list[int]:
    """Returns each prompt's length in tokens as the model's tokenizer (vLLM's) counts it
    (a chat prompt's rendering, rlray.chat.render_prompt: what vLLM is given).

    Counted in a child process: importing transformers imports torch, memory that the
    driver would otherwise hold for the whole run. (The tokenizer file alone is not
    enough: transformers may rebuild a tokenizer by model type, e.g. Qwen2's byte-level
    pre-tokenizer, and count differently.) Raises ConfigError as load_tokenizer does."""
    return [tokens.count for tokens in read_prompts(path, [prompts])[0]]


@dataclass(frozen=True)
class PromptTokens:
    """How the model's tokenizer reads one prompt."""

    count: int
    """Its length in tokens (a chat prompt's: of its rendering by the chat template)."""
    read_as: str | None
    """The text the model reads if characters were lost or replaced (unknown to the
    tokenizer), else None."""


def read_prompts(path: str, prompt_lists: list[list[Prompt]]) -> list[list[PromptTokens]]:
    """Returns how the model's tokenizer reads each prompt of each list, all in one child
    process (see prompt_token_counts). Raises ConfigError as load_tokenizer does.

    The child is slow to start (importing transformers), so the readings of a local
    model are cached under a key of everything they depend on: the prompts, the model
    directory's files other than weights, and the transformers version."""
    cached = _readings_cache_file(path, prompt_lists)
    if cached is not None and cached.exists():
        return [
            [PromptTokens(*reading) for reading in read] for read in json.loads(cached.read_text())
        ]
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as child:
        readings = child.submit(_read_prompts, path, prompt_lists).result()
    if cached is not None:
        with contextlib.suppress(OSError):  # a read-only cache only costs the next run time
            write_atomically(
                cached, json.dumps([[[t.count, t.read_as] for t in r] for r in readings])
            )
    return readings


# Files of a model directory that hold weights, not what the tokenizer reads.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")


def _readings_cache_file(path: str, prompt_lists: list[list[Prompt]]) -> Path | None:
    """Returns the cache file of these prompts' readings by this model's tokenizer, or
    None for a hub name (nothing local to key on)."""
    model_dir = Path(path)
    if not model_dir.is_dir():
        return None
    key = hashlib.sha256(importlib.metadata.version("transformers").encode())
    for file in sorted(model_dir.iterdir()):
        if file.is_file() and not file.name.endswith(WEIGHT_SUFFIXES):
            key.update(file.name.encode() + b"\0" + file.read_bytes())
    key.update(json.dumps(prompt_lists).encode())
    return cache_dir() / "prompt-readings" / f"{key.hexdigest()[:24]}.json"


def _read_prompts(path: str, prompt_lists: list[list[Prompt]]) -> list[list[PromptTokens]]:
    tokenizer = load_tokenizer(path)
    return [[_reading(tokenizer, prompt, path) for prompt in prompts] for prompts in prompt_lists]


def _reading(tokenizer, prompt: Prompt, path: str) -> PromptTokens:
    rendered = render_prompt(tokenizer, prompt, model=path)
    ids = rendered.token_ids
    # A rendered chat holds the template's special tokens in its text.
    lost = read_as(tokenizer, rendered.text, ids, specials_in_text=not isinstance(prompt, str))
    return PromptTokens(len(ids), lost)


def read_as(tokenizer, text: str, ids: list[int], specials_in_text: bool = False) -> str | None:
    """Returns the text the model reads in `ids` if the tokenizer lost or replaced
    characters of `text` (an unknown-token id, or a decoding that differs), else None.
    specials_in_text: `text` spells out its special tokens (a rendered chat template)."""
    shown = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if tokenizer.unk_token_id is not None and tokenizer.unk_token_id in ids:
        return shown
    if specials_in_text:
        return None if shown == text else shown
    kept = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return None if kept == text else shown


def load_tokenizer(path: str):  # -> PreTrainedTokenizerBase
    """Returns the model's tokenizer, or raises ConfigError naming the path."""
    # transformers stays out of the driver, which imports this module
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"model.path: cannot load a tokenizer from {path}: {first_line}"
        ) from None
