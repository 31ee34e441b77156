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

Partial rollouts (rlray.rollout.partial), on the same engine: a colocated engine's turn
ends with a few groups still running, they stay in the engine across a weight load, and
a later call returns them whole, each sample with the versions its tokens came from; no
group is lost or returned twice. Requests run exactly their max_tokens, so the test
chooses which groups are the tail.
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
from rlray.rollout.multiturn import TrajectoryRunner, TurnLimits
from rlray.rollout.partial import PartialTrajectories
from rlray.rollout.sampling import ModelCall
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


SHORT, LONG = 4, 30  # partial rollouts: every request runs exactly this long


def group_requests(worker, index: int, max_tokens: int) -> list:
    """Returns the requests of prompt `index`'s group as the worker makes them, each
    running `max_tokens` tokens."""
    row = ROWS[index % len(ROWS)]
    requests = worker._group_requests(row, index, ROLLOUT.samples_per_prompt, 1.0, 0, "test")
    for _, _, params, _ in requests:
        params.max_tokens = max_tokens
    return requests


def versions(group) -> list[tuple[int, int]]:
    return [(v.first, v.last) for _, v in group.outputs.values()]


def carry_across_a_load(host, old, new) -> dict:
    """Runs in the host's process: groups 0-2 short and 3 long; a turn that may leave one
    group running; a weight load; a turn of groups 4-5 that may not carry group 3 (it
    started under version 0, and the floor is 1)."""
    worker = host.rollout
    partial = worker.partial
    worker.load_weights(0, old)
    loads_before = worker.loop.updates_in_flight
    for index in range(4):
        partial.add(index, group_requests(worker, index, LONG if index == 3 else SHORT))
    first = partial.take([0, 1, 2, 3], may_leave=1, carry_floor=0)
    carried = {i: len(g.outputs) for i, g in partial.groups.items()}
    worker.load_weights(1, new)
    for index in (4, 5):
        partial.add(index, group_requests(worker, index, SHORT))
    second = partial.take([4, 5], may_leave=0, carry_floor=1)
    held_after = list(partial.groups)
    rest = partial.take([], may_leave=0, carry_floor=None)
    return {
        "first": [(g.prompt_index, versions(g)) for g in first],
        "carried": carried,
        "second": [(g.prompt_index, versions(g)) for g in second],
        "rest": [(g.prompt_index, versions(g)) for g in rest],
        "lengths": {
            g.prompt_index: [len(o.outputs[0].token_ids) for o, _ in g.outputs.values()]
            for g in first + second + rest
        },
        "held_after": held_after,
        "in_flight_loads": worker.loop.updates_in_flight - loads_before,
    }


def generate_carrying_calls(host) -> tuple:
    """Runs in the host's process: a long group left by an earlier call (prompt 100)
    stays through a call of short groups whose floor lets it, then comes back alone
    from the call that finishes what is held."""
    worker = host.rollout
    worker.partial.add(100, group_requests(worker, 100, LONG))
    first = worker.generate_carrying(ROWS[:4], 0, carry_floor=worker.policy_version)
    last = worker.generate_carrying([], 0, carry_floor=None)
    return first, last


class TurnsOfItsRow:
    """Answers every turn with OBSERVATION; done after its row's `turns` turns."""

    def reset(self, row: PromptRow) -> str:
        self.turns, self.left = 0, row.columns["turns"]
        return ""

    def step(self, action: str) -> Result:
        self.turns += 1
        done = self.turns == self.left
        return Result(OBSERVATION, 1.0 if done else None, done)


# Partial multi-turn rollouts: short groups of one turn, long ones of four (a turn is
# TURN_TOKENS, an observation 6 tokens: 4 turns and 3 observations are 42 tokens).
TURN_LIMITS = TurnLimits(max_turns=4, max_new_tokens=TURN_TOKENS, max_completion_tokens=44)


def turn_rows(long: set[int], count: int) -> list[PromptRow]:
    return [
        PromptRow(ROWS[i].prompt, {"answer": "", "turns": 4 if i in long else 1})
        for i in range(count)
    ]


def trajectory_versions(group) -> list[tuple[int, int, int]]:
    """Returns (first version, last version, turns) of each trajectory of a group."""
    return [(t.versions.first, t.versions.last, t.turns) for t in group]


