"""The embedded tiny models: a Qwen2 with a character tokenizer, built offline and
warm-started on a built-in task on first use, then cached.

builtin:tiny-arithmetic is 0.53M parameters (hidden 128, 2 layers, 2 heads of head_dim
64, which vLLM's CPU attention supports), warm-started briefly on addition by supervised
learning so that RL starts from a model that is right sometimes but far from always.
builtin:tiny-calculator is the same architecture warm-started on the calculator task's
demonstrations (rlray.data.calculator); builtin:tiny-countdown the same with a context
window of 320 positions, warm-started on countdowns (builtin:countdown). Each is cached
under a key of everything that shapes it (its recipe), so only the first run pays.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlray.core.prompt import PromptRow
from rlray.core.waiting import Durations, timed_wait
from rlray.data.cache import cache_dir, file_lock
from rlray.data.calculator import demonstration
from rlray.data.tasks import COUNTDOWN, MULTIPLICATION, TaskPrompts, addition

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

Pieces = list[tuple[str, bool]]
"""A demonstration after its prompt: (text, trained on) pieces; "<eos>" is the token."""

BUILD_GUESS_S = 120.0
"""The countdown's estimate of a build on a machine that has built none (after one, it
counts down from the last build's duration)."""


@dataclass(frozen=True)
class TinyModel:
    """A built-in model: its recipe (the cache key) and the demonstrations it is
    warm-started on."""

    name: str
    recipe: dict[str, Any]
    prompts: Callable[[], TaskPrompts]
    demonstrate: Callable[[PromptRow, random.Random], Pieces]


def _answer(row: PromptRow, rng: random.Random) -> Pieces:
    return [(str(row.columns["answer"]), True), ("<eos>", True)]


def _calculator_turns(row: PromptRow, rng: random.Random) -> Pieces:
    a, b = (int(x) for x in row.prompt.rstrip("=").split("*"))
    return demonstration(a, b, rng.random() < CALCULATOR.recipe["tool_share"])


ARITHMETIC = TinyModel(
    "tiny-arithmetic",
    {
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
        # The tokenizer's chat template is part of the model directory; it changes no
        # weight (the warm start reads plain text): model.safetensors is byte-identical
        # with and without it.
        "chat_template": 2,
    },
    lambda: TaskPrompts(addition(2), seed=0, held_out=200),
    _answer,
)
CALCULATOR = TinyModel(
    "tiny-calculator",
    {
        "recipe": 2,  # 2: the character tokenizer's chat template
        "hidden_size": 128,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "max_position_embeddings": 64,
        "tool_share": 0.1,
        "warm_start_steps": 300,
        "warm_start_batch": 128,
        "warm_start_lr": 1e-3,
        "seed": 0,
    },
    lambda: TaskPrompts(MULTIPLICATION, seed=0, held_out=200),
    _calculator_turns,
)
COUNTDOWN_MODEL = TinyModel(
    "tiny-countdown",
    {
        "recipe": 1,
        "hidden_size": 128,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "max_position_embeddings": 320,  # "99-1=", 99 numbers and end-of-sequence
        "warm_start_steps": 300,
        "warm_start_batch": 64,
        # Countdowns range from a few tokens to 300: a batch padded to its longest is
        # mostly padding, so the warm start trains on chunks of like lengths.
        "warm_start_chunk_tokens": 1024,
        "warm_start_lr": 1e-3,
        "seed": 0,
        "chat_template": 2,
    },
    lambda: TaskPrompts(COUNTDOWN, seed=0, held_out=200),
    _answer,
)


def tiny_model(model: TinyModel) -> Path:
    """Returns the directory of a built-in model, building it on first use.

    Several processes (actors on one node) may ask at once: one builds under a file
    lock, the others wait and reuse it. The build is seeded, but float arithmetic differs
    between CPU kinds and thread counts: a node of another kind builds a different copy
    (a machine with another CPU or thread count builds a copy with other logprobs).
    That is harmless in a run, since rollout workers load the learner's weights before
    they generate.
    """
    key = hashlib.sha256(json.dumps(model.recipe, sort_keys=True).encode()).hexdigest()[:12]
    target = cache_dir() / "models" / f"{model.name}-{key}"
    if (target / "config.json").is_file():
        return target
    with file_lock(cache_dir() / "models" / f".{model.name}-{key}.lock"):
        if not (target / "config.json").is_file():
            print(
                f"building the embedded {model.name} model in {target} (first use only)", flush=True
            )
            staging = Path(tempfile.mkdtemp(prefix="tiny-", dir=target.parent))
            waits = Durations.in_folder(cache_dir())
            with timed_wait(f"building {model.name}", f"build {model.name}", waits, BUILD_GUESS_S):
                _build(model, staging)
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)
    return target


