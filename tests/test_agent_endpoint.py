"""The agent endpoint (rlray.agent.gateway) served by its actor over a real vLLM rollout
actor, called by the official `openai` client as an agent calls it: exact tokens in the
episodes, streaming, completions, refusals with a 4xx, 64 agents at once, traces that
never end."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import ray

from rlray.agent.gateway import CallLimits
from rlray.cluster.endpoints import AgentActor
from rlray.config import AgentConfig
from rlray.core.prompt import PromptRow
from rlray.data.models import resolve_model_path
from tests.rollout_host import HOST_NAME, rollout_actor

TOKEN = "agent-secret"
LIMITS = CallLimits(max_model_len=64, max_new_tokens=8, trace_tokens=24, max_calls=4)


def start_agent_actor(model: str, **config: Any) -> tuple[Any, str]:
    settings = AgentConfig(enabled=True, token=TOKEN, task_wait_s=1.0, **config)
    actor = (
        ray.remote(AgentActor)
        .options(max_concurrency=80)
        .remote(settings, TOKEN, model, [HOST_NAME], LIMITS, "tests")
    )
    return actor, ray.get(actor.url.remote(), timeout=120)


@pytest.fixture(scope="module")
def endpoint(rollout_host):
    model = resolve_model_path("builtin:tiny-arithmetic")
    with rollout_actor(rollout_host, Path(model), "float32") as host:
        actor, url = start_agent_actor(model)
        yield actor, url, host, model
        ray.kill(actor)


def rows(count: int) -> list[PromptRow]:
    return [PromptRow(f"{10 + i}+{i}=", {"answer": str(10 + 2 * i)}) for i in range(count)]


def next_task(url: str, token: str = TOKEN) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"}
    return httpx.get(f"{url}/v1/tasks/next", headers=headers, timeout=30)


def post(url: str, path: str, body: Any, token: str = TOKEN) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{url}{path}", content=content, headers=headers, timeout=30)


def batch(actor: Any, count: int, samples: int = 1) -> tuple[Any, Any]:
    return actor.run_batch.options(num_returns=2).remote(rows(count), 0, samples, 0)


def finished(refs: tuple[Any, Any]) -> tuple[list, Any]:
    episodes, stats = ray.get(list(refs), timeout=120)
    return episodes, stats


def test_an_openai_client_agent_trains_on_exactly_the_tokens_it_was_served(endpoint):
    actor, url, _, _ = endpoint
    refs = batch(actor, 2)
    served = []
    for _ in range(2):
        work = next_task(url).json()
        client = openai.OpenAI(base_url=work["base_url"], api_key=TOKEN)
        messages = [{"role": "user", "content": work["task"]["prompt"]}]
        first = client.chat.completions.create(
            model="solver", messages=messages, max_tokens=4, logprobs=True
        )
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": work["task"]["prompt"]},
        ]
        second = client.chat.completions.create(
            model="solver", messages=messages, max_tokens=4, logprobs=True
        )
        served.append((work, first, second))
        assert (
            post(url, f"/v1/traces/{work['trace_id']}/reward", {"reward": 0.5}).status_code == 200
        )
    episodes, stats = finished(refs)

    assert len(episodes) == 2 and stats.episodes == 2 and stats.traces_dropped == 0
    by_trace = {e.columns["trace_id"]: e for e in episodes}
    for work, first, second in served:
        episode = by_trace[work["trace_id"]]
        assert episode.prompt == work["task"]["prompt"]  # the char template adds nothing
        # the second call's prompt extended the first's tokens: one episode, loss-masked
        sampled = [lp.logprob for r in (first, second) for lp in r.choices[0].logprobs.content]
        mask = episode.completion_mask
        policy = [lp for lp, m in zip(episode.rollout_logprobs, mask, strict=True) if m]
        assert policy == pytest.approx(sampled)
        assert mask.count(0) == len(work["task"]["prompt"])  # the repeated user turn
        assert episode.reward == 0.5 and episode.columns["agent_role"] == "solver"
        assert episode.columns["answer"] == work["task"]["answer"]
        assert [s.kind for s in episode.spans] == ["model_call", "model_call", "reward"]
    assert stats.completion_tokens == sum(
        r.usage.completion_tokens for _, first, second in served for r in (first, second)
    )


def test_streaming_completions_n_and_an_unscored_end(endpoint):
    actor, url, _, _ = endpoint
    refs = batch(actor, 1)
    work = next_task(url).json()
    client = openai.OpenAI(base_url=work["base_url"], api_key=TOKEN)
    prompt = [{"role": "user", "content": work["task"]["prompt"]}]
    stream = client.chat.completions.create(
        model="checker", messages=prompt, max_tokens=4, stream=True
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens >= 1
    plain = client.completions.create(
        model="checker", prompt=work["task"]["prompt"], n=2, max_tokens=3
    )
    assert len(plain.choices) == 2
    streamed = client.completions.create(
        model="checker", prompt=work["task"]["prompt"], max_tokens=3, stream=True
    )
    streamed_text = "".join(c.choices[0].text for c in streamed if c.choices)
    assert post(url, f"/v1/traces/{work['trace_id']}/end", {}).status_code == 200
    episodes, _ = finished(refs)

    assert [e.completion for e in episodes[:1]] == [text]
    assert len(episodes) == 4  # the chat call, each completion choice, the streamed one
    assert all(e.reward is None for e in episodes)  # the run's reward functions score them
    assert sorted(e.completion for e in episodes[1:3]) == sorted(c.text for c in plain.choices)
    assert episodes[3].completion == streamed_text


def test_bad_requests_get_a_4xx_and_one_line_of_json_and_the_endpoint_serves_on(endpoint):
    actor, url, _, _ = endpoint
    refs = batch(actor, 1)
    work = next_task(url).json()
    trace = work["trace_id"]
    chat = f"/traces/{trace}/v1/chat/completions"
    plain = f"/traces/{trace}/v1/completions"
    reward, events = f"/v1/traces/{trace}/reward", f"/v1/traces/{trace}/events"
    good = {"model": "solver", "messages": [{"role": "user", "content": "1+1="}]}
    refusals = {
        "no token": (401, post(url, chat, good, token="wrong")),
        "bad json": (400, post(url, chat, b"{not json")),
        "unknown trace": (404, post(url, "/traces/nope/v1/chat/completions", good)),
        "oversize": (413, post(url, chat, b" " * 2_000_000)),
        "long prompt": (
            400,
            post(url, chat, {**good, "messages": [{"role": "user", "content": "1+" * 40}]}),
        ),
        "unknown field": (400, post(url, chat, {**good, "beam_width": 3})),
        "bad reward": (400, post(url, f"/v1/traces/{trace}/reward", {"reward": "high"})),
        "reward beyond the limit": (400, post(url, reward, {"reward": 1e308})),
        "component beyond the limit": (
            400,
            post(url, reward, {"reward": 1.0, "components": {"x": 1e308}}),
        ),
        "integer beyond a float": (400, post(url, reward, b'{"reward": 1' + b"0" * 400 + b"}")),
        "integer of 5000 digits": (400, post(url, reward, b'{"reward": 1' + b"0" * 5000 + b"}")),
        "event value beyond the limit": (400, post(url, events, {"name": "v", "value": 1e308})),
        "prompt of no tokens": (400, post(url, plain, {"model": "solver", "prompt": "é€"})),
    }
    for what, (status, response) in refusals.items():
        assert response.status_code == status, what
        assert "\n" not in response.text.strip(), what
        assert response.json()["error"]["message"], what
    client = openai.OpenAI(base_url=work["base_url"], api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(**good)
    # Events are bounded per trace, in bytes and in count.
    assert post(url, events, {"name": "big", "detail": "x" * 300_000}).status_code == 413
    flood = [post(url, events, {"name": "vote", "detail": "x" * 3000}) for _ in range(70)]
    codes = [r.status_code for r in flood]
    assert codes[: LIMITS.max_events] == [200] * LIMITS.max_events and set(codes[64:]) == {400}
    assert "posted its 64 events" in flood[-1].json()["error"]["message"]
    assert post(url, f"/v1/traces/{trace}/reward", {"reward": 1.0}).status_code == 200
    after = post(url, chat, good)
    assert after.status_code == 409 and "ended" in after.json()["error"]["message"]
    assert finished(refs)[1].traces_dropped == 0
    health = httpx.get(f"{url}/v1/health", headers={"Authorization": f"Bearer {TOKEN}"})
    assert health.status_code == 200


def test_every_call_samples_as_the_run_does_and_a_bad_prompt_fails_no_other_call(endpoint):
    actor, url, _, _ = endpoint
    refs = batch(actor, 2)
    first, second = (next_task(url).json() for _ in range(2))
    asked = {"model": "solver", "temperature": 0.3, "max_tokens": 1000}
    good = {**asked, "messages": [{"role": "user", "content": "1+1="}]}
    bad = {"model": "solver", "prompt": "é€"}  # no tokens to the model
    answers: dict[str, httpx.Response] = {}
    # Sent at once, so that the endpoint may join them into one engine call.
    threads = [
        threading.Thread(
            target=lambda: answers.update(
                good=post(url, f"/traces/{first['trace_id']}/v1/chat/completions", good)
            )
        ),
        threading.Thread(
            target=lambda: answers.update(
                bad=post(url, f"/traces/{second['trace_id']}/v1/completions", bad)
            )
        ),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert answers["bad"].status_code == 400
    assert answers["good"].status_code == 200
    # The run's temperature (1), and its per-call limit, whatever the agent asked.
    headers = answers["good"].headers
    assert (headers["X-RLray-Temperature"], headers["X-RLray-Max-Tokens"]) == ("1", "8")
    for work in (first, second):
        assert (
            post(url, f"/v1/traces/{work['trace_id']}/reward", {"reward": 0.0}).status_code == 200
        )
    episodes, _ = finished(refs)
    assert len(episodes) == 1  # the good call's; the refused one made none


def test_64_concurrent_agents_lose_and_double_no_trace(endpoint):
    actor, url, _, _ = endpoint
    refs = batch(actor, 32, samples=2)
    taken: list[str] = []
    errors: list[BaseException] = []

    def agent() -> None:
        try:
            work = next_task(url).json()
            taken.append(work["trace_id"])
            client = openai.OpenAI(base_url=work["base_url"], api_key=TOKEN)
            messages = [{"role": "user", "content": work["task"]["prompt"]}]
            client.chat.completions.create(model="solver", messages=messages, max_tokens=4)
            post(url, f"/v1/traces/{work['trace_id']}/reward", {"reward": 1.0})
        except BaseException as err:
            errors.append(err)

    agents = [threading.Thread(target=agent) for _ in range(64)]
    for thread in agents:
        thread.start()
    for thread in agents:
        thread.join(timeout=180)
    episodes, stats = finished(refs)

    assert not errors, errors[:3]
    assert len(taken) == len(set(taken)) == 64
    assert sorted(e.columns["trace_id"] for e in episodes) == sorted(taken)
    assert sorted((e.prompt_index, e.sample_index) for e in episodes) == [
        (i, s) for i in range(32) for s in range(2)
    ]
    assert stats.traces_dropped == 0


def test_a_trace_never_ended_is_dropped_and_counted_never_trained(endpoint):
    *_, model = endpoint
    actor, url = start_agent_actor(model, trace_timeout_s=2.0)
    try:
        refs = batch(actor, 1, samples=2)
        kept, abandoned = next_task(url).json(), next_task(url).json()
        for work in (kept, abandoned):
            client = openai.OpenAI(base_url=work["base_url"], api_key=TOKEN)
            messages = [{"role": "user", "content": work["task"]["prompt"]}]
            client.chat.completions.create(model="solver", messages=messages, max_tokens=2)
        assert post(url, f"/v1/traces/{kept['trace_id']}/reward", {"reward": 1.0}).is_success
        episodes, stats = finished(refs)
        assert [e.columns["trace_id"] for e in episodes] == [kept["trace_id"]]
        assert stats.traces_dropped == 1
        late = post(url, f"/v1/traces/{abandoned['trace_id']}/reward", {"reward": 1.0})
        assert late.status_code == 409 and "dropped" in late.json()["error"]["message"]
    finally:
        ray.kill(actor)


def test_tasks_wait_for_work_then_end_when_the_run_needs_no_more(endpoint):
    *_, model = endpoint
    actor, url = start_agent_actor(model)
    try:
        waiting = next_task(url)  # no batch yet: after agent.task_wait_s, ask again
        assert waiting.status_code == 503 and waiting.headers["Retry-After"] == "1"
        ray.get(actor.close.remote(), timeout=30)
        assert next_task(url).status_code == 204
    finally:
        ray.kill(actor)


def test_closing_drops_the_open_traces_and_the_batch_returns_the_rewarded_one_at_once(endpoint):
    # A run that stops (SIGTERM, or its last step) while agents are gone waits for none.
    *_, model = endpoint
    actor, url = start_agent_actor(model)  # trace_timeout_s: 300 s
    try:
        refs = batch(actor, 2, samples=2)  # four traces
        rewarded, abandoned = next_task(url).json(), next_task(url).json()
        for work in (rewarded, abandoned):
            client = openai.OpenAI(base_url=work["base_url"], api_key=TOKEN)
            messages = [{"role": "user", "content": work["task"]["prompt"]}]
            client.chat.completions.create(model="solver", messages=messages, max_tokens=2)
        assert post(url, f"/v1/traces/{rewarded['trace_id']}/reward", {"reward": 1.0}).is_success
        ray.get(actor.close.remote(), timeout=30)
        episodes, stats = ray.get(list(refs), timeout=10)  # no trace timeout waited for
        assert [e.columns["trace_id"] for e in episodes] == [rewarded["trace_id"]]
        assert stats.traces_dropped == 3  # the abandoned one and the two never handed out
        late = post(url, f"/v1/traces/{abandoned['trace_id']}/reward", {"reward": 1.0})
        assert late.status_code == 409 and "dropped" in late.json()["error"]["message"]
    finally:
        ray.kill(actor)