def carry_trajectories_across_a_load(host, old, new) -> dict:
    """Runs in the host's process: as carry_across_a_load, with trajectories: groups 0-2
    of one turn and 3 of four; a turn that may leave one group; a weight load; a turn
    of groups 4-5 whose floor (1) makes it finish group 3."""
    worker = host.rollout
    session = worker.loop.session
    partial = PartialTrajectories(
        lambda: TrajectoryRunner(
            session(), worker._encode, worker._turn_text, worker._turns(1.0), TURN_LIMITS
        )
    )
    worker.load_weights(0, old)
    rows = turn_rows({3}, 6)
    groups = worker._trajectories(rows, 0, TurnsOfItsRow, "test")
    samples = ROLLOUT.samples_per_prompt
    for index in range(4):
        partial.add(index, groups[index * samples : (index + 1) * samples])
    first = partial.take([0, 1, 2, 3], may_leave=1, carry_floor=0)
    carried = {i: [t.turns for t in g] for i, g in partial.groups.items()}
    worker.load_weights(1, new)
    for index in (4, 5):
        partial.add(index, groups[index * samples : (index + 1) * samples])
    second = partial.take([4, 5], may_leave=0, carry_floor=1)
    held_after = list(partial.groups)
    rest = partial.take([], may_leave=0, carry_floor=None)
    partial.drop_all()  # ends the runner's threads
    return {
        name: [(g[0].prompt_index, trajectory_versions(g)) for g in taken]
        for name, taken in (("first", first), ("second", second), ("rest", rest))
    } | {"carried": carried, "held_after": held_after, "masks": [t.completion_mask for t in groups]}


def generate_carrying_turns(host) -> tuple:
    """Runs in the host's process: generate_carrying with an environment, four groups of
    which the last runs four turns; then the call that finishes what is held."""
    worker = host.rollout
    rollout = worker.rollout
    worker.rollout = replace(rollout, max_new_tokens=TURN_TOKENS, max_completion_tokens=44)
    worker.make_environment = TurnsOfItsRow
    try:
        first = worker.generate_carrying(turn_rows({3}, 4), 200, worker.policy_version)
        last = worker.generate_carrying([], 0, carry_floor=None)
    finally:
        worker.rollout, worker.make_environment = rollout, None
        worker.partial_turns.drop_all()
    return first, last


def load_between_the_add_and_the_first_step(host, old, new) -> tuple[int, int]:
    """Runs in the host's process: adds a request under `old` (version 5), loads `new`
    (version 6) before any engine step, then runs the request; returns its versions."""
    worker = host.rollout
    worker.load_weights(5, old)
    request_id, prompt, params = worker._call_request(
        ModelCall([5, 6, 7], 1, 1.0, TURN_TOKENS, [], False)
    )
    session = worker.loop.session()
    session.add_request(request_id, prompt, params)
    worker.load_weights(6, new)  # the engine took no step for the request yet
    while session.pending:
        session.step()
    versions = session.versions.pop(request_id)
    return versions.first, versions.last


SHORT_CALL, LONG_CALL, CALLERS = 4, 12, 8


def callers_sharing_steps(host) -> dict:
    """Runs in the host's process: CALLERS agents' calls of one request each at once
    (RolloutWorker.complete, each from its own thread), the first SHORT_CALL tokens and
    stepping before the others start, the others LONG_CALL; returns the engine steps
    they took, each call's tokens and the late hand-offs of the stepping."""
    worker = host.rollout
    loop = worker.loop
    before, late = loop.steps, loop.late_handoffs

    go = threading.Event()

    def call(tokens: int, after: threading.Event | None = None):
        def run():
            if after is not None:
                after.wait(timeout=60)
            return worker.complete([5, 6, 7], 1, 1.0, tokens, [])

        return run

    # The long callers' threads are started first and wait: started only once the first
    # call steps, on a busy machine they came in one by one, many steps apart.
    waiting = [in_a_thread(call(LONG_CALL, go)) for _ in range(CALLERS - 1)]
    calls = [in_a_thread(call(SHORT_CALL))]
    deadline = time.monotonic() + 60
    while loop.steps == before and time.monotonic() < deadline:
        time.sleep(0.0005)
    go.set()
    calls += waiting
    for thread, _ in calls:
        thread.join(timeout=120)
    return {
        "steps": loop.steps - before,
        "tokens": [len(result["out"][0].token_ids) for _, result in calls],
        "late_handoffs": loop.late_handoffs - late,
    }


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
        # partial rollouts (rlray.rollout.partial)
        across = ray.get(host.__ray_call__.remote(carry_across_a_load, old, new), timeout=300)
        calls = ray.get(host.__ray_call__.remote(generate_carrying_calls), timeout=300)
        trajectories = ray.get(
            host.__ray_call__.remote(carry_trajectories_across_a_load, old, new), timeout=300
        )
        turn_calls = ray.get(host.__ray_call__.remote(generate_carrying_turns), timeout=300)
        sharing = ray.get(host.__ray_call__.remote(callers_sharing_steps), timeout=300)
        first = ray.get(
            host.__ray_call__.remote(load_between_the_add_and_the_first_step, old, new),
            timeout=300,
        )
        yield (
            request.param,
            single,
            turns,
            (across, calls),
            (trajectories, turn_calls),
            (sharing, first),
        )


