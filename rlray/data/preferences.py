"""Preference data: pairs of completions of one prompt, one chosen over the other.

A pair file is JSONL, one pair per line, as TRL's preference datasets: `prompt` (a
string, or chat messages) with `chosen` and `rejected` (strings, or for a chat prompt
the assistant's reply as messages); other fields are kept as columns. Pairs also come
from rlray's own episode store: two episodes of the same prompt whose rewards differ
by at least a margin are a pair, the better one chosen (`pairs_from_episodes`, and
`jobs/pairs.py` from the command line), so an RL run's episodes become preference data.
The built-in pairs (`arithmetic_pair`) choose the correct sum over a wrong one.
`preference_batches` gives jobs/dpo.py its training batches and held-out pairs.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlray.config import BUILTIN_DATA, Config, ConfigError
from rlray.core.episode import Episode
from rlray.core.prompt import Message, Prompt, PromptRow
from rlray.data.chat import MESSAGES_COLUMN
from rlray.data.prompts import eval_rows, read_jsonl
from rlray.data.tasks import TaskPrompts, addition

Completion = str | list[Message]


@dataclass
class PreferencePair:
    """A prompt, the completion preferred for it and the one rejected."""

    prompt: Prompt
    chosen: Completion
    rejected: Completion
    columns: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "chosen": self.chosen,
            "rejected": self.rejected,
            **self.columns,
        }


def read_pairs(path: str, field_name: str = "data.train") -> list[PreferencePair]:
    """Returns the pairs of a JSONL file, or raises ConfigError naming the file, the
    line and what is wrong with it."""
    rows = read_jsonl(path, field_name, require=("prompt", "chosen", "rejected"))
    pairs = []
    for number, row in enumerate(rows, start=1):
        columns = dict(row.columns)
        chosen, rejected = columns.pop("chosen"), columns.pop("rejected")
        chat = not isinstance(row.prompt, str)
        for name, value in (("chosen", chosen), ("rejected", rejected)):
            if problem := completion_problem(value, chat):
                raise ConfigError(f"{path}: pair {number}: '{name}' {problem}")
        if chosen == rejected:
            raise ConfigError(f"{path}: pair {number}: 'chosen' and 'rejected' are the same")
        pairs.append(PreferencePair(row.prompt, chosen, rejected, columns))
    return pairs


def completion_problem(value: Any, chat: bool) -> str | None:
    """Returns what is wrong with a pair's completion, or None: a non-empty string, or
    for a chat prompt also a list of assistant messages."""
    if isinstance(value, str):
        return None if value else "is empty"
    if not chat:
        return f"must be a string for a text prompt, got {type(value).__name__}"
    if not isinstance(value, list) or not value:
        return "must be a string or a non-empty list of assistant messages"
    for i, message in enumerate(value):
        if not isinstance(message, dict) or message.get("role") != "assistant":
            return f"message {i} is not an assistant message"
        if set(message) != {"role", "content"} or not isinstance(message["content"], str):
            return f"message {i} must be exactly {{role, content}} with string content"
    return None


@dataclass
class PairCounts:
    """What `pairs_from_episodes` made of a store's episodes."""

    prompts: int = 0
    pairs: int = 0
    without_reward: int = 0
    multi_turn: int = 0
    empty: int = 0
    """Episodes with an empty completion (the model stopped at once): a pair file's
    completion must not be empty (read_pairs)."""
    prompts_without_pair: int = 0


def pairs_from_episodes(
    episodes: list[Episode], margin: float, per_prompt: int = 1
) -> tuple[list[PreferencePair], PairCounts]:
    """Returns preference pairs made from episodes, and their counts. Episodes are
    grouped by prompt (text and chat messages); in each group, distinct completions are
    ranked by reward, and the best is chosen over each of the up to `per_prompt` worst
    whose reward is at least `margin` lower (worst first). Episodes without a reward,
    multi-turn ones (their completions hold tool output) and empty ones are left out
    and counted."""
    if margin <= 0:
        raise ValueError(f"margin must be > 0, got {margin}")
    counts = PairCounts()
    by_prompt: dict[str, dict[str, Episode]] = defaultdict(dict)
    for episode in episodes:
        if episode.reward is None:
            counts.without_reward += 1
        elif 0 in episode.completion_mask:
            counts.multi_turn += 1
        elif not episode.completion:
            counts.empty += 1
        else:
            completions = by_prompt[_prompt_key(episode)]
            best = completions.get(episode.completion)
            # A completion sampled twice is ranked once, by its best reward.
            if best is None or episode.reward > best.reward:
                completions[episode.completion] = episode
    pairs = []
    for completions in by_prompt.values():
        ranked = sorted(completions.values(), key=lambda e: (-e.reward, e.episode_id))
        top = ranked[0]
        worse = [e for e in reversed(ranked) if top.reward - e.reward >= margin][:per_prompt]
        counts.prompts += 1
        counts.prompts_without_pair += not worse
        pairs.extend(_pair(top, other) for other in worse)
    counts.pairs = len(pairs)
    return pairs, counts


