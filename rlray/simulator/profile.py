"""The simulator's profile: the modelled engine's and learner's rates, read from a YAML
file that names each one's source (rlray/simulator/profiles/), and the durations they
give a generate call, a learner step and a weight load. Pure arithmetic."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from rlray.config import ConfigError

PROFILES = Path(__file__).parent / "profiles"
DEFAULT_PROFILE = PROFILES / "h100-7b.yaml"


@dataclass(frozen=True)
class Profile:
    """Rates of a modelled engine and learner (each field's source is in its file)."""

    name: str
    gpus_per_engine: int
    generation_tokens_per_s: float
    """An engine's completion tokens a second at a full batch."""
    sequence_tokens_per_s: float
    """One sequence's decode speed: a batch takes at least its longest completion at it."""
    prefill_tokens_per_s: float
    prompt_tokens: int
    """Tokens of each simulated prompt."""
    weight_bytes: int
    load_bytes_per_s: float
    """An engine's load of published weights from host memory."""
    train_tokens_per_s_per_gpu: float
    """Tokens (prompt and completion) a training GPU takes a second, forward and backward."""
    train_gpus_per_engine_gpu: float
    """Training GPUs for each generating GPU."""

    def generate_seconds(self, prompt_tokens: int, completion_lengths: list[int]) -> float:
        """A batch's time: its prefill, then its decode, bound by the longest completion
        at one sequence's speed or by every completion token at the engine's."""
        if not completion_lengths:
            return 0.0
        prefill = prompt_tokens / self.prefill_tokens_per_s
        decode = max(
            max(completion_lengths) / self.sequence_tokens_per_s,
            sum(completion_lengths) / self.generation_tokens_per_s,
        )
        return prefill + decode

    def train_seconds(self, tokens: int, engines: int) -> float:
        """A learner step's time over `tokens` (every epoch's), on the training GPUs that
        `engines` generating engines come with."""
        gpus = engines * self.gpus_per_engine * self.train_gpus_per_engine_gpu
        return tokens / (self.train_tokens_per_s_per_gpu * gpus)

    def load_seconds(self) -> float:
        """An engine's load of the model's weights."""
        return self.weight_bytes / self.load_bytes_per_s


def load_profile(path: str = "") -> Profile:
    """Reads a profile file (empty: DEFAULT_PROFILE); every field is {value, source}.
    Raises ConfigError naming a missing or unreadable file, or a field without both."""
    file = Path(path) if path else DEFAULT_PROFILE
    try:
        entries = yaml.safe_load(file.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"simulator.profile {file}: {err}") from None
    values: dict[str, object] = {}
    for field in dataclasses.fields(Profile):
        entry = entries.get(field.name) if isinstance(entries, dict) else None
        if field.name == "name":
            values["name"] = str(entry or file.stem)
            continue
        if not isinstance(entry, dict) or "value" not in entry or not entry.get("source"):
            raise ConfigError(f"simulator.profile {file}: {field.name} needs a value and a source")
        values[field.name] = type_of(field)(entry["value"])
    return Profile(**values)  # type: ignore[arg-type]


def type_of(field: dataclasses.Field) -> type:
    return int if field.type == "int" else float


class ModelledTime:
    """Sleeps the rest of a modelled duration, scaled (simulator.time_scale): the work a
    simulated call does itself (building its episodes) counts as part of it."""

    def __init__(self, scale: float):
        self.scale = scale

    def wait(self, modelled_s: float, started: float) -> float:
        """Sleeps until `modelled_s` x scale after `started` (time.perf_counter); returns
        the seconds the call overran it (0 where it did not)."""
        left = modelled_s * self.scale - (time.perf_counter() - started)
        if left > 0:
            time.sleep(left)
            return 0.0
        return -left