@pytest.mark.slow
def test_a_load_lands_between_engine_steps_and_the_episodes_record_both_versions(across_a_load):
    _, (episodes, stats, steps_at_load, updates, _, _), _, _, _, _ = across_a_load
    assert len(episodes) == len(ROWS) * ROLLOUT.samples_per_prompt
    assert STEPS_BEFORE_LOAD <= steps_at_load < TOKENS and updates == 1
    # Every request was running at the load: its first token is version 0's, its last
    # version 1's; the batch counts from its oldest version.
    assert all(len(e.completion_token_ids) == TOKENS for e in episodes)
    assert {(e.policy_version, e.last_policy_version) for e in episodes} == {(0, 1)}
    assert stats.policy_version == 0 and stats.updated_in_flight == len(episodes)


@pytest.mark.slow
def test_tokens_before_the_load_are_the_old_policys_and_after_it_the_new_policys(across_a_load):
    mode, (episodes, _, steps_at_load, _, with_new, with_old), _, _, _, _ = across_a_load
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
    _, _, episodes, _, _, _ = across_a_load
    assert len(episodes) == len(ROWS) * ROLLOUT.samples_per_prompt
    for e in episodes:
        assert sum(s.kind == "model_call" for s in e.spans) == 3, e.spans
        assert (e.policy_version, e.last_policy_version) == (3, 4)
        assert e.completion_mask.count(1) == 3 * TURN_TOKENS  # every turn ran its tokens


@pytest.mark.slow
def test_a_turn_ends_with_the_long_group_running_and_the_next_returns_it_whole(across_a_load):
    across, _ = across_a_load[3]
    # The first turn (a run's first: nothing held before it, so it may be short)
    # returned the three short groups, all under version 0, and stopped with the long
    # one part-way (each of its samples a request still running).
    assert [index for index, _ in across["first"]] == [0, 1, 2]
    assert all(v == [(0, 0)] * ROLLOUT.samples_per_prompt for _, v in across["first"])
    assert across["carried"] == {3: 0}
    assert across["in_flight_loads"] == 1  # the load found requests running
    # The second turn had to finish it (it started under 0 < the floor 1) and returns a
    # batch's worth: the oldest two whole groups, the long one first, its tokens from
    # both versions. Group 5, whole under version 1, waits for the next call.
    assert across["second"] == [
        (3, [(0, 1)] * ROLLOUT.samples_per_prompt),
        (4, [(1, 1)] * ROLLOUT.samples_per_prompt),
    ]
    assert across["held_after"] == [5]
    assert across["rest"] == [(5, [(1, 1)] * ROLLOUT.samples_per_prompt)]
    assert (
        across["lengths"][3] == [LONG] * ROLLOUT.samples_per_prompt
    )  # whole: none cut at the turn's end
    assert all(
        across["lengths"][i] == [SHORT] * ROLLOUT.samples_per_prompt for i in (0, 1, 2, 4, 5)
    )


@pytest.mark.slow
def test_generate_carrying_returns_each_group_once_and_says_what_it_still_holds(across_a_load):
    _, ((first, first_stats), (last, last_stats)) = across_a_load[3]
    assert sorted({e.prompt_index for e in first}) == [0, 1, 2, 3]
    assert len(first) == 4 * ROLLOUT.samples_per_prompt
    assert (first_stats.first_prompt_index, first_stats.carried_prompts) == (0, [100])
    assert first_stats.returned_prompts == [0, 1, 2, 3]
    assert first_stats.episodes == len(first)
    # The call that finishes what is held returns the long group alone, whole.
    assert [e.prompt_index for e in last] == [100] * ROLLOUT.samples_per_prompt
    assert all(len(e.completion_token_ids) == LONG for e in last)
    assert (last_stats.returned_prompts, last_stats.carried_prompts) == ([100], [])
    ids = [e.episode_id for e in first + last]
    assert len(set(ids)) == len(ids)


@pytest.mark.slow
def test_a_turn_leaves_a_long_trajectory_running_and_the_next_returns_it_whole(across_a_load):
    trajectories, _ = across_a_load[4]
    samples = ROLLOUT.samples_per_prompt
    # The first call returned the three one-turn groups under version 0 and left the
    # four-turn group part-way, its trajectories running (fewer than four turns each).
    assert trajectories["first"] == [(i, [(0, 0, 1)] * samples) for i in (0, 1, 2)]
    assert list(trajectories["carried"]) == [3]
    assert all(turns < 4 for turns in trajectories["carried"][3])
    # The next call had to finish it (first turn under 0 < the floor 1): it returns the
    # oldest two whole groups, the long one first, its turns from both versions; group
    # 5, whole under version 1, waits for the following call.
    assert trajectories["second"] == [(3, [(0, 1, 4)] * samples), (4, [(1, 1, 1)] * samples)]
    assert trajectories["held_after"] == [5]
    assert trajectories["rest"] == [(5, [(1, 1, 1)] * samples)]
    # Every turn ran its tokens and every observation is masked: nothing cut or doubled.
    long = [1] * TURN_TOKENS + [0] * len(OBSERVATION)
    assert all(m == long * 3 + [1] * TURN_TOKENS for m in trajectories["masks"][6:8])
    short = trajectories["masks"][:6] + trajectories["masks"][8:]
    assert len(short) == 10 and all(m == [1] * TURN_TOKENS for m in short)


