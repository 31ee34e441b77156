"""Multi-turn rollouts on real vLLM (the session's rollout host, tests/rollout_host.py):
token in and token out, the loss mask at every turn boundary, parity on the policy's
tokens, the token budget, and trajectories that do not wait for each other; then the
built-in calculator task run as a job, which must learn to call its tool."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import ray

from rlray.config import Config
from rlray.core.episode import from_table
from rlray.core.prompt import PromptRow
from rlray.data.models import load_tokenizer, resolve_model_path
from rlray.episodes.reader import read
from rlray.rollout.multiturn import TurnLimits
from tests.jobs_helper import REPO, metrics, run_example
from tests.rollout_host import RolloutHost, rollout_actor
from tests.test_job import load_policy
from tests.test_learner import plain_logprobs

pytestmark = pytest.mark.slow

ROWS = [PromptRow("12+34=", {"answer": "46"}), PromptRow("5+7=", {"answer": "12"})]
OBSERVATION = "(1+1)="  # characters of the embedded tokenizer: one token each


@dataclass
class Result:
    observation: str
    reward: float | None
    done: bool


class AskTwice:
    """Answers the first turn with OBSERVATION and ends after the second, rewarding it."""

    def __init__(self) -> None:
        self.turns = 0

    def reset(self, row: PromptRow) -> str:
        return ""

    def step(self, action: str) -> Result:
        self.turns += 1
        return Result(OBSERVATION, None, False) if self.turns == 1 else Result("", 1.0, True)


class Endless:
    """Never done: the turn limit or the token budget ends it."""

    def reset(self, row: PromptRow) -> str:
        return "("

    async def step(self, action: str) -> Result:  # an async environment works as well
        return Result(OBSERVATION, 0.0, False)


def run_on_host(host: RolloutHost, rows, environment, limits: TurnLimits) -> list:
    return host.rollout.multi_turn_episodes(rows, 0, environment, limits)


@pytest.fixture(scope="module")
def tiny_rollout(rollout_host):
    path = Path(resolve_model_path(Config().model.path))
    with rollout_actor(rollout_host, path, "float32") as host:
        yield host, path


def generate(host, environment, limits: TurnLimits) -> list:
    call = host.__ray_call__.remote(run_on_host, ROWS, environment, limits)
    return ray.get(call, timeout=300)


def test_observations_are_appended_as_tokens_and_masked_at_every_boundary(tiny_rollout):
    host, path = tiny_rollout
    episodes = generate(
        host, AskTwice, TurnLimits(max_turns=4, max_new_tokens=6, max_completion_tokens=40)
    )
    observed = load_tokenizer(str(path))(OBSERVATION, add_special_tokens=False).input_ids
    assert len(episodes) == 4  # 2 prompts x 2 samples
    for e in episodes:
        first, second = e.spans[0].output, e.spans[1].output
        n = e.completion_mask.index(0)  # the first turn's tokens
        assert e.completion_mask == [1] * n + [0] * len(observed) + [1] * (
            len(e.completion_token_ids) - n - len(observed)
        )
        # The observation's own tokens sit between the turns, and the text reads in order.
        assert e.completion_token_ids[n : n + len(observed)] == observed
        assert e.completion == first + OBSERVATION + second
        assert [s.kind for s in e.spans] == ["model_call", "model_call", "reward"]
        assert e.spans[2].value == 1.0 and e.finish_reason == "stop"
    # Token out: vLLM's logprobs of the policy's tokens, in both turns, are those of a
    # plain forward pass over the very ids stored (the second turn was generated from
    # them); observation tokens carry no logprob of the policy.
    model = load_policy(path)
    for e, plain in zip(episodes, plain_logprobs(model, episodes), strict=True):
        for rollout, reference, policy in zip(
            e.rollout_logprobs, plain, e.completion_mask, strict=True
        ):
            assert abs(rollout - reference) <= 1e-4 if policy else rollout == 0.0


def evaluation_on_host(host: RolloutHost, limits: TurnLimits, samples: int, temperature: float):
    return host.rollout.multi_turn_episodes(ROWS, -2, AskTwice, limits, samples, temperature)


def test_evaluation_trajectories_are_greedy_or_sampled_as_asked_and_seeded(tiny_rollout):
    host, _ = tiny_rollout
    limits = TurnLimits(max_turns=2, max_new_tokens=4, max_completion_tokens=20)

    def run(samples: int, temperature: float) -> list:
        call = host.__ray_call__.remote(evaluation_on_host, limits, samples, temperature)
        return ray.get(call, timeout=300)

    greedy, sampled, sampled_again = run(1, 0.0), run(3, 1.0), run(3, 1.0)
    assert [(e.prompt_index, e.sample_index) for e in greedy] == [(-2, 0), (-1, 0)]
    assert [(e.prompt_index, e.sample_index) for e in sampled] == [
        (p, s) for p in (-2, -1) for s in range(3)
    ]
    # Seeded by prompt, sample and turn: every model evaluated with a seed draws alike.
    tokens = [e.completion_token_ids for e in sampled]
    assert tokens == [e.completion_token_ids for e in sampled_again]
    assert [e.completion_token_ids for e in run(1, 0.0)] == [e.completion_token_ids for e in greedy]
    # ... and the samples are samples: not all of them the greedy trajectory.
    greedy_of = {e.prompt_index: e.completion_token_ids for e in greedy}
    assert any(e.completion_token_ids != greedy_of[e.prompt_index] for e in sampled)


def test_the_turn_limit_and_the_token_budget_end_a_trajectory(tiny_rollout):
    host, path = tiny_rollout
    # What reset() answers is part of the prompt.
    (opening,) = load_tokenizer(str(path))("(", add_special_tokens=False).input_ids
    limited = generate(
        host, Endless, TurnLimits(max_turns=2, max_new_tokens=4, max_completion_tokens=60)
    )
    for e in limited:
        assert e.prompt_token_ids[-1] == opening and e.finish_reason == "length"
        assert sum(s.kind == "model_call" for s in e.spans) == 2
        # One observation between the two turns: the turn limit stops the second.
        assert e.completion_mask.count(0) == len(OBSERVATION)
    budget = generate(
        host, Endless, TurnLimits(max_turns=50, max_new_tokens=4, max_completion_tokens=24)
    )
    for e in budget:
        assert e.finish_reason == "length" and len(e.completion_token_ids) <= 24
        assert sum(s.kind == "model_call" for s in e.spans) > 2


# Trajectories of the host process's environments meet here (the module is imported
# once in that process).
FAST_DONE = threading.Event()


class Quick:
    """Three quick turns; the last one's end lets the slow environment answer."""

    finished = 0
    lock = threading.Lock()

    def __init__(self) -> None:
        self.turns = 0

    def reset(self, row: PromptRow) -> str:
        return ""

    def step(self, action: str) -> Result:
        self.turns += 1
        if self.turns < 3:
            return Result(OBSERVATION, None, False)
        with Quick.lock:
            Quick.finished += 1
            if Quick.finished == 3:
                FAST_DONE.set()
        return Result("", 1.0, True)


