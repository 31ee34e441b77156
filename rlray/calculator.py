"""The built-in multi-turn task: two-digit multiplication with a calculator tool.

The embedded model's size cannot multiply two-digit numbers, but it can copy. A policy
turn that is a parenthesised expression, `(12*34)`, calls the calculator; the
environment answers with the result and `=` (`408=`), and the model's next turn is its
answer. A turn without a call is the final answer, and it earns reward 1 if it is the
product. (The embedded tokenizer has only digits, `+-*=()` and space, so the tool-call
format is built from those; models with a chat template use
rlray.environments.ToolEnvironment's <tool_call> blocks.)

The tiny calculator model is the embedded architecture warm-started on this format
(cached like the embedded model): it answers directly most of the time, mostly wrong,
and calls the calculator on one sample in ten, so RL has something to find.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlray.data import PromptRow
from rlray.environments import StepResult
from rlray.episode import Span

TOOL_CALL = re.compile(r"^\(([0-9]{1,3})([*+\-])([0-9]{1,3})\)$")
"""A calculator call: one operation on two numbers of at most three digits."""

CALCULATOR_RECIPE = {
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
}
# Fixed so that the held-out pairs do not move with the run seed.
_EVAL_SPLIT_SEED = 20261123


def multiplication_row(a: int, b: int) -> PromptRow:
    """Returns the prompt 'a*b=' with its answer column."""
    return PromptRow(prompt=f"{a}*{b}=", columns={"answer": str(a * b)})


def held_out_pairs(count: int) -> list[tuple[int, int]]:
    """Returns `count` distinct two-digit operand pairs kept out of training."""
    rng = random.Random(_EVAL_SPLIT_SEED)
    pairs: dict[tuple[int, int], None] = {}
    while len(pairs) < min(count, 90 * 90 // 2):
        pairs[(rng.randrange(10, 100), rng.randrange(10, 100))] = None
    return list(pairs)


class MultiplicationPrompts:
    """Endless a*b prompts with two-digit a and b, never a held-out pair."""

    def __init__(self, seed: int, held_out: int):
        self.seed = seed
        self.held_out = set(held_out_pairs(held_out))

    def row(self, index: int) -> PromptRow:
        rng = random.Random(f"{self.seed}:{index}")
        while True:
            pair = (rng.randrange(10, 100), rng.randrange(10, 100))
            if pair not in self.held_out:
                return multiplication_row(*pair)

    def longest_prompts(self) -> list[PromptRow]:
        return [multiplication_row(99, 99)]


def calculate(call: str) -> int | None:
    """Returns the value of a calculator call such as '(12*34)', or None if the text is
    not one."""
    match = TOOL_CALL.match(call.strip())
    if match is None:
        return None
    a, operation, b = int(match[1]), match[2], int(match[3])
    return {"*": a * b, "+": a + b, "-": a - b}[operation]


@dataclass
class CalculatorEnvironment:
    """One trajectory of the task: calculator calls answered, the final answer scored."""

    answer: str = ""
    spans: list[Span] = field(default_factory=list)

    def reset(self, row: PromptRow) -> str:
        self.answer = str(row.columns["answer"])
        return ""

    def step(self, action: str) -> StepResult:
        text = action.strip()
        if text.startswith("("):
            return self._call(text)
        return StepResult("", float(text == self.answer), True)

    def _call(self, text: str) -> StepResult:
        started = time.time()
        value = calculate(text)
        error = None if value is not None else f"not a calculator call: {text!r}"
        self.spans.append(
            Span(
                "tool_call",
                started,
                time.time(),
                name="calculator",
                arguments=json.dumps({"expression": text}),
                result=None if value is None else str(value),
                error=error,
            )
        )
        # A malformed call gets '=' alone: the model answers without a result. A call
        # earns 0, so that an episode cut off by the turn limit has a reward too.
        return StepResult(f"{'' if value is None else value}=", 0.0, False)

    def take_spans(self) -> list[Span]:
        """Returns the spans recorded since the last call (the rollout collects them)."""
        spans, self.spans = self.spans, []
        return spans


# ------------------------------------------------------------------ the warm-started model


def tiny_calculator_model() -> Path:
    """Returns the directory of the tiny calculator model, building it on first use
    (as rlray.models.tiny_arithmetic_model builds the embedded one)."""
    from rlray.models import _file_lock, cache_dir

    recipe_json = json.dumps(CALCULATOR_RECIPE, sort_keys=True).encode()
    key = hashlib.sha256(recipe_json).hexdigest()[:12]
    target = cache_dir() / "models" / f"tiny-calculator-{key}"
    if (target / "config.json").is_file():
        return target
    with _file_lock(cache_dir() / "models" / f".tiny-calculator-{key}.lock"):
        if not (target / "config.json").is_file():
            print(f"building the tiny calculator model in {target} (first use only)", flush=True)
            staging = Path(tempfile.mkdtemp(prefix="tiny-", dir=target.parent))
            _build(staging)
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)
    return target


def _build(out: Path) -> None:
    from rlray.models import _char_qwen2, _save, _single_seed

    recipe = CALCULATOR_RECIPE
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


def demonstration(a: int, b: int, use_tool: bool) -> list[tuple[str, bool]]:
    """Returns a worked trajectory of a*b as (text, trained) pieces after the prompt:
    the model's turns are trained on, the calculator's answer is not."""
    if use_tool:
        return [
            (f"({a}*{b})", True),
            ("<eos>", True),
            (f"{a * b}=", False),
            (str(a * b), True),
            ("<eos>", True),
        ]
    return [(str(a * b), True), ("<eos>", True)]


def _warm_start(model, tokenizer) -> None:
    """Supervised steps on demonstrations (training pairs only), loss on the model's
    turns: a share `tool_share` of them use the calculator."""
    import torch

    recipe = CALCULATOR_RECIPE
    prompts = MultiplicationPrompts(seed=recipe["seed"], held_out=200)
    rng = random.Random(recipe["seed"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe["warm_start_lr"], weight_decay=0.0)
    model.train()
    for _ in range(recipe["warm_start_steps"]):
        sequences = []
        for _ in range(recipe["warm_start_batch"]):
            row = prompts.row(rng.randrange(1 << 30))
            a, b = (int(x) for x in row.prompt.rstrip("=").split("*"))
            pieces = [
                (row.prompt, False),
                *demonstration(a, b, rng.random() < recipe["tool_share"]),
            ]
            sequences.append(_encode(tokenizer, pieces))
        loss = _sequence_loss(model, tokenizer, sequences)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def _encode(tokenizer, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[bool]]:
    ids, trained = [], []
    for text, train in pieces:
        piece = [tokenizer.eos_token_id] if text == "<eos>" else tokenizer(text).input_ids
        ids += piece
        trained += [train] * len(piece)
    return ids, trained


def _sequence_loss(model, tokenizer, sequences: list[tuple[list[int], list[bool]]]):
    import torch

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
    return model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
