"""Prompt sources: the built-in arithmetic task and JSONL files.

A prompt source is an endless, seeded stream: `row(i)` is the i-th training prompt of
the run, so a saved cursor (an index) is all a resumed run needs to continue the same
stream.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rlray.chat import MESSAGES_COLUMN, Prompt, message_list_problem, prompt_preview
from rlray.config import BUILTIN_DATA, BUILTIN_MULTIPLICATION, ConfigError, DataConfig

# Fixed so that the held-out set does not move when the run seed changes.
_EVAL_SPLIT_SEED = 20261122


@dataclass(frozen=True)
class PromptRow:
    """One prompt and the dataset columns that travel with it (e.g. answer)."""

    prompt: Prompt
    """Text, or chat messages that the rollout worker renders with the model's chat
    template (rlray.chat)."""
    columns: dict[str, Any] = field(default_factory=dict)


class PromptSource(Protocol):
    def row(self, index: int) -> PromptRow:
        """Returns the index-th prompt of the stream."""
        ...

    def longest_prompts(self) -> list[PromptRow]:
        """Returns the prompts with the most characters (for the context-window check)."""
        ...


def arithmetic_row(a: int, b: int) -> PromptRow:
    """Returns the prompt 'a+b=' with its answer column."""
    return PromptRow(prompt=f"{a}+{b}=", columns={"answer": str(a + b)})


def arithmetic_eval_pairs(digits: int, count: int) -> list[tuple[int, int]]:
    """Returns `count` distinct operand pairs held out from training."""
    limit = 10**digits
    count = min(count, limit * limit // 2)
    rng = random.Random(_EVAL_SPLIT_SEED + digits)
    pairs: dict[tuple[int, int], None] = {}
    while len(pairs) < count:
        pairs[(rng.randrange(limit), rng.randrange(limit))] = None
    return list(pairs)


class ArithmeticPrompts:
    """Endless a+b prompts with a, b < 10**digits, never a held-out pair."""

    def __init__(self, digits: int, seed: int, held_out: int):
        self.limit = 10**digits
        self.seed = seed
        self.held_out = set(arithmetic_eval_pairs(digits, held_out))

    def row(self, index: int) -> PromptRow:
        rng = random.Random(f"{self.seed}:{index}")
        while True:
            pair = (rng.randrange(self.limit), rng.randrange(self.limit))
            if pair not in self.held_out:
                return arithmetic_row(*pair)

    def longest_prompts(self) -> list[PromptRow]:
        """Returns the prompts with the most characters (for the context-window check)."""
        top = self.limit - 1
        return [arithmetic_row(top, top)]


class FilePrompts:
    """Rows of a JSONL file, reshuffled every pass with a seeded permutation."""

    def __init__(self, rows: list[PromptRow], seed: int, shuffle: bool):
        self.rows = rows
        self.seed = seed
        self.shuffle = shuffle
        self._order_of_pass: dict[int, list[int]] = {}

    def row(self, index: int) -> PromptRow:
        pass_number, position = divmod(index, len(self.rows))
        if not self.shuffle:
            return self.rows[position]
        order = self._order_of_pass.get(pass_number)
        if order is None:
            order = list(range(len(self.rows)))
            random.Random(f"{self.seed}:{pass_number}").shuffle(order)
            self._order_of_pass = {pass_number: order}
        return self.rows[order[position]]

    def longest_prompts(self) -> list[PromptRow]:
        return self.rows


def read_jsonl(
    path: str, field_name: str, require: tuple[str, ...] = ("prompt",)
) -> list[PromptRow]:
    """Returns the rows of a JSONL prompt file, or raises ConfigError naming the file and line."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{field_name}: file not found: {path}")
    rows = []
    with file.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ConfigError(
                    f"{path}:{number}: not UTF-8 text (byte 0x{raw[err.start]:02x} at "
                    f"column {err.start + 1})"
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(f"{path}:{number}: not valid JSON ({err.msg})") from None
            if not isinstance(record, dict):
                raise ConfigError(f"{path}:{number}: expected a JSON object")
            for key in require:
                if key not in record:
                    raise ConfigError(f"{path}:{number}: missing field '{key}'")
            if problem := _prompt_problem(record):
                raise ConfigError(f"{path}:{number}: 'prompt' {problem}")
            prompt = record.pop("prompt")
            rows.append(PromptRow(prompt=prompt, columns=record))
    if not rows:
        raise ConfigError(f"{field_name}: {path} holds no prompts")
    return rows


def _prompt_problem(record: dict[str, Any]) -> str | None:
    """Returns what is wrong with a record's prompt (text or chat messages), or None."""
    prompt = record["prompt"]
    if isinstance(prompt, str):
        return None if prompt else "is empty"
    if MESSAGES_COLUMN in record:  # the episode keeps the messages there
        return f"is chat messages, so the row may not have a column '{MESSAGES_COLUMN}'"
    return message_list_problem(prompt)


BUILTIN_SOURCES = f"{BUILTIN_DATA}, {BUILTIN_MULTIPLICATION}"


def train_prompts(data: DataConfig, seed: int) -> PromptSource:
    """Returns the training prompt stream named by the config."""
    if data.train == BUILTIN_DATA:
        return ArithmeticPrompts(data.arithmetic_digits, seed, held_out=data.eval_size)
    if data.train == BUILTIN_MULTIPLICATION:
        from rlray.calculator import MultiplicationPrompts

        return MultiplicationPrompts(seed, held_out=data.eval_size)
    if data.train.startswith("builtin:"):
        raise ConfigError(f"data.train: unknown built-in {data.train!r}; known: {BUILTIN_SOURCES}")
    return FilePrompts(read_jsonl(data.train, "data.train"), seed, data.shuffle)


def eval_rows(data: DataConfig) -> list[PromptRow]:
    """Returns the held-out evaluation prompts (the built-ins with an 'answer' column;
    a file's rows need the columns the eval rewards take)."""
    if data.eval == BUILTIN_DATA:
        pairs = arithmetic_eval_pairs(data.arithmetic_digits, data.eval_size)
        return [arithmetic_row(a, b) for a, b in pairs]
    if data.eval == BUILTIN_MULTIPLICATION:
        from rlray.calculator import held_out_pairs, multiplication_row

        return [multiplication_row(a, b) for a, b in held_out_pairs(data.eval_size)]
    if data.eval.startswith("builtin:"):
        raise ConfigError(f"data.eval: unknown built-in {data.eval!r}; known: {BUILTIN_SOURCES}")
    return read_jsonl(data.eval, "data.eval")[: data.eval_size]


def check_prompts_fit(
    rows: list[PromptRow],
    token_counts: list[int],
    max_new_tokens: int,
    max_model_len: int,
    source: str,
) -> None:
    """Raises ConfigError if any prompt is no tokens at all, or it plus max_new_tokens
    exceeds the context window."""
    for row, count in zip(rows, token_counts, strict=True):
        if count == 0:
            raise ConfigError(
                f"{source}: prompt {prompt_preview(row.prompt)} is no tokens to the model's "
                "tokenizer"
            )
        if count + max_new_tokens > max_model_len:
            raise ConfigError(
                f"{source}: prompt {prompt_preview(row.prompt)} is {count} tokens; with "
                f"rollout.max_new_tokens={max_new_tokens} it exceeds "
                f"model.max_model_len={max_model_len}"
            )


def lost_characters_warning(
    rows: list[PromptRow], read_as: list[str | None], source: str
) -> str | None:
    """Returns one line saying how many prompts lose characters to the tokenizer, with an
    example (read_as[i]: what the model reads of rows[i], None if all of it), or None."""
    lossy = [
        (row.prompt, read) for row, read in zip(rows, read_as, strict=True) if read is not None
    ]
    if not lossy:
        return None
    prompt, read = lossy[0]
    return (
        f"{source}: {len(lossy)} of {len(rows)} prompts lose characters to the model's "
        f"tokenizer, e.g. {prompt_preview(prompt)} reads as {prompt_preview(read)}"
    )