class SlowFirst:
    """The first trajectory's environment answers only once the three others are done:
    a loop that waited for every trajectory's step before the next turn would never get
    there (the wait would time out and the reward would say so)."""

    made = 0

    def __new__(cls):
        SlowFirst.made += 1
        return super().__new__(SlowFirst) if SlowFirst.made == 1 else Quick()

    def reset(self, row: PromptRow) -> str:
        return ""

    def step(self, action: str) -> Result:
        return Result("", 1.0 if FAST_DONE.wait(timeout=60) else 0.0, True)


def test_a_slow_environment_does_not_hold_the_other_trajectories(tiny_rollout):
    host, _ = tiny_rollout
    episodes = generate(
        host, SlowFirst, TurnLimits(max_turns=4, max_new_tokens=4, max_completion_tokens=40)
    )
    slow, *quick = episodes
    assert slow.spans[-1].value == 1.0  # the three quick ones finished while it waited
    assert all(sum(s.kind == "model_call" for s in e.spans) == 3 for e in quick)


# ------------------------------------------------------------------ the calculator task


@pytest.fixture(scope="module")
def calculator_run(job_env, tmp_path_factory):
    """Six steps of the built-in calculator task, as examples/calculator.yaml runs it,
    colocated (the learner and its engine in one process, taking turns) with partial
    rollouts: a turn may end with groups still running, carried into the next turn (a
    batch ahead and carrying: two versions of staleness). The calculator's trajectories
    end nearly together (a turn or two, of fixed lengths), so a turn may leave three
    quarters of its groups, not the default quarter, which it would never leave."""
    run_dir = tmp_path_factory.mktemp("calculator") / "run"
    colocated = ["--ray.placement", "colocated", "--rollout.in_flight_updates", "true"]
    colocated += ["--buffer.max_staleness", "2", "--rollout.in_flight_carry", "0.75"]
    return run_dir, run_example("calculator", 6, run_dir, job_env, colocated)


