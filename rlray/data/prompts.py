"""Prompt sources: the built-in tasks (rlray.data.tasks), reasoning-gym's tasks and JSONL
files (rlray.data.task_libraries: questions put in data.question_template).

A prompt source is an endless, seeded stream: `row(i)` is the i-th training prompt of
the run, so a saved cursor (an index) is all a resumed run needs to continue the same
stream.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Protocol

from rlray.config import (
    BUILTIN_COUNTDOWN,
    BUILTIN_DATA,
    BUILTIN_MULTIPLICATION,
    BUILTIN_PYTHON_FUNCTIONS,
    ConfigError,
    DataConfig,
)
from rlray.core.prompt import Message, PromptRow
from rlray.data.chat import MESSAGES_COLUMN, message_list_problem, prompt_preview
from rlray.data.code_tasks import PythonFunctionsTask
from rlray.data.task_libraries import ReasoningGymPrompts, question_row, reasoning_gym_task
from rlray.data.tasks import COUNTDOWN, MULTIPLICATION, OperandTask, TaskPrompts, addition


class PromptSource(Protocol):
    def row(self, index: int) -> PromptRow:
        """Returns the index-th prompt of the stream."""
        ...

    def longest_prompts(self) -> list[PromptRow]:
        """Returns the prompts with the most characters (for the context-window check)."""
        ...


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
    path: str,
    field_name: str,
    require: tuple[str, ...] = ("prompt",),
    question_template: list[Message] | None = None,
) -> list[PromptRow]:
    """Returns the rows of a JSONL prompt file, or raises ConfigError naming the file and line.

    With a question_template, a row may give a "question" instead of the prompt (GSM8K's
    format): its prompt is the question in the template, and every field a column."""
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
            if question_template is not None and "prompt" not in record and "question" in record:
                try:
                    rows.append(question_row(record, question_template))
                except ConfigError as err:
                    raise ConfigError(f"{path}:{number}: {err}") from None
                continue
            for key in require:
                if key not in record:
                    either = " (or 'question')" if key == "prompt" and question_template else ""
                    raise ConfigError(f"{path}:{number}: missing field '{key}'{either}")
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


def builtin_task(data: DataConfig, name: str, field_name: str) -> OperandTask | None:
    """Returns the built-in task `name` (data.train's or data.eval's), None for a file;
    raises ConfigError naming the field for an unknown built-in."""
    tasks = {
        BUILTIN_DATA: addition(data.arithmetic_digits),
        BUILTIN_MULTIPLICATION: MULTIPLICATION,
        BUILTIN_COUNTDOWN: COUNTDOWN,
    }
    if name in tasks:
        return tasks[name]
    if name.startswith("builtin:"):
        known = ", ".join([*tasks, BUILTIN_PYTHON_FUNCTIONS])
        raise ConfigError(f"{field_name}: unknown built-in {name!r}; known: {known}")
    return None


def train_prompts(data: DataConfig, seed: int) -> PromptSource:
    """Returns the training prompt stream named by the config."""
    if data.train == BUILTIN_PYTHON_FUNCTIONS:
        rows = PythonFunctionsTask(data.question_template).training_rows(data.eval_size)
        return FilePrompts(rows, seed, data.shuffle)
    if task := builtin_task(data, data.train, "data.train"):
        return TaskPrompts(task, seed, held_out=data.eval_size)
    if library_task := reasoning_gym_task(data, data.train):
        return ReasoningGymPrompts(library_task, seed, held_out=data.eval_size)
    rows = read_jsonl(data.train, "data.train", question_template=data.question_template)
    return FilePrompts(rows, seed, data.shuffle)


def eval_rows(data: DataConfig) -> list[PromptRow]:
    """Returns the held-out evaluation prompts (the built-ins with an 'answer' column, a
    reasoning-gym task's held-out split with what its scorer needs; a file's rows need
    the columns the eval rewards take)."""
    if data.eval == BUILTIN_PYTHON_FUNCTIONS:
        return PythonFunctionsTask(data.question_template).held_out_rows(data.eval_size)
    if task := builtin_task(data, data.eval, "data.eval"):
        return task.held_out_rows(data.eval_size)
    if library_task := reasoning_gym_task(data, data.eval):
        return [library_task.row(e) for e in library_task.held_out_entries(data.eval_size)]
    rows = read_jsonl(data.eval, "data.eval", question_template=data.question_template)
    return rows[: data.eval_size]


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