def _prompt_key(episode: Episode) -> str:
    return json.dumps([episode.prompt, episode.columns.get(MESSAGES_COLUMN)])


def _pair(chosen: Episode, rejected: Episode) -> PreferencePair:
    messages = chosen.columns.get(MESSAGES_COLUMN)
    prompt: Prompt = messages if messages else chosen.prompt

    def completion(episode: Episode) -> Completion:
        text = episode.completion
        return [{"role": "assistant", "content": text}] if messages else text

    columns = {
        "chosen_reward": chosen.reward,
        "rejected_reward": rejected.reward,
        "chosen_episode": chosen.episode_id,
        "rejected_episode": rejected.episode_id,
    }
    return PreferencePair(prompt, completion(chosen), completion(rejected), columns)


def arithmetic_pair(row: PromptRow, index: int, digits: int) -> PreferencePair:
    """Returns the built-in pair of an arithmetic prompt of `digits`-digit numbers: the
    correct sum chosen over a wrong one, seeded by `index`. Even indices miss narrowly
    (off by 1 or 10 either way, as a dropped or extra carry does; never negative), odd
    ones by any amount (another sum two such numbers can have). Near misses alone teach
    a reward model nothing to start from: no single feature of the text tells a sum
    from its near miss, and a fresh score head stayed at chance (0.48 held-out after
    2,500 steps of 64 pairs); the far misses teach it the size of the sum first."""
    answer = int(row.columns["answer"])
    rng = random.Random(f"arithmetic-pair:{index}")
    if index % 2 == 0:
        misses = [answer + d for d in (1, -1, 10, -10) if answer + d >= 0]
        wrong = rng.choice(misses)
    else:
        largest_sum = 2 * (10**digits - 1)
        wrong = rng.choice([s for s in range(largest_sum + 1) if s != answer])
    return PreferencePair(row.prompt, str(answer), str(wrong), {"answer": str(answer)})


def preference_batches(
    config: Config,
) -> tuple[Callable[[int], list[PreferencePair]], list[PreferencePair]]:
    """Returns the training batch of each step (1, 2, ...) and the held-out pairs."""
    size, held = config.preference.pairs_per_step, config.preference.eval_pairs
    data = config.data
    if data.train == BUILTIN_DATA:
        prompts = TaskPrompts(addition(data.arithmetic_digits), config.seed, data.eval_size)
        digits = data.arithmetic_digits
        held_rows = eval_rows(data)[:held]
        held_out = [arithmetic_pair(r, i, digits) for i, r in enumerate(held_rows)]

        def builtin_batch(step: int) -> list[PreferencePair]:
            first = (step - 1) * size
            rows = (prompts.row(i) for i in range(first, first + size))
            return [arithmetic_pair(row, first + i, digits) for i, row in enumerate(rows)]

        return builtin_batch, held_out
    if data.train.startswith("builtin:"):
        raise ConfigError(f"data.train: the built-in preference pairs are {BUILTIN_DATA}")
    pairs = read_pairs(data.train)
    random.Random(config.seed).shuffle(pairs)
    held_out, train = pairs[:held], pairs[held:]
    if not train:
        raise ConfigError(
            f"data.train: {len(pairs)} pairs leave none to train on after "
            f"preference.eval_pairs {held}"
        )

    def file_batch(step: int) -> list[PreferencePair]:
        # Consecutive slices of the pairs, reshuffled (seeded) every pass.
        first = (step - 1) * size
        batch = []
        for index in range(first, first + size):
            epoch, position = divmod(index, len(train))
            order = list(range(len(train)))
            random.Random(f"{config.seed}:{epoch}").shuffle(order)
            batch.append(train[order[position]])
        return batch

    return file_batch, held_out
