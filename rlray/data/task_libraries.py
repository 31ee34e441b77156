"""Prompts from task libraries and question datasets: reasoning-gym's procedural tasks,
and JSONL rows that give a "question" (GSM8K's format) instead of a prompt.

A question becomes a chat prompt through data.question_template: chat messages in which
"{question}" stands for it (a system prompt, worked examples, the question). The row keeps
what the library's scorer needs as columns: a reasoning-gym row carries its entry
(question, answer, metadata) and the task's name and config, so that the built-in
`reasoning_gym` reward scores it with that task's own score_answer
(rlray.rewards.libraries).

reasoning-gym makes item i of a dataset seeded s from Random(s + i), so two seeds one
apart give the same items shifted by one: each run seed gets a block of 2**24 dataset
seeds of its own, and the held-out split the last block, whatever the run seed. Held-out
questions are told apart by their text, and the training stream never draws one of them.
"""

from __future__ import annotations

import difflib
import functools
import json
from typing import Any

from rlray.config import ConfigError, DataConfig
from rlray.core.prompt import Message, PromptRow
from rlray.data.chat import message_list_problem

REASONING_GYM = "reasoning_gym:"
"""data.train / data.eval prefix of a reasoning-gym task: reasoning_gym:<dataset name>."""
QUESTION = "{question}"
SEED_BLOCK = 2**24
EVAL_SEED = 2**32 - SEED_BLOCK
"""The held-out split's dataset seed: the last block, which no run seed below 255 reaches."""
DATASET_SIZE = SEED_BLOCK
"""The size a dataset is made with: it generates any index below it on demand."""
DRAWS_PER_ROW = 1000
"""A training row redraws at most this often past held-out questions."""


def question_prompt(template: list[Message], question: str) -> list[Message]:
    """Returns the chat messages of `question` in the template ({question} replaced);
    raises ConfigError naming data.question_template if they are not a chat prompt."""
    if not any(QUESTION in str(m.get("content", "")) for m in template if isinstance(m, dict)):
        raise ConfigError(f"data.question_template: no message holds {QUESTION}")
    messages = [
        {key: value.replace(QUESTION, question) for key, value in m.items()}
        if isinstance(m, dict) and all(isinstance(v, str) for v in m.values())
        else m
        for m in template
    ]
    if problem := message_list_problem(messages):
        raise ConfigError(f"data.question_template: {problem}")
    return messages


def question_row(record: dict[str, Any], template: list[Message]) -> PromptRow:
    """Returns the prompt row of a dataset record that gives a question (GSM8K's
    format: question, answer ending in "#### N"): its question in the template, every
    field of it (question included) a column."""
    question = record["question"]
    if not isinstance(question, str) or not question:
        raise ConfigError("'question' must be a non-empty string")
    return PromptRow(prompt=question_prompt(template, question), columns=dict(record))


@functools.cache
def reasoning_gym_dataset(name: str, config_json: str, seed: int) -> Any:  # ProceduralDataset
    """Returns reasoning-gym's dataset `name` made with its config (JSON) and `seed`;
    raises ConfigError naming data.train or data.task_config."""
    # reasoning-gym (sympy and a dozen puzzle libraries) loads only where a task is used
    import reasoning_gym
    from reasoning_gym.factory import DATASETS  # as reasoning_gym

    if name not in DATASETS:
        guess = difflib.get_close_matches(name, list(DATASETS), n=1)
        hint = f" (did you mean {guess[0]!r}?)" if guess else ""
        raise ConfigError(
            f"data: unknown reasoning-gym task {name!r}{hint}; reasoning-gym "
            f"{reasoning_gym_version()} has {len(DATASETS)}, e.g. {', '.join(sorted(DATASETS)[:5])}"
        )
    settings = {**json.loads(config_json), "seed": seed, "size": DATASET_SIZE}
    try:
        return reasoning_gym.create_dataset(name, **settings)
    except (TypeError, ValueError, AssertionError) as err:
        text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"data.task_config: not a config of reasoning-gym's {name}: {text}"
        ) from None


def reasoning_gym_version() -> str:
    import importlib.metadata  # only named in an error message

    return importlib.metadata.version("reasoning-gym")


class ReasoningGymTask:
    """One reasoning-gym task as prompts: its name, its config, the question template."""

    def __init__(self, name: str, config: dict[str, Any], template: list[Message]):
        self.name = name
        self.config_json = json.dumps(config, sort_keys=True)
        self.template = template

    def entry(self, seed: int, index: int) -> dict[str, Any]:
        """Returns item `index` of the task's dataset seeded `seed`."""
        return reasoning_gym_dataset(self.name, self.config_json, seed)[index % DATASET_SIZE]

    def row(self, entry: dict[str, Any]) -> PromptRow:
        """Returns an entry's prompt and the columns its score needs."""
        columns = {
            "question": entry["question"],
            "answer": entry["answer"],
            # Its metadata as JSON, as reasoning-gym's own dataset exports keep it.
            "metadata": json.dumps(entry.get("metadata", {}), sort_keys=True, default=str),
            "task": self.name,
            "task_config": self.config_json,
        }
        return PromptRow(question_prompt(self.template, entry["question"]), columns)

    def held_out_entries(self, count: int) -> list[dict[str, Any]]:
        """Returns the held-out split: the first `count` distinct questions of the dataset
        seeded EVAL_SEED (fewer if the task has fewer among 20 x count items)."""
        entries: dict[str, dict[str, Any]] = {}
        for index in range(20 * count):
            entry = self.entry(EVAL_SEED, index)
            entries.setdefault(entry["question"], entry)
            if len(entries) == count:
                break
        return list(entries.values())


class ReasoningGymPrompts:
    """A reasoning-gym task's endless training stream, seeded by the run: row(i) is the
    same in every run of one seed, and never a held-out question."""

    def __init__(self, task: ReasoningGymTask, seed: int, held_out: int):
        self.task = task
        self.seed = (seed % (EVAL_SEED // SEED_BLOCK)) * SEED_BLOCK
        self.held_out = {e["question"] for e in task.held_out_entries(held_out)}

    def row(self, index: int) -> PromptRow:
        for draw in range(DRAWS_PER_ROW):
            entry = self.task.entry(self.seed, index + draw * (SEED_BLOCK // DRAWS_PER_ROW))
            if entry["question"] not in self.held_out:
                return self.task.row(entry)
        raise ConfigError(
            f"data.eval_size: the held-out split ({len(self.held_out)} questions) leaves "
            f"reasoning-gym's {self.task.name} no training question in {DRAWS_PER_ROW} draws"
        )

    def longest_prompts(self) -> list[PromptRow]:
        """Returns the longest of the first 500 training prompts: a procedural task's
        prompts cannot all be read (the context-window check reads these)."""
        rows = [self.row(i) for i in range(500)]
        rows.sort(key=lambda r: len(r.columns["question"]), reverse=True)
        return rows[:20]


def reasoning_gym_task(data: DataConfig, name: str) -> ReasoningGymTask | None:
    """Returns the reasoning-gym task `name` names (data.train's or data.eval's), or None
    if it names none."""
    if not name.startswith(REASONING_GYM):
        return None
    return ReasoningGymTask(name[len(REASONING_GYM) :], data.task_config, data.question_template)
