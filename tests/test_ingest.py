"""The ingestion endpoint over real HTTP: validation, auth, limits, idempotent retries,
scoring, storing and queueing for training (with the run's real reward, store, buffer)."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from dataclasses import dataclass

import pytest

from rlray.cluster.serving import ThreadedServer
from rlray.config import Config, ConfigError, RewardSpec, validate
from rlray.core.episode import ModelLimits
from rlray.episodes.buffer import BufferedBatch, EpisodeBuffer
from rlray.episodes.ingest import IngestError, IngestService, make_app, parse_episodes
from rlray.episodes.reader import read
from rlray.episodes.store import EpisodeStore
from rlray.rewards.worker import RewardWorker
from tests.conftest import free_port

TOKEN = "s3cret"


@dataclass
class Endpoint:
    url: str
    service: IngestService
    store: EpisodeStore
    buffer: EpisodeBuffer


@pytest.fixture
def endpoint(tmp_path):
    scorer = RewardWorker("reward-0", [RewardSpec("exact_match")])
    store = EpisodeStore(tmp_path / "episodes", "ext", rows_per_file=1000, flush_every_s=3600)
    buffer = EpisodeBuffer(capacity_episodes=8, max_staleness=0)

    async def score(episodes):
        return scorer.score(episodes)[0]

    async def save(episodes):
        store.append(episodes)

    async def enqueue(episodes):
        trainable = [e for e in episodes if e.reward is not None and e.columns.get("train")]
        if not trainable or not buffer.reserve(len(trainable)):
            return set()
        buffer.add(BufferedBatch([trainable], -1, len(trainable), -1, batch_id=0, external=True))
        return {e.episode_id for e in trainable}

    service = IngestService(TOKEN, score, save, enqueue, ledger=tmp_path / "ledger")
    server = ThreadedServer(make_app(service, max_body_bytes=4096), "127.0.0.1", 0)
    yield Endpoint(server.url, service, store, buffer)
    server.stop()


def request(url: str, body: bytes | None = None, token: str | None = TOKEN) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    method = "POST" if body is not None else "GET"
    req = urllib.request.Request(url, data=body, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def episode(episode_id: str, **fields) -> dict:
    return {
        "run_id": "ext",
        "episode_id": episode_id,
        "prompt": "2+2=",
        "completion": "4",
        **fields,
    }


def post(endpoint: Endpoint, payload, token: str | None = TOKEN) -> tuple[int, dict]:
    return request(f"{endpoint.url}/v1/episodes", json.dumps(payload).encode(), token)


def test_posted_episodes_are_scored_stored_and_queued(endpoint):
    spans = [{"kind": "tool_call", "started_at": 1.5, "name": "calc", "arguments": '{"a": 2}'}]
    payload = {
        "episodes": [
            episode("a", columns={"answer": "4"}, spans=spans),  # scored by the run's reward
            episode("b", reward=0.25, reward_components={"judge": 0.25}, columns={"train": 1}),
        ]
    }
    status, answer = post(endpoint, payload)
    assert status == 200
    assert answer == {"accepted": 2, "duplicates": 0, "scored": 1, "queued_for_training": 1}
    endpoint.store.flush()
    # Stored now: what is not queued. The queued one is stored once trained (or at the end).
    (stored,) = read(endpoint.store.root).to_pylist()
    assert stored["episode_id"] == "a" and stored["reward"] == 1.0
    assert dict(stored["reward_components"]) == {"exact_match": 1.0}
    assert stored["spans"][0]["name"] == "calc" and stored["policy_version"] == -1
    # Off-policy by design: a learner far ahead does not drop it as stale.
    taken = endpoint.buffer.take(1, learner_version=50)
    assert taken is not None and taken.dropped == []
    (queued,) = taken.batches[0].ref[0]
    assert queued.episode_id == "b" and queued.reward == 0.25


def test_a_retried_post_is_neither_stored_nor_queued_twice(endpoint):
    payload = [episode("x", reward=1.0, columns={"train": 1}), episode("y", reward=0.0)]
    assert post(endpoint, payload)[1]["accepted"] == 2
    status, answer = post(endpoint, payload)
    assert status == 200 and answer["accepted"] == 0 and answer["duplicates"] == 2
    endpoint.store.flush()
    assert read(endpoint.store.root).column("episode_id").to_pylist() == ["y"]
    assert endpoint.buffer.stats()["buffer_depth"] == 1


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b"{not json", 400, "body is not valid JSON"),
        (b"[]", 400, "body must be an episode object"),
        (
            json.dumps({"run_id": "r", "episode_id": "e", "prompt": "p"}),
            400,
            "episodes[0].completion: missing",
        ),
        (
            json.dumps(episode("e", reward="high")),
            400,
            "episodes[0].reward: expected a number or null, got str",
        ),
        (json.dumps(episode("e", prompt=7)), 400, "episodes[0].prompt: expected a string, got int"),
        (
            json.dumps(episode("e", reward=True)),
            400,
            "episodes[0].reward: expected a number or null, got a boolean",
        ),
        (json.dumps(episode("e", colour="red")), 400, "episodes[0].colour: unknown field"),
        (
            json.dumps(episode("e", spans=[{"kind": "dream", "started_at": 1}])),
            400,
            "episodes[0].spans[0].kind: expected one of",
        ),
        (json.dumps(episode("e", completion="x" * 5000)), 413, "body over the limit of 4096 bytes"),
        (b"[" * 2000 + b"]" * 2000, 400, "body is nested too deeply"),
    ],
    ids=[
        "malformed",
        "empty",
        "missing",
        "wrong-type",
        "prompt-type",
        "bool",
        "unknown",
        "span",
        "oversized",
        "nested-too-deep",
    ],
)
def test_bad_requests_get_a_4xx_with_a_message(endpoint, body, status, message):
    body = body if isinstance(body, bytes) else body.encode()
    got_status, answer = request(f"{endpoint.url}/v1/episodes", body)
    assert got_status == status
    assert message in answer["error"]
    assert request(f"{endpoint.url}/v1/health")[0] == 200  # still serving


def test_a_service_started_again_on_its_ledger_stores_a_retry_once(endpoint, tmp_path):
    """A restarted endpoint reads back the ids its earlier process accepted: the retry
    of a POST whose answer was lost with that process is a duplicate."""
    payload = [episode("before", reward=1.0), episode("also", reward=0.0)]
    assert post(endpoint, payload)[1]["accepted"] == 2
    stored = []

    async def save(episodes):
        stored.extend(episodes)

    again = IngestService(TOKEN, None, save, None, ledger=endpoint.service.ledger)
    body = json.dumps({"episodes": [*payload, episode("new", reward=1.0)]}).encode()
    answer = asyncio.run(again.ingest(body))
    assert (answer["accepted"], answer["duplicates"]) == (1, 2)
    assert [e.episode_id for e in stored] == ["new"]


def test_requests_without_the_token_are_refused(endpoint):
    assert post(endpoint, episode("t", reward=1.0), token=None)[0] == 401
    status, answer = post(endpoint, episode("t", reward=1.0), token="wrong")
    assert status == 401 and answer["error"] == "missing or wrong bearer token"
    assert endpoint.store.stats().buffered == 0


def test_health_counts_accepted_rejected_and_duplicates(endpoint):
    post(endpoint, episode("h", reward=1.0))
    post(endpoint, episode("h", reward=1.0))
    post(endpoint, {"nope": 1})
    status, health = request(f"{endpoint.url}/v1/health")
    assert status == 200
    assert health == {
        "status": "ok",
        "accepted": 1,
        "rejected": 1,
        "duplicates": 1,
        "queued_for_training": 0,
    }


def test_binding_beyond_loopback_needs_a_token(monkeypatch):
    monkeypatch.delenv("RLRAY_INGEST_TOKEN", raising=False)
    config = Config()
    config.ingest.enabled, config.ingest.host = True, "0.0.0.0"
    with pytest.raises(ConfigError, match=r"ingest\.host: serving 0\.0\.0\.0 needs a token"):
        validate(config)
    monkeypatch.setenv("RLRAY_INGEST_TOKEN", "t")
    validate(config)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"prompt_token_ids": [1, 2**31]},
            "episodes[0].prompt_token_ids[1]: 2147483648 is outside int32",
        ),
        (
            {"policy_version": 2**63},
            "episodes[0].policy_version: 9223372036854775808 is outside int64",
        ),
        ({"generated_at": 1e300}, "episodes[0].generated_at: 1e+300 is not a time"),
        ({"reward": float("nan")}, "episodes[0].reward: nan is not finite"),
        (
            {"reward_components": {"judge": float("inf")}},
            "reward_components.judge: inf is not finite",
        ),
        (
            {"rollout_logprobs": [-1e40]},
            "episodes[0].rollout_logprobs[0]: -1e+40 is beyond float32",
        ),
        ({"episode_id": ""}, "episodes[0].episode_id: empty"),
        ({"run_id": " "}, "episodes[0].run_id: empty"),
        (
            {"spans": [{"kind": "reward", "started_at": 1, "colour": 2}]},
            "spans[0].colour: unknown field",
        ),
        ({"spans": ["x"]}, "episodes[0].spans[0]: expected an object, got str"),
        (
            {"policy_version": -5},
            "episodes[0].policy_version: -5 is neither -1 (made elsewhere) nor a version of "
            "this run's policy (0 to 0)",
        ),
        ({"policy_version": 10**15}, "episodes[0].policy_version: 1000000000000000 is neither"),
    ],
)
def test_values_the_store_or_learner_would_crash_on_get_a_400(endpoint, fields, message):
    # json.dumps writes NaN and Infinity, as some clients do; Python's json reads them.
    status, answer = post(endpoint, episode("p", reward=1.0) | fields)
    assert status == 400 and message in answer["error"], answer
    assert endpoint.service.counts.accepted == 0 and endpoint.store.stats().buffered == 0


def test_a_lone_surrogate_gets_a_400(endpoint):
    body = json.dumps(episode("s", reward=1.0)).replace('"2+2="', '"\\ud800"').encode()
    status, answer = request(f"{endpoint.url}/v1/episodes", body)
    assert (status, answer["error"]) == (
        400,
        "episodes[0].prompt: not valid Unicode (surrogates not allowed)",
    )


def test_episodes_the_model_cannot_take_get_a_400():
    stored = []

    async def save(episodes):
        stored.extend(episodes)

    def tokenize(episodes):  # a character tokenizer: one token per character
        for e in episodes:
            e.prompt_token_ids = e.prompt_token_ids or [ord(c) % 50 for c in e.prompt]

    limits = ModelLimits(vocab_size=50, max_model_len=8)
    service = IngestService("", None, save, None, limits=limits, tokenize=tokenize)
    ok = episode("ok", reward=1.0, completion_token_ids=[3, 4])
    asyncio.run(service.ingest(json.dumps(ok).encode()))
    cases = [
        (
            episode("v", reward=1.0, completion_token_ids=[3, 50]),
            "episodes[0].completion_token_ids[1]: token id 50 is outside the model's "
            "vocabulary (0 to 49)",
        ),
        (
            episode("w", reward=1.0, completion_token_ids=[3] * 5),
            "episodes[0].completion_token_ids: 4 prompt + 5 completion tokens exceed the "
            "context window (model.max_model_len=8)",
        ),
        (episode("r", reward=1e300), "episodes[0].reward: 1e+300 is beyond ±1e+15"),
        (
            episode("l", reward=1.0, completion_token_ids=[3, 4], rollout_logprobs=[-0.5]),
            "episodes[0].rollout_logprobs: 1 entries for 2 completion tokens",
        ),
        (
            episode("m", reward=1.0, completion_token_ids=[3], rollout_logprobs=[0.5]),
            "episodes[0].rollout_logprobs: 0.5 is not a log-probability",
        ),
    ]
    for body, message in cases:
        with pytest.raises(IngestError) as caught:
            asyncio.run(service.ingest(json.dumps(body).encode()))
        assert caught.value.status == 400 and str(caught.value).startswith(message)
    assert [e.episode_id for e in stored] == ["ok"]


def test_the_ingest_actor_checks_posted_episodes_against_the_runs_model(caplog):
    from rlray.cluster.endpoints import IngestActor
    from rlray.config import IngestConfig
    from rlray.data.models import model_limits, resolve_model_path

    path = resolve_model_path(Config().model.path)
    limits = model_limits(path, 8)
    config = IngestConfig(train=True, port=free_port())
    actor = IngestActor(config, "", path, [], None, None, limits)
    actor.server.stop()  # it serves from its constructor; this test calls its service
    # Posted without token ids: tokenized (a character each, <eos> last), then checked.
    long = episode("long", prompt="12+34=", completion="46+1", reward=1.0)
    with pytest.raises(IngestError, match=r"6 prompt \+ 5 completion tokens exceed the context"):
        asyncio.run(actor.service.ingest(json.dumps(long).encode()))
    out_of_vocab = episode("v", reward=1.0, prompt_token_ids=[1], completion_token_ids=[20])
    with pytest.raises(IngestError, match=r"token id 20 is outside the model's vocabulary"):
        asyncio.run(actor.service.ingest(json.dumps(out_of_vocab).encode()))
    # Token ids that read as another text than the one posted with them.
    forged = episode("f", reward=1.0, prompt="1+1=", completion="2")
    token_ids = actor.service.tokenize.tokenizer(["9*9=", "2"]).input_ids
    forged |= {"prompt_token_ids": token_ids[0], "completion_token_ids": token_ids[1]}
    with pytest.raises(IngestError, match=r"prompt_token_ids: read as '9\*9=', not as the"):
        asyncio.run(actor.service.ingest(json.dumps(forged).encode()))
    forged["prompt"] = "9*9="
    actor.service.check_tokens(parse_episodes(json.dumps(forged).encode()))  # they agree
    posted = [episode(f"e{i}", prompt=f"1+1= été {i}", completion="2") for i in range(3)]
    with caplog.at_level("WARNING", logger="rlray.episodes.ingest"):
        actor.service.tokenize(parse_episodes(json.dumps(posted).encode()))
    warnings = [r.getMessage() for r in caplog.records if "lose characters" in r.getMessage()]
    assert warnings == [
        "ingest: posted prompts lose characters to the model's tokenizer, e.g. "
        "'1+1= été 0' (episode e0) reads as '1+1=0'"
    ]