def test_the_calculator_task_learns_to_call_the_tool(calculator_run):
    run_dir, result = calculator_run
    done = re.search(r"^done: 6 steps, held-out accuracy ([\d.]+) -> ([\d.]+)", result.stdout, re.M)
    assert done, result.stdout[-2000:]
    before, after = float(done[1]), float(done[2])
    assert after - before >= 0.20, done[0]  # measured: 0.03 -> 0.62
    records = metrics(run_dir)
    calls = [r["tool_calls"] / r["episodes"] for r in records]
    assert calls[-1] >= calls[0] + 0.1, calls  # measured: 0.10 -> 0.27 calls per episode
    assert all(r["tool_call_success_rate"] > 0.5 for r in records)
    # Parity is checked on the policy's tokens only: the calculator's answers carry no
    # logprob of the policy and would be far off.
    assert all(r["logprob_parity_error"] <= 1e-4 for r in records)
    # Colocated, a batch ahead: each batch made by the weights of the step before, and
    # trajectories carried over a turn by the weights of the step before that.
    assert all(r["weight_sync"] == "in_memory" for r in records)
    assert [r["weight_versions_loaded"] for r in records] == [
        {"rollout-0": r["step"]} for r in records
    ]
    assert all(0 <= r["staleness_mean"] <= 2 for r in records)
    assert any(r["staleness_mean"] > 0 for r in records)
    assert records[-1]["dropped_stale"] == 0
    # Every step but the first (a run's first batch is short) trains one batch's worth.
    assert {r["episodes"] for r in records[1:]} == {Config().learner.episodes_per_step}


def test_trajectories_carried_over_a_turn_are_stored_whole_once(calculator_run):
    run_dir, _ = calculator_run
    episodes = from_table(read(str(run_dir / "episodes")))
    # Some trajectories ran across a weight load (carried from one turn to the next),
    # each recording the versions of its first and last turns.
    assert any(e.last_policy_version > e.policy_version for e in episodes)
    assert all(e.policy_version <= e.last_policy_version <= e.policy_version + 1 for e in episodes)
    # Every group started is stored whole once, those still running at the end too.
    per_prompt = Counter(e.prompt_index for e in episodes)
    assert sorted(per_prompt) == list(range(len(per_prompt)))
    assert set(per_prompt.values()) == {Config().rollout.samples_per_prompt}
    assert len({e.episode_id for e in episodes}) == len(episodes)
    # A carried trajectory goes on where it was: its turns and observations in order.
    for e in episodes:
        kinds = [s.kind for s in e.spans if s.kind in ("model_call", "tool_call")]
        assert kinds[::2] == ["model_call"] * len(kinds[::2]), kinds


def test_a_stored_calculator_episode_reads_back_turn_by_turn(calculator_run):
    run_dir, _ = calculator_run
    episodes = from_table(read(str(run_dir / "episodes")))
    used = [e for e in episodes if any(s.kind == "tool_call" for s in e.spans)]
    assert used
    for e in used:
        turns = [s.kind for s in e.spans if s.kind != "reward"]
        assert turns[:3] == ["model_call", "tool_call", "model_call"], turns
        # environment_reward, the run's only reward: what the environment gave, summed.
        assert e.reward == sum(s.value for s in e.spans if s.kind == "reward")
    single = [e for e in used if sum(s.kind == "tool_call" for s in e.spans) == 1]
    for e in single:  # what was appended: the calculator's result and its "="
        assert e.completion_mask.count(0) == len(e.spans[1].result or "") + 1
    assert single
    show = ["--episode", used[0].episode_id]
    shown = subprocess.run(
        [sys.executable, str(REPO / "jobs" / "episodes.py"), str(run_dir / "episodes"), *show],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "tool_call" in shown and f"-> '{used[0].spans[1].result}'" in shown
