"""Model paths: the embedded tiny arithmetic model, local directories and hub names.

The embedded default is a 0.53M-parameter Qwen2 (hidden 128, 2 layers, 2 heads of
head_dim 64, which vLLM's CPU attention supports) with a character tokenizer built by
`tokenizers`. It is warm-started briefly on the arithmetic task by supervised learning
so that RL starts from a model that is right sometimes but far from always. The
result is cached (keyed by everything that shapes it), so only the first run pays.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import multiprocessing
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from rlray.chat import Prompt, render_prompt
from rlray.config import BUILTIN_CALCULATOR_MODEL, BUILTIN_MODEL, ConfigError
from rlray.episode import ModelLimits

TINY_RECIPE = {
    "recipe": 1,
    "hidden_size": 128,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "max_position_embeddings": 64,
    "digits": 2,
    "warm_start_steps": 350,
    "warm_start_batch": 128,
    "warm_start_lr": 1e-3,
    "seed": 0,
    # The tokenizer's chat template (below) is part of the model directory; it changes
    # no weight (the warm start reads plain text), measured: model.safetensors is
    # byte-identical with and without it.
    "chat_template": 2,
}
CHARACTERS = list("0123456789+-*=() ")
SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>"]
# A minimal chat template for the character tokenizer, in what it already reads: each
# message is its content, an assistant message's followed by <eos>; the generation
# prompt adds nothing. So a conversation whose last message is the user's "12+34=" reads
# as the text prompt "12+34=" does, and the embedded model answers it alike. (No space
# between messages: the saved tokenizer loads as Qwen2's byte-level one, which drops it.)
CHAR_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- message['content'] -}}"
    "{%- if message['role'] == 'assistant' -%}{{- eos_token -}}{%- endif -%}"
    "{%- endfor -%}"
)


def cache_dir() -> Path:
    """Returns rlray's cache folder: $RLRAY_CACHE_DIR, else ~/.cache/rlray."""
    return Path(os.environ.get("RLRAY_CACHE_DIR") or Path.home() / ".cache" / "rlray")


def resolve_model_path(spec: str) -> str:
    """Returns a local model directory (or hub name) for the config's model.path.

    Raises ConfigError, naming the path, if a local directory is missing or is not an
    HF-format model.
    """
    if spec == BUILTIN_MODEL:
        return str(tiny_arithmetic_model())
    if spec == BUILTIN_CALCULATOR_MODEL:
        from rlray.calculator import tiny_calculator_model

        return str(tiny_calculator_model())
    if spec.startswith("builtin:"):
        known = f"{BUILTIN_MODEL}, {BUILTIN_CALCULATOR_MODEL}"
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


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def tiny_arithmetic_model() -> Path:
    """Returns the directory of the warm-started tiny model, building it on first use.

    Several processes (actors on one node) may ask at once: one builds under a file
    lock, the others wait and reuse it. The build is seeded, but float arithmetic differs
    between CPU kinds and thread counts: a node of another kind builds a different copy
    (measured: a 16-core GPU machine's copy gives other logprobs than this 2-core one's).
    That is harmless in a run, since rollout workers load the learner's weights before
    they generate.
    """
    key = hashlib.sha256(json.dumps(TINY_RECIPE, sort_keys=True).encode()).hexdigest()[:12]
    target = cache_dir() / "models" / f"tiny-arithmetic-{key}"
    if (target / "config.json").is_file():
        return target
    with _file_lock(cache_dir() / "models" / f".tiny-arithmetic-{key}.lock"):
        if not (target / "config.json").is_file():
            print(f"building the embedded tiny model in {target} (first use only)", flush=True)
            staging = Path(tempfile.mkdtemp(prefix="tiny-", dir=target.parent))
            _build_tiny_arithmetic_model(staging)
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)
    return target


