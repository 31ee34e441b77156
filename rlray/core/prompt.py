"""A prompt and the dataset row it travels with: what the driver hands rollout workers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PromptRow:
    """One prompt and the dataset columns that travel with it (e.g. answer)."""

    prompt: Prompt
    """Text, or chat messages that the rollout worker renders with the model's chat
    template (rlray.data.chat)."""
    columns: dict[str, Any] = field(default_factory=dict)


Message = dict[str, str]


Prompt = str | list[Message]
