"""In-flight weight updates on real vLLM (rollout.in_flight_updates; the session's rollout
host, tests/rollout_host.py): a weight load lands between two engine steps of a generate
call that is under way, the requests go on under the new weights, and each episode
records the versions its tokens came from.

The model is the embedded one without its end-of-sequence token (every completion runs
to max_new_tokens) and with noise on its weights (two noisy copies are the old and the
new policy: their logprobs differ at every token, where the trained model is sure).

How the tokens' logprobs show which weights made them: after the generate call, the
engine scores the episodes' tokens by prefill (RolloutWorker.token_logprobs) once with
the new weights and once with the old ones loaded again. A token sampled before the load
has the old weights' logprob, a token sampled after it the new weights' (recompute) or
neither's (keep: it attended to KV the old weights computed).
"""

from __future__ import annotations

import glob
import json
import shutil
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import ray
import torch
from safetensors.torch import load_file

from rlray.config import Config
from rlray.core.prompt import PromptRow
from rlray.data.models import resolve_model_path
from rlray.rollout.multiturn import TurnLimits
from tests.rollout_host import ROLLOUT, rollout_actor
from tests.test_multiturn import OBSERVATION, Result

ROWS = [PromptRow(f"{a}+{a + 3}=", {"answer": str(2 * a + 3)}) for a in range(8)]
TOKENS = 24  # every completion runs this long: the load finds them all running
STEPS_BEFORE_LOAD = 5
TOLERANCE = 1e-4  # float32; vLLM and a prefill of the same weights agree to ~1e-6 here


def without_end_of_sequence(source: Path, target: Path) -> Path:
    """Returns a copy of the model whose config and tokenizer name no end-of-sequence
    token: vLLM then ends a completion at max_tokens only."""
    shutil.copytree(source, target)
    for name, key in [
        ("config.json", "eos_token_id"),
        ("generation_config.json", "eos_token_id"),
        ("tokenizer_config.json", "eos_token"),
    ]:
        settings = json.loads((target / name).read_text())
        settings[key] = None
        (target / name).write_text(json.dumps(settings))
    return target


def noisy(path: Path, seed: int) -> dict[str, torch.Tensor]:
    """Returns the model's weights plus seeded noise: a policy unsure of every token."""
    (file,) = glob.glob(str(path / "*.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    return {
        name: t + 0.3 * torch.randn(t.shape, generator=generator) if t.is_floating_point() else t
        for name, t in load_file(file).items()
    }


class ThreeTurns:
    """Answers every turn with OBSERVATION; done after the third."""

    def __init__(self) -> None:
        self.turns = 0

    def reset(self, row: PromptRow) -> str:
        return ""

    def step(self, action: str) -> Result:
        self.turns += 1
        return Result(OBSERVATION, 1.0 if self.turns == 3 else None, self.turns == 3)


TURN_TOKENS = 6  # a turn's max_new_tokens: the load lands in the second turn


def in_a_thread(call) -> tuple[threading.Thread, dict]:
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(out=call()))
    thread.start()
    return thread, result


def load_after(worker, steps: int, version: int, weights) -> int:
    """Loads `weights` as `version` once the worker's engine took `steps` steps;
    returns the steps it had taken then."""
    deadline = time.monotonic() + 120
    while worker.loop.steps < steps and time.monotonic() < deadline:
        time.sleep(0.0005)
    worker.loop.hold()  # the steps are counted with the engine held: the load comes next
    taken = worker.loop.steps
    worker.load_weights(version, weights)
    return taken


def generate_across_a_load(host, rows, old, new) -> tuple:
    """Runs in the host's process: loads `old` (version 0), generates `rows` in a thread
    while this thread loads `new` (version 1) after STEPS_BEFORE_LOAD engine steps; then
    scores the episodes' tokens with `new` and with `old` (loaded again as version 2)."""
    worker = host.rollout
    worker.load_weights(0, old)
    before = worker.loop.steps  # the warm-up's
    thread, result = in_a_thread(lambda: worker.generate(rows, 0))
    steps_at_load = load_after(worker, before + STEPS_BEFORE_LOAD, 1, new) - before
    thread.join(timeout=120)
    episodes, stats = result["out"]
    with_new = worker.token_logprobs(episodes)
    worker.load_weights(2, old)
    with_old = worker.token_logprobs(episodes)
    return episodes, stats, steps_at_load, worker.loop.updates_in_flight, with_new, with_old