@pytest.mark.slow
def test_generate_carrying_carries_trajectories_and_returns_each_once(across_a_load):
    _, ((first, first_stats), (last, last_stats)) = across_a_load[4]
    samples = ROLLOUT.samples_per_prompt
    assert sorted({e.prompt_index for e in first}) == [200, 201, 202]
    assert (first_stats.returned_prompts, first_stats.carried_prompts) == ([200, 201, 202], [203])
    assert [e.prompt_index for e in last] == [203] * samples
    assert all(sum(s.kind == "model_call" for s in e.spans) == 4 for e in last)
    assert all(e.reward is None and e.finish_reason == "stop" for e in last)
    assert (last_stats.returned_prompts, last_stats.carried_prompts) == ([203], [])
    ids = [e.episode_id for e in first + last]
    assert len(set(ids)) == len(ids) == 4 * samples


@pytest.mark.slow
def test_callers_of_one_request_each_share_engine_steps_and_hand_the_stepping_on(across_a_load):
    sharing, _ = across_a_load[5]
    # Every call ran to its max_tokens (the model has no end-of-sequence token).
    assert sharing["tokens"] == [SHORT_CALL] + [LONG_CALL] * (CALLERS - 1)
    # One step advances every caller's request: one at a time they would take
    # SHORT_CALL + 7 x LONG_CALL = 88 steps.
    assert sharing["steps"] < SHORT_CALL + 2 * LONG_CALL, sharing
    # The first caller, stepping for all, ended first: the stepping went on at once to a
    # caller it woke, never at a waiting caller's backstop.
    assert sharing["late_handoffs"] == 0, sharing


@pytest.mark.slow
def test_a_request_starts_under_the_version_of_its_first_engine_step(across_a_load):
    # Added under version 5; version 6 was loaded before the engine's first step for it:
    # every token is version 6's, and it is not older than that.
    _, first = across_a_load[5]
    assert first == (6, 6)


def error_of(call) -> str:
    """Returns "ErrorType: message" of what `call()` raised, or "no error"."""
    try:
        call()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def abandoned_mid_update(host) -> dict:
    """Runs in the host's process: generates in a thread, and after a few engine steps
    holds the engine as a weight transfer's start does; then the transfer is abandoned
    (its learner died before finishing it). Returns what that generate call met, whether
    it ended once abandoned, and what a later generate call and a later load met."""
    worker = host.rollout
    steps = worker.loop.steps + STEPS_BEFORE_LOAD
    first: dict = {}
    thread, _ = in_a_thread(lambda: first.update(error=error_of(lambda: worker.generate(ROWS, 0))))
    deadline = time.monotonic() + 120
    while worker.loop.steps < steps and time.monotonic() < deadline:
        time.sleep(0.0005)
    worker.loop.hold()  # RolloutWorker.start_weight_update's hold; no finish will come
    time.sleep(0.5)
    held_back = thread.is_alive()
    worker.abandon_weight_update("learner died during sync")
    thread.join(timeout=60)
    return {
        "held_back": held_back,
        "ended": not thread.is_alive(),
        "first": first.get("error"),
        "later": error_of(lambda: worker.generate(ROWS[:1], 0)),
        "load": error_of(lambda: worker.load_weights(9, {})),
    }


@pytest.fixture(scope="module")
def abandoned(across_a_load, rollout_host):
    """After across_a_load's calls, on its engine (which it leaves failed)."""
    return ray.get(rollout_host.__ray_call__.remote(abandoned_mid_update), timeout=300)


@pytest.mark.slow
def test_an_update_abandoned_mid_transfer_fails_the_engines_callers_instead_of_holding_them(
    abandoned,
):
    # The hold kept the generate call waiting; abandoning the update ended it at once,
    # and the engine refuses every later call, load included: its weights may be half
    # of each version.
    assert abandoned["held_back"] and abandoned["ended"], abandoned
    why = "a weight transfer was abandoned (learner died during sync)"
    for call in ("first", "later", "load"):
        assert abandoned[call].startswith("EngineFailed: rollout-"), abandoned
        assert abandoned[call].endswith(why), abandoned