def build_char_tokenizer():  # -> PreTrainedTokenizerFast
    """Returns a character-level fast tokenizer (one token per character, specials
    first) with a minimal chat template (CHAR_CHAT_TEMPLATE)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    tokenizer.chat_template = CHAR_CHAT_TEMPLATE
    return tokenizer


def _build_tiny_arithmetic_model(out: Path) -> None:
    recipe = TINY_RECIPE
    with _single_seed(recipe["seed"]):
        model, tokenizer = _char_qwen2(
            recipe["hidden_size"],
            recipe["intermediate_size"],
            recipe["num_hidden_layers"],
            recipe["num_attention_heads"],
            recipe["max_position_embeddings"],
        )
        _warm_start(model, tokenizer)
    _save(model, tokenizer, out)
    (out / "rlray_recipe.json").write_text(json.dumps(recipe, indent=2))


def random_char_model(
    out: Path, hidden: int, layers: int, max_positions: int, seed: int = 0
) -> int:
    """Saves a random-weight Qwen2 with the character tokenizer (heads of head_dim 64,
    MLP 4x hidden) into `out`; returns its parameter count. For throughput benchmarks."""
    with _single_seed(seed):
        model, tokenizer = _char_qwen2(hidden, 4 * hidden, layers, hidden // 64, max_positions)
    _save(model, tokenizer, out)
    return sum(p.numel() for p in model.parameters())


def _char_qwen2(hidden: int, intermediate: int, layers: int, heads: int, max_positions: int):
    """Returns a randomly initialised Qwen2ForCausalLM (tied embeddings) and the
    character tokenizer it reads."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_char_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    return Qwen2ForCausalLM(config), tokenizer


def _save(model, tokenizer, out: Path) -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save_pretrained's bar is noise on every run
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


@contextlib.contextmanager
def _single_seed(seed: int) -> Iterator[None]:
    import torch

    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.random.set_rng_state(state)


def _warm_start(model, tokenizer) -> None:
    """Supervised steps on a+b=answer<eos> (training pairs only), loss on the answer."""
    import torch

    from rlray.data import ArithmeticPrompts

    recipe = TINY_RECIPE
    prompts = ArithmeticPrompts(recipe["digits"], seed=recipe["seed"], held_out=200)
    rng = random.Random(recipe["seed"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe["warm_start_lr"], weight_decay=0.0)
    model.train()
    for _ in range(recipe["warm_start_steps"]):
        rows = [prompts.row(rng.randrange(1 << 30)) for _ in range(recipe["warm_start_batch"])]
        pairs = [
            (
                tokenizer(r.prompt).input_ids,
                [*tokenizer(r.columns["answer"]).input_ids, tokenizer.eos_token_id],
            )
            for r in rows
        ]
        width = max(len(p) + len(c) for p, c in pairs)
        input_ids = torch.full((len(pairs), width), tokenizer.pad_token_id)
        labels = torch.full((len(pairs), width), -100)
        attention = torch.zeros(len(pairs), width, dtype=torch.long)
        for i, (p, c) in enumerate(pairs):
            input_ids[i, : len(p) + len(c)] = torch.tensor(p + c)
            labels[i, len(p) : len(p) + len(c)] = torch.tensor(c)
            attention[i, : len(p) + len(c)] = 1
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def prompt_token_counts(path: str, prompts: list[Prompt]) -> list[int]:
    """Returns each prompt's length in tokens as the model's tokenizer (vLLM's) counts it
    (a chat prompt's rendering, rlray.chat.render_prompt: what vLLM is given).

    Counted in a child process: importing transformers imports torch, ~300 MB that the
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

    The child takes ~7 s (most of it importing transformers), so the readings of a local
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
            _write_atomically(
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


def _write_atomically(target: Path, text: str) -> None:
    """Writes `text` to `target` through a temporary file, so that a reader never sees
    half of it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=target.parent, delete=False) as out:
        out.write(text)
    os.replace(out.name, target)


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
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"model.path: cannot load a tokenizer from {path}: {first_line}"
        ) from None