def turns_across_a_load(host, rows, old, new) -> list:
    """Runs in the host's process: loads `old` (version 3), runs three-turn trajectories
    of `rows` in a thread while this thread loads `new` (version 4) during their second
    turn; returns the episodes."""
    worker = host.rollout
    worker.load_weights(3, old)
    limits = TurnLimits(max_turns=3, max_new_tokens=TURN_TOKENS, max_completion_tokens=40)
    thread, result = in_a_thread(lambda: worker.multi_turn_episodes(rows, 0, ThreeTurns, limits))
    load_after(worker, worker.loop.steps + TURN_TOKENS + 2, 4, new)
    thread.join(timeout=120)
    return result["out"]


def close(a: list[float], b: list[float]) -> list[bool]:
    return [abs(x - y) <= TOLERANCE for x, y in zip(a, b, strict=True)]


@pytest.fixture(scope="module", params=["recompute", "keep"])
def across_a_load(rollout_host, request, tmp_path_factory):
    embedded = Path(resolve_model_path(Config().model.path))
    path = without_end_of_sequence(embedded, tmp_path_factory.mktemp("model") / embedded.name)
    rollout = replace(
        ROLLOUT,
        in_flight_updates=True,
        in_flight_kv_cache=request.param,
        max_new_tokens=TOKENS,
    )
    old, new = noisy(path, seed=0), noisy(path, seed=1)
    with rollout_actor(rollout_host, path, "float32", rollout=rollout) as host:
        call = host.__ray_call__.remote(generate_across_a_load, ROWS, old, new)
        single = ray.get(call, timeout=300)
        turns = ray.get(host.__ray_call__.remote(turns_across_a_load, ROWS, old, new), timeout=300)
        yield request.param, single, turns


@pytest.mark.slow
def test_a_load_lands_between_engine_steps_and_the_episodes_record_both_versions(across_a_load):
    _, (episodes, stats, steps_at_load, updates, _, _), _ = across_a_load
    assert len(episodes) == len(ROWS) * ROLLOUT.samples_per_prompt
    assert STEPS_BEFORE_LOAD <= steps_at_load < TOKENS and updates == 1
    # Every request was running at the load: its first token is version 0's, its last
    # version 1's; the batch counts from its oldest version.
    assert all(len(e.completion_token_ids) == TOKENS for e in episodes)
    assert {(e.policy_version, e.last_policy_version) for e in episodes} == {(0, 1)}
    assert stats.policy_version == 0 and stats.updated_in_flight == len(episodes)


@pytest.mark.slow
def test_tokens_before_the_load_are_the_old_policys_and_after_it_the_new_policys(across_a_load):
    mode, (episodes, _, steps_at_load, _, with_new, with_old), _ = across_a_load
    # One step prefills each prompt and samples its first token; each later step one more
    # (the steps are counted with the engine held for the load, so the count is exact).
    split = steps_at_load
    for episode, new, old in zip(episodes, with_new, with_old, strict=True):
        sampled = episode.rollout_logprobs
        assert all(close(sampled[:split], old[:split])), (mode, episode.episode_id)
        assert not any(close(sampled[:split], new[:split]))  # the weights do differ
        if mode == "recompute":  # KV recomputed: exactly the new policy from the load on
            assert all(close(sampled[split:], new[split:])), episode.episode_id
        else:  # KV of the old weights kept: later tokens are neither policy's exactly
            after = sampled[split:]
            assert not all(close(after, new[split:])) and not all(close(after, old[split:]))


@pytest.mark.slow
def test_a_multi_turn_episode_records_the_versions_of_its_first_and_last_turns(across_a_load):
    _, _, episodes = across_a_load
    assert len(episodes) == len(ROWS) * ROLLOUT.samples_per_prompt
    for e in episodes:
        assert sum(s.kind == "model_call" for s in e.spans) == 3, e.spans
        assert (e.policy_version, e.last_policy_version) == (3, 4)
        assert e.completion_mask.count(1) == 3 * TURN_TOKENS  # every turn ran its tokens
