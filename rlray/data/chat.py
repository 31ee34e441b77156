"""Chat-formatted prompts: message lists checked, rendered and handed to rewards.

A prompt is plain text or a list of chat messages (`[{"role": "system", "content": ...},
{"role": "user", "content": ...}]`, TRL's conversational format). Messages are rendered
with the model's chat template, generation prompt added; the rendered prompt's token ids
are what vLLM generates from and what the prompt checks count, so nothing tokenises a
prompt twice in different ways. The episode stores the rendered text as `prompt` and
the messages in its MESSAGES_COLUMN, from where rewards get them in TRL's shape.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from rlray.config import ConfigError
from rlray.core.prompt import Message, Prompt

if TYPE_CHECKING:
    from rlray.core.episode import Episode
    from rlray.core.prompt import PromptRow


R = TypeVar("R")

ROLES = ("system", "user", "assistant", "tool")
MESSAGES_COLUMN = "prompt_messages"
"""The episode column that keeps a chat prompt's messages (the rendered text is its
`prompt`)."""


def message_list_problem(value: Any) -> str | None:
    """Returns what is wrong with `value` as a list of chat messages, or None if it is
    one: a non-empty list of {"role": ..., "content": ...} objects of strings, each role
    one of ROLES, the last not the assistant's."""
    if not isinstance(value, list):
        return f"must be a string or a list of messages, got {type(value).__name__}"
    if not value:
        return "is an empty list of messages"
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            return f"message {i} is a {type(message).__name__}, not an object"
        if set(message) != {"role", "content"}:
            return f"message {i} has keys {sorted(message)}; expected exactly role, content"
        if not all(isinstance(message[key], str) for key in ("role", "content")):
            return f"message {i}: role and content must be strings"
        if message["role"] not in ROLES:
            return f"message {i} has role {message['role']!r}; known: {', '.join(ROLES)}"
    if value[-1]["role"] == "assistant":
        # TRL continues such a reply (continue_final_message); a generation prompt after
        # it would start a new one instead, so it is refused rather than misread.
        return "ends with an assistant message; a prefilled reply is not continued"
    return None


@dataclass(frozen=True)
class RenderedPrompt:
    """A prompt as the model reads it."""

    text: str
    """The prompt text (a chat prompt's rendering by the chat template)."""
    token_ids: list[int]
    """What vLLM generates from."""


def render_prompt(tokenizer: Any, prompt: Prompt, model: str = "the model") -> RenderedPrompt:
    """Returns the prompt rendered and tokenised by the model's tokenizer, or raises
    ConfigError if messages meet a tokenizer without a chat template.

    Text is tokenised as vLLM tokenises a text prompt (special tokens added, e.g. a BOS).
    A rendered chat already holds its special tokens, so none are added to it (as vLLM's
    own chat does): a second BOS would be a prompt the model never saw in training."""
    if isinstance(prompt, str):
        return RenderedPrompt(prompt, list(tokenizer(prompt).input_ids))
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"model.path: {model}'s tokenizer has no chat template, so it cannot read "
            f"prompts given as chat messages (e.g. {prompt_preview(prompt)}); give plain "
            "string prompts or a model with a chat template"
        )
    text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    return RenderedPrompt(text, list(tokenizer(text, add_special_tokens=False).input_ids))


def episode_columns(row: PromptRow) -> dict[str, Any]:
    """Returns the columns an episode of this PromptRow carries: the row's, and a chat
    prompt's messages in MESSAGES_COLUMN (the episode's prompt is their rendering)."""
    if isinstance(row.prompt, str):
        return dict(row.columns)
    return {**row.columns, MESSAGES_COLUMN: row.prompt}


def prompt_preview(prompt: Prompt) -> str:
    """Returns a short repr of a prompt for messages: its start, or a chat's last message."""
    text = prompt if isinstance(prompt, str) else f"{prompt[-1]['role']}: {prompt[-1]['content']}"
    return repr(text[:40] + ("..." if len(text) > 40 else ""))


def reward_inputs(episodes: list[Episode]) -> tuple[list[Prompt], list[str | list[Message]]]:
    """Returns the episodes' (prompts, completions) in the shape TRL's GRPOTrainer passes
    reward functions: for a chat prompt its messages and [{"role": "assistant",
    "content": completion}], for a text prompt the texts unchanged (each by its kind)."""
    prompts: list[Prompt] = []
    completions: list[str | list[Message]] = []
    for episode in episodes:
        messages = episode.columns.get(MESSAGES_COLUMN)
        if messages is None:
            prompts.append(episode.prompt)
            completions.append(episode.completion)
        else:
            prompts.append(messages)
            completions.append([{"role": "assistant", "content": episode.completion}])
    return prompts, completions


def completion_text(completion: str | list[Message]) -> str:
    """Returns a completion's text whether it comes as text or, TRL's conversational
    shape, as messages (the last message's content)."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def prompt_text(prompt: Prompt) -> str:
    """Returns a prompt's text whether it comes as text or as messages (their contents,
    one a line)."""
    return prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)


def as_texts(prompts: list, completions: list) -> tuple[list[str], list[str]]:
    """Returns prompts and completions as text, whichever shape each comes in (text, or
    TRL's conversational messages: see prompt_text, completion_text)."""
    return [prompt_text(p) for p in prompts], [completion_text(c) for c in completions]


def accepts_chat(reward: Callable[..., R]) -> Callable[..., R]:
    """Returns the reward, written for text, taking prompts and completions in either
    shape (as_texts). functools.wraps keeps its signature, which names the columns the
    reward is passed."""

    @functools.wraps(reward)
    def on_text(prompts: list, completions: list, *args: Any, **kwargs: Any) -> R:
        return reward(*as_texts(prompts, completions), *args, **kwargs)

    return on_text
