"""`--help` says what a field does and when to change it, never what it measured: a figure
in a field's doc goes stale silently, where BENCHMARKS.md holds the latest with its
command, machine and date (a doc may link to its section)."""

from __future__ import annotations

import re

import jsonargparse
import pytest

from rlray.config.command_line import DESCRIPTION, build_parser
from rlray.config.schema import RewardSpec
from tests.test_docs import REPO, anchors

# What a measurement looks like in prose, against a setting ("seconds to wait", "2048 on
# CPU", "under 16 MiB of weights", "60 s"): a speed; a gain written as a ratio; a time or a
# size given to a decimal place, approximately ("~20 s", "about 300 MB") or as a spread
# ("10-30 s"); the machine it ran on; the day it ran.
MEASUREMENTS = {
    "a speed": r"\d[\d,.]* ?(?:tokens|episodes|programs|samples|steps|calls)/s\b",
    "a ratio": r"\b\d+(?:\.\d+)?x\b"
    r"|\b\d+(?:\.\d+)?% (?:less|more|fewer|faster|slower)\b"
    r"|\b(?:(?:a|one) (?:half|third|quarter|fifth|sixth|tenth)|twice|half|\d+ times)"
    r" (?:as fast|as slow|as much|less|more|faster|slower|the speed)\b",
    "a measured time": r"(?:~ ?|about |\d-)\d+(?:\.\d+)? ?(?:ms|s|seconds|minutes)\b"
    r"|\b\d+\.\d+ ?(?:ms|s)\b",
    "a measured size": r"(?:~ ?|about |\d-)\d+(?:\.\d+)? ?(?:KiB|MiB|GiB|KB|MB|GB)\b"
    r"|\b\d+\.\d+ ?(?:KiB|MiB|GiB|KB|MB|GB)\b",
    "a machine": r"\b(?:[ABHL]\d{2,3}|EPYC|Xeon|Ryzen)\b|\b\d+-core\b|\bon \d+ (?:CPU )?cores\b",
    "a date": r"\b20\d\d-\d\d-\d\d\b",
}
MEASUREMENT = re.compile("|".join(f"(?P<m{i}>{p})" for i, p in enumerate(MEASUREMENTS.values())))


def measurements(text: str) -> list[str]:
    """Returns "kind: 'figure'" for each measurement the text states."""
    kinds = list(MEASUREMENTS)
    found = []
    for match in MEASUREMENT.finditer(" ".join(text.split())):
        (index,) = [int(name[1:]) for name, value in match.groupdict().items() if value]
        found.append(f"{kinds[index]}: {match[0]!r}")
    return found


def help_texts() -> dict[str, str]:
    """Returns {flag or section: its text} for everything `jobs/ppo.py --help` prints, and
    what `--reward.functions.help RewardSpec` prints for a reward component's fields."""
    parser = build_parser()
    reward_spec = jsonargparse.ArgumentParser()
    reward_spec.add_class_arguments(RewardSpec)
    texts = {"description": DESCRIPTION}
    for each, prefix in ((parser, ""), (reward_spec, "reward.functions[].")):
        for action in each._actions:
            if action.help and action.option_strings:
                texts[prefix + action.option_strings[-1].lstrip("-")] = action.help
        for group in each._action_groups:
            texts[f"section {group.title!r}"] = f"{group.title} {group.description or ''}"
    return texts


def test_no_help_text_states_a_measurement():
    stated = {name: found for name, text in help_texts().items() if (found := measurements(text))}
    assert not stated, (
        f"--help texts state measurements {stated}: say what the field does and when to "
        "change it; the figure belongs in BENCHMARKS.md (link its section)"
    )


def test_every_results_section_a_help_text_links_exists():
    sections = anchors(REPO / "BENCHMARKS.md")
    for name, text in help_texts().items():
        for anchor in re.findall(r"BENCHMARKS\.md#([\w-]+)", text):
            assert anchor in sections, f"{name}: BENCHMARKS.md#{anchor}: no such heading"


def test_help_texts_cover_every_section_and_the_reward_spec():
    texts = help_texts()
    assert "learner.micro_batch_tokens" in texts
    assert "reward.functions[].timeout_s" in texts
    assert any(name.startswith("section 'The learner actor") for name in texts)


@pytest.mark.parametrize(
    "text",
    [
        "on CPU it costs ~20 s at start",
        "after about 10-30 s of compilation",
        "(61 against 84 s, 3 seeds) in 27% less time",
        "trained a 12.6M model's step 1.7x as fast",
        "a step took a fifth to a quarter less time",
        "in a sixth less time, its learner holding 0.04 GiB more",
        "importing transformers imports torch, ~300 MB",
        "made 2.35 episodes/s",
        "on an H100 they trained a 138M model",
        "a 2-core machine",
        "measured 2026-11-29",
    ],
)
def test_a_measurement_is_recognised(text: str):
    assert measurements(text)


@pytest.mark.parametrize(
    "text",
    [
        "Longest wait in seconds for an actor to start",
        "null: 2048 on CPU, 0 on GPUs",
        "torch for models of under 16 MiB of weights",
        "KV-cache size per worker in GiB",
        "a rollout batch is prompts x samples episodes",
        "Largest request body; bigger ones get 413",
        "falling along a cosine to 1% of it",
        "a 0.53M-parameter Qwen2 built offline",
        "k3 (ratio - 1 - log ratio, always >= 0, at most 10)",
        "A trace not ended this long after its task was handed out (300 s) is dropped",
    ],
)
def test_a_setting_is_not_a_measurement(text: str):
    assert not measurements(text)