def _build(model: TinyModel, out: Path) -> None:
    recipe = model.recipe
    with _single_seed(recipe["seed"]):
        policy, tokenizer = _char_qwen2(
            recipe["hidden_size"],
            recipe["intermediate_size"],
            recipe["num_hidden_layers"],
            recipe["num_attention_heads"],
            recipe["max_position_embeddings"],
        )
        _warm_start(model, policy, tokenizer)
    _save(policy, tokenizer, out)
    (out / "rlray_recipe.json").write_text(json.dumps(recipe, indent=2))


def _warm_start(model: TinyModel, policy: Any, tokenizer: Any) -> None:
    """Supervised steps on the model's demonstrations of training prompts (held-out
    pairs never), the loss on the pieces they train."""
    import torch  # the driver resolves model paths without importing torch

    recipe = model.recipe
    prompts = model.prompts()
    rng = random.Random(recipe["seed"])
    optimizer = torch.optim.AdamW(policy.parameters(), lr=recipe["warm_start_lr"], weight_decay=0.0)
    policy.train()
    for _ in range(recipe["warm_start_steps"]):
        sequences = []
        for _ in range(recipe["warm_start_batch"]):
            row = prompts.row(rng.randrange(1 << 30))
            pieces = [(str(row.prompt), False), *model.demonstrate(row, rng)]
            sequences.append(_encode(tokenizer, pieces))
        optimizer.zero_grad()
        trained = sum(sum(mask[1:]) for _, mask in sequences)
        for chunk in _like_lengths(sequences, recipe.get("warm_start_chunk_tokens", 0)):
            (_summed_loss(policy, tokenizer, chunk) / trained).backward()
        optimizer.step()
    policy.eval()


def _like_lengths(sequences: list[Any], budget: int) -> list[list[Any]]:
    """Returns the sequences sorted by length in chunks of at most `budget` padded
    tokens (a longer sequence alone); all of them as one chunk, in their order, if
    `budget` is 0."""
    if budget == 0:
        return [sequences]
    chunks: list[list[Any]] = []
    for sequence in sorted(sequences, key=lambda s: len(s[0])):
        if chunks and len(sequence[0]) * (len(chunks[-1]) + 1) <= budget:
            chunks[-1].append(sequence)
        else:
            chunks.append([sequence])
    return chunks


def _encode(tokenizer: Any, pieces: Pieces) -> tuple[list[int], list[bool]]:
    ids, trained = [], []
    for text, train in pieces:
        piece = [tokenizer.eos_token_id] if text == "<eos>" else tokenizer(text).input_ids
        ids += piece
        trained += [train] * len(piece)
    return ids, trained


def _summed_loss(policy: Any, tokenizer: Any, sequences: list[tuple[list[int], list[bool]]]):
    """Returns the summed cross-entropy of each sequence's trained tokens, each
    predicted from the tokens before it."""
    import torch  # as in _warm_start

    width = max(len(ids) for ids, _ in sequences)
    input_ids = torch.full((len(sequences), width), tokenizer.pad_token_id)
    labels = torch.full((len(sequences), width), -100)
    attention = torch.zeros(len(sequences), width, dtype=torch.long)
    for i, (ids, trained) in enumerate(sequences):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(ids)] = torch.tensor(
            [t if keep else -100 for t, keep in zip(ids, trained, strict=True)]
        )
        attention[i, : len(ids)] = 1
    logits = policy(input_ids=input_ids, attention_mask=attention).logits  # (B, T, V)
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum"
    )


def build_char_tokenizer() -> Any:  # a PreTrainedTokenizerFast
    """Returns a character-level fast tokenizer (one token per character, specials
    first) with a minimal chat template (CHAR_CHAT_TEMPLATE)."""
    # as torch in _warm_start
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast  # as torch in _warm_start

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    tokenizer.chat_template = CHAR_CHAT_TEMPLATE
    return tokenizer


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
    from transformers import Qwen2Config, Qwen2ForCausalLM  # as torch in _warm_start

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


def _save(model: Any, tokenizer: Any, out: Path) -> None:
    from transformers.utils import logging as hf_logging  # as torch in _warm_start

    hf_logging.disable_progress_bar()  # save_pretrained's bar is noise on every run
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


@contextlib.contextmanager
def _single_seed(seed: int) -> Iterator[None]:
    import torch  # as in _warm_start

    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.random.set_rng_state(state)
