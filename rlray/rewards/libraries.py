"""Rewards that task libraries and verifiers compute themselves: called, not rewritten.

    reasoning_gym   [0, 1], the task's own score_answer of the answer in <answer></answer>
    math_verify     1.0 when math-verify finds the completion's final answer equal to the
                    reference, else 0.0

Both read the answer as their library does: reasoning-gym's evaluation takes the last
<answer>...</answer> of a completion (reasoning_gym.utils.extract_answer); math-verify
parses a completion's \\boxed{} answer first, else its last expression or number.
They run in the reward child process (rlray.rewards.process): library code, and
math-verify's time limits need a process's main thread (signal.alarm).
"""

from __future__ import annotations

import functools
import json
from typing import Any

from rlray.data.chat import accepts_chat
from rlray.data.task_libraries import reasoning_gym_dataset

# The dataset a reward scores with: only its score_answer is used, never its items.
_SCORING_SEED = 0


@accepts_chat
def reasoning_gym(
    prompts: list[str],
    completions: list[str],
    answer: list[Any],
    metadata: list[Any],
    question: list[str] | None = None,
    task: list[str] | None = None,
    task_config: list[str] | None = None,
    *,
    answer_tag: str = "answer",
    **_: Any,
) -> list[float | None]:
    """Returns each completion's score by its reasoning-gym task's own score_answer
    (in [0, 1]; 0 without an answer tag), on the entry its row carries: answer, metadata
    (JSON text or an object), question. The task is the row's `task` column, else its
    metadata's source_dataset (reasoning-gym's own exports); None where neither names
    one."""
    from reasoning_gym.utils import extract_answer  # loads only where the reward is used

    scores: list[float | None] = []
    for i, completion in enumerate(completions):
        entry_metadata = metadata[i] if isinstance(metadata[i], dict) else json.loads(metadata[i])
        name = (task[i] if task else None) or entry_metadata.get("source_dataset")
        if not name:
            scores.append(None)
            continue
        config = task_config[i] if task_config and task_config[i] else "{}"
        entry = {"answer": answer[i], "metadata": entry_metadata}
        if question:
            entry["question"] = question[i]
        dataset = reasoning_gym_dataset(name, config, _SCORING_SEED)
        scores.append(float(dataset.score_answer(extract_answer(completion, answer_tag), entry)))
    return scores


@accepts_chat
def math_verify(
    prompts: list[str],
    completions: list[str],
    answer: list[Any],
    *,
    timeout_s: int = 5,
    **_: Any,
) -> list[float | None]:
    """Returns 1.0 where math-verify finds the completion's final answer (its \\boxed{}
    answer, else its last expression or number) equal to the `answer` column, else 0.0;
    None where the answer is None or math-verify reads nothing in it. A GSM8K answer (a
    solution ending in "#### N") is read as N."""
    from math_verify import parse, verify  # loads only where the reward is used

    scores: list[float | None] = []
    for completion, reference in zip(completions, answer, strict=True):
        gold = _reference(reference)
        if gold is None:
            scores.append(None)
            continue
        found = parse(completion, _completion_targets(), parsing_timeout=timeout_s)
        scores.append(float(verify(gold, found, timeout_seconds=timeout_s)))
    return scores


def _reference(answer: Any) -> list | None:
    """Returns math-verify's parse of a reference answer (after a GSM8K "####"; bare
    LaTeX such as a MATH answer's "\\frac{1}{2}" read between $ signs), or None where it
    reads nothing (as TRL's accuracy reward skips such rows)."""
    from math_verify import parse  # as in math_verify

    if answer is None:
        return None
    text = str(answer)
    if "####" in text:
        text = text.rpartition("####")[2].strip().replace(",", "")
    gold = parse(text, extraction_mode="first_match")
    if not gold and "\\" in text:
        gold = parse(f"${text}$")
    return gold or None


@functools.cache
def _completion_targets() -> tuple:
    """What math-verify looks for in a completion: \\boxed{} first, then the last LaTeX
    or plain expression (its rightmost match wins at equal priority)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig  # as in math_verify

    return (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())
