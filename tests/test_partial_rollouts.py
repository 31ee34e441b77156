"""Partial rollouts on real vLLM (rlray.rollout.partial; the session's rollout host,
tests/rollout_host.py): a colocated engine's turn ends with a few groups still running,
they stay in the engine across a weight load, and a later call returns them whole, each
sample with the versions its tokens came from; no group is lost or returned twice.

The model is the embedded one without its end-of-sequence token (tests/test_in_flight.py),
so a request's length is its max_tokens, and the tail is chosen by the test.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import ray

from rlray.config import Config
from rlray.core.prompt import PromptRow
from rlray.data.models import resolve_model_path
from tests.rollout_host import ROLLOUT, rollout_actor
from tests.test_in_flight import noisy, without_end_of_sequence

ROWS = [PromptRow(f"{a}+{a + 1}=", {"answer": str(2 * a + 1)}) for a in range(8)]
SHORT, LONG = 4, 30  # tokens: every request runs exactly this long
SAMPLES = ROLLOUT.samples_per_prompt


def group_requests(worker, index: int, max_tokens: int) -> list:
    """Returns the requests of prompt `index`'s group as the worker makes them, each
    running `max_tokens` tokens."""
    requests = worker._group_requests(ROWS[index % len(ROWS)], index, SAMPLES, 1.0, 0)
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
    for index in range(4):
        partial.add(index, group_requests(worker, index, LONG if index == 3 else SHORT))
    first = partial.take([0, 1, 2, 3], may_leave=1, carry_floor=0)
    carried = {i: len(g.outputs) for i, g in partial.groups.items()}
    steps_before_load = worker.loop.steps
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
        "in_flight_loads": worker.loop.updates_in_flight,
        "steps_before_load": steps_before_load,
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


@pytest.fixture(scope="module")
def partial_runs(rollout_host, tmp_path_factory):
    embedded = Path(resolve_model_path(Config().model.path))
    path = without_end_of_sequence(embedded, tmp_path_factory.mktemp("model") / embedded.name)
    rollout = replace(ROLLOUT, in_flight_updates=True, max_new_tokens=SHORT)
    old, new = noisy(path, seed=0), noisy(path, seed=1)
    with rollout_actor(rollout_host, path, "float32", rollout=rollout) as host:
        across = ray.get(host.__ray_call__.remote(carry_across_a_load, old, new), timeout=300)
        calls = ray.get(host.__ray_call__.remote(generate_carrying_calls), timeout=300)
        yield across, calls


@pytest.mark.slow
def test_a_turn_ends_with_the_long_group_running_and_the_next_returns_it_whole(partial_runs):
    across, _ = partial_runs
    # The first turn (a run's first: nothing held before it, so it may be short)
    # returned the three short groups, all under version 0, and stopped with the long
    # one part-way (each of its samples a request still running).
    assert [index for index, _ in across["first"]] == [0, 1, 2]
    assert all(v == [(0, 0)] * SAMPLES for _, v in across["first"])
    assert across["carried"] == {3: 0}
    assert across["in_flight_loads"] == 1  # the load found requests running
    # The second turn had to finish it (it started under 0 < the floor 1) and returns a
    # batch's worth: the oldest two whole groups, the long one first, its tokens from
    # both versions. Group 5, whole under version 1, waits for the next call.
    assert across["second"] == [(3, [(0, 1)] * SAMPLES), (4, [(1, 1)] * SAMPLES)]
    assert across["held_after"] == [5]
    assert across["rest"] == [(5, [(1, 1)] * SAMPLES)]
    assert across["lengths"][3] == [LONG] * SAMPLES  # whole: none cut at the turn's end
    assert all(across["lengths"][i] == [SHORT] * SAMPLES for i in (0, 1, 2, 4, 5))


@pytest.mark.slow
def test_generate_carrying_returns_each_group_once_and_says_what_it_still_holds(partial_runs):
    _, ((first, first_stats), (last, last_stats)) = partial_runs
    assert sorted({e.prompt_index for e in first}) == [0, 1, 2, 3]
    assert len(first) == 4 * SAMPLES
    assert (first_stats.first_prompt_index, first_stats.carried_from) == (0, 100)
    assert first_stats.episodes == len(first)
    # The call that finishes what is held returns the long group alone, whole.
    assert [e.prompt_index for e in last] == [100] * SAMPLES
    assert all(len(e.completion_token_ids) == LONG for e in last)
    assert (last_stats.first_prompt_index, last_stats.carried_from) == (100, None)
    ids = [e.episode_id for e in first + last]
    assert len(set(ids)) == len(ids)
