"""A trace's calls become episodes token for token (rlray.agent.traces): merged where one
call's prompt extends an earlier episode exactly, separate otherwise, with the trace's
reward, spans and versions."""

from __future__ import annotations

from rlray.agent.traces import Call, Trace, trace_episodes
from rlray.config import RewardSpec
from rlray.core.episode import Span
from rlray.core.groups import trace_spans
from rlray.core.prompt import PromptRow
from rlray.episodes.reader import find_episode, format_trace, read
from rlray.episodes.store import EpisodeStore
from rlray.rewards.worker import RewardWorker
from rlray.rollout.sampling import Generated
from tests.test_episode import make_episode

EOS = 1


def decode(ids: list[int]) -> str:
    return "".join(f"<{i}>" for i in ids)


def call(
    call_id: str,
    prompt: list[int],
    sampled: list[int],
    role: str = "solver",
    versions: tuple[int, int] = (0, 0),
) -> Call:
    logprobs = [-0.1 * (i + 1) for i in range(len(sampled))]
    generated = Generated(sampled, logprobs, decode(sampled), "stop", [], *versions)
    return Call(call_id, role, decode(prompt), prompt, generated, 1.0, 2.0)


def new_trace(*calls: Call) -> Trace:
    trace = Trace("t1", PromptRow("12+3=", {"answer": "15"}), 7, 2, 0, handed_out_at=0.0)
    for c in calls:
        trace.add_call([c], "user: 12+3=")
    return trace


def test_a_call_that_extends_the_last_one_token_for_token_continues_its_episode():
    first = call("c0", [5, 6, 7], [8, 9, EOS], versions=(3, 3))
    # the agent's next prompt: everything so far, then a new user turn [5, 6]
    second = call("c1", [5, 6, 7, 8, 9, EOS, 5, 6], [4, EOS], versions=(3, 4))
    trace = new_trace(first, second)
    trace.end(1.0, {"correct": 1.0}, 3.0)

    (episode,) = trace_episodes(trace, "run", "rollout-0", decode, 3.0)

    assert episode.prompt_token_ids == [5, 6, 7]
    assert episode.completion_token_ids == [8, 9, EOS, 5, 6, 4, EOS]
    assert episode.completion_mask == [1, 1, 1, 0, 0, 1, 1]
    assert episode.rollout_logprobs == [-0.1, -0.2, -0.1 * 3, 0.0, 0.0, -0.1, -0.2]
    assert episode.completion == "<8><9><1><5><6><4><1>"
    assert (episode.policy_version, episode.last_policy_version) == (3, 4)
    assert (episode.prompt_index, episode.sample_index) == (7, 2)
    assert episode.reward == 1.0 and episode.reward_components == {"correct": 1.0}
    assert episode.columns == {"answer": "15", "trace_id": "t1", "agent_role": "solver"}
    assert [s.kind for s in episode.spans] == ["model_call", "model_call", "reward"]


def test_calls_that_do_not_extend_an_episode_exactly_are_episodes_of_their_own():
    solver = call("c0", [5, 6, 7], [8, EOS])
    checker = call("c1", [5, 6, 7], [9, EOS], role="checker")  # another conversation
    retokenised = call("c2", [5, 6, 7, 8, 5, 6], [4, EOS])  # EOS lost: not the same tokens
    other_role = call("c3", [5, 6, 7, 8, EOS, 2], [4], role="checker")
    trace = new_trace(solver, checker, retokenised, other_role)
    trace.end(None, {}, 3.0)

    episodes = trace_episodes(trace, "run", "rollout-0", decode, 3.0)

    assert [e.completion_token_ids for e in episodes] == [[8, EOS], [9, EOS], [4, EOS], [4]]
    assert all(e.completion_mask == [] for e in episodes)  # single calls: all the policy's
    assert [e.columns["agent_role"] for e in episodes] == ["solver", "checker"] * 2
    assert len({e.episode_id for e in episodes}) == 4
    assert all(e.reward is None for e in episodes)  # ended unscored: the run's rewards score


def test_a_per_call_reward_overrides_the_trace_reward_for_its_episode():
    trace = new_trace(call("c0", [5], [8]), call("c1", [6], [9]))
    trace.call_rewards = {"c1": 0.25}
    trace.end(1.0, {}, 3.0)
    episodes = trace_episodes(trace, "run", "rollout-0", decode, 3.0)
    assert [e.reward for e in episodes] == [1.0, 0.25]


def test_a_dropped_trace_makes_no_episode():
    trace = new_trace(call("c0", [5], [8]))
    trace.ended = trace.dropped = True
    assert trace_episodes(trace, "run", "rollout-0", decode, 3.0) == []


def test_tool_results_become_tool_call_spans_once_however_often_they_are_sent_again():
    trace = new_trace()
    messages = [
        {"role": "user", "content": "add"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call_0", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_0", "content": "3"},
    ]
    trace.add_tool_results(messages, 1.0)
    trace.add_tool_results([*messages, {"role": "user", "content": "again"}], 2.0)
    (span,) = trace.spans
    assert (span.kind, span.name, span.arguments, span.result) == (
        "tool_call",
        "add",
        '{"a": 1, "b": 2}',
        "3",
    )


def test_events_are_spans_in_the_order_they_came():
    trace = new_trace(call("c0", [5], [8]))
    trace.add_event("agree", "round 1", 1.0, 2.5)
    trace.end(0.5, {}, 3.0)
    kinds = [(s.kind, s.name) for s in trace.spans]
    assert kinds == [("model_call", "solver"), ("event", "agree"), ("reward", None)]


def test_a_traces_spans_are_stored_once_and_every_episode_reads_them(tmp_path):
    """A trace's events and calls are stored with its first episode only (an agent's 20
    events of 500 kB would otherwise be stored once per episode), and every episode of the
    trace still reads them: in the reward that takes `spans`, and in the store's reader."""
    trace = new_trace(call("c0", [5], [8]), call("c1", [6], [9]), call("c2", [7], [4]))
    trace.add_event("note", "x" * 1000, None, 1.0)
    trace.spans += [
        Span("tool_call", 1.0, 1.5, name="add", result="3"),
        Span("tool_call", 1.5, 2.0, name="add", error="ValueError"),
    ]
    trace.end(None, {}, 3.0)
    episodes = trace_episodes(trace, "run", "rollout-0", decode, 3.0)
    assert [len(e.spans) for e in episodes] == [len(trace.spans), 0, 0]
    assert trace_spans(episodes) == [trace.spans] * 3
    alone = make_episode(episode_id="other", spans=[Span("reward", 1.0, 1.0, value=0.5)])
    assert trace_spans([alone, *episodes[1:]])[0] == alone.spans

    # The reward worker scores in chunks of one: the later episodes' chunks hold no spans.
    worker = RewardWorker("reward-0", [RewardSpec(name="tool_success")], batch_size=1)
    scored, _ = worker.score(episodes)
    assert [e.reward for e in scored] == [0.5, 0.5, 0.5]  # one of the trace's two calls failed

    store = EpisodeStore(tmp_path, "run")
    store.append(episodes)
    store.flush()
    table = read(tmp_path)
    for e in episodes:
        shown = find_episode(table, e.episode_id)
        assert shown is not None and shown.spans == trace.spans
        assert "event      note" in format_trace(shown)
    assert find_episode(table, "no-such-episode") is None
