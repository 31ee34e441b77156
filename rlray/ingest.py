"""Ingestion endpoint: episodes produced elsewhere, posted over HTTP into a running job.

    POST /v1/episodes   {"episodes": [{...}, ...]} or one episode object
    GET  /v1/health     {"status": "ok", "accepted": n, "rejected": m, "duplicates": d}

An episode needs `run_id`, `episode_id`, `prompt` and `completion`; it may carry a
`reward` (else the run's rewards score it, given the `columns` they need),
`reward_components`, `columns`, `spans`, `policy_version` and token ids. Posted episodes
are validated against the episode schema, scored, stored, and — when the run allows
off-policy data (`ingest.train`) — queued for training. An episode id seen before is
acknowledged and skipped, so a retried POST never stores or trains on it twice.

Why an aiohttp server in a Ray actor rather than Ray Serve: one endpoint, one process,
no HTTP proxy or controller actors to run on a 2-core laptop; it starts with the job,
sits next to the other actors (`ingest`), and the code is ~200 lines we can read.
"""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from rlray.episode import SPAN_KINDS, Episode, Span

REQUIRED = {"run_id": str, "episode_id": str, "prompt": str, "completion": str}
OPTIONAL = {
    "reward": (int, float, type(None)),
    "reward_components": dict,
    "columns": dict,
    "spans": list,
    "policy_version": int,
    "finish_reason": str,
    "prompt_token_ids": list,
    "completion_token_ids": list,
    "rollout_logprobs": list,
    "generated_at": (int, float),
}
EXTERNAL_POLICY_VERSION = -1
"""policy_version of an episode that no rollout worker of this run produced."""


class IngestError(Exception):
    """A request the endpoint refuses: an HTTP status and a one-line reason."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def parse_episodes(body: bytes) -> list[Episode]:
    """Returns the episodes in a request body, or raises IngestError(400) naming the
    first bad field."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise IngestError(400, f"body is not valid JSON: {err}") from None
    items = data.get("episodes") if isinstance(data, dict) and "episodes" in data else data
    if isinstance(items, dict):
        items = [items]
    if not isinstance(items, list) or not items:
        raise IngestError(400, "body must be an episode object or {'episodes': [...]} (non-empty)")
    return [_episode(item, f"episodes[{i}]") for i, item in enumerate(items)]


def _episode(item: Any, where: str) -> Episode:
    if not isinstance(item, dict):
        raise IngestError(400, f"{where}: expected an object")
    unknown = sorted(set(item) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise IngestError(400, f"{where}.{unknown[0]}: unknown field")
    for name, kind in REQUIRED.items():
        if name not in item:
            raise IngestError(400, f"{where}.{name}: missing")
        _check_type(item[name], kind, f"{where}.{name}")
    for name, kind in OPTIONAL.items():
        if name in item:
            _check_type(item[name], kind, f"{where}.{name}")
    spans = [_span(span, f"{where}.spans[{i}]") for i, span in enumerate(item.get("spans", []))]
    components = item.get("reward_components", {})
    for key, value in components.items():
        _check_type(value, (int, float, type(None)), f"{where}.reward_components.{key}")
    return Episode(
        run_id=item["run_id"],
        episode_id=item["episode_id"],
        prompt_index=-1,
        sample_index=0,
        prompt=item["prompt"],
        completion=item["completion"],
        prompt_token_ids=_ints(item.get("prompt_token_ids", []), f"{where}.prompt_token_ids"),
        completion_token_ids=_ints(
            item.get("completion_token_ids", []), f"{where}.completion_token_ids"
        ),
        rollout_logprobs=[float(x) for x in item.get("rollout_logprobs", [])],
        finish_reason=item.get("finish_reason", "stop"),
        policy_version=item.get("policy_version", EXTERNAL_POLICY_VERSION),
        rollout_worker="ingest",
        columns=item.get("columns", {}),
        reward=None if item.get("reward") is None else float(item["reward"]),
        reward_components={k: None if v is None else float(v) for k, v in components.items()},
        generated_at=float(item.get("generated_at", time.time())),
        spans=spans,
    )


def _span(item: Any, where: str) -> Span:
    if not isinstance(item, dict):
        raise IngestError(400, f"{where}: expected an object")
    fields = set(Span.__dataclass_fields__)
    unknown = sorted(set(item) - fields)
    if unknown:
        raise IngestError(400, f"{where}.{unknown[0]}: unknown field")
    if item.get("kind") not in SPAN_KINDS:
        raise IngestError(400, f"{where}.kind: expected one of {', '.join(SPAN_KINDS)}")
    if "started_at" not in item:
        raise IngestError(400, f"{where}.started_at: missing")
    numbers = {"started_at", "ended_at", "value"}
    for name, value in item.items():
        kind = (int, float, type(None)) if name in numbers else (str, type(None))
        _check_type(value, kind, f"{where}.{name}")
    return Span(**item)


def _check_type(value: Any, kind: Any, where: str) -> None:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        raise IngestError(400, f"{where}: expected {_names(kinds)}, got a boolean")
    if not isinstance(value, kinds):
        raise IngestError(400, f"{where}: expected {_names(kinds)}, got {type(value).__name__}")


def _names(kinds: tuple[type, ...]) -> str:
    words = {str: "a string", int: "an integer", float: "a number", dict: "an object"}
    words |= {list: "a list", type(None): "null"}
    return " or ".join(dict.fromkeys(words.get(k, k.__name__) for k in kinds))


def _ints(values: list[Any], where: str) -> list[int]:
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise IngestError(400, f"{where}: expected a list of integers")
    return values


@dataclass
class IngestCounts:
    accepted: int = 0
    rejected: int = 0
    duplicates: int = 0
    queued_for_training: int = 0


Score = Callable[[list[Episode]], Awaitable[list[Episode]]]
Store = Callable[[list[Episode]], Awaitable[None]]
Enqueue = Callable[[list[Episode]], Awaitable[set[str]]]


class IngestService:
    """Validates, deduplicates, scores, stores and (optionally) queues posted episodes.

    `score`, `store` and `enqueue` are the run's reward, store and buffer, as async
    callables (actor calls in a job, plain objects in tests). `enqueue` returns the ids it
    queued for training: those reach the store from the buffer, with the time they were
    trained on, like the run's own episodes; the rest are stored here."""

    def __init__(self, token: str, score: Score, store: Store, enqueue: Enqueue | None):
        self.token = token
        self.score, self.store, self.enqueue = score, store, enqueue
        self.seen: set[str] = set()
        self.counts = IngestCounts()

    def check_token(self, header: str | None) -> None:
        """Raises IngestError(401) unless the bearer token matches (when one is set)."""
        if not self.token:
            return
        scheme, _, given = (header or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip(), self.token):
            raise IngestError(401, "missing or wrong bearer token")

    async def ingest(self, body: bytes) -> dict[str, int]:
        """Handles one POST body; returns what happened to its episodes."""
        episodes = parse_episodes(body)
        fresh = [e for e in _unique(episodes) if e.episode_id not in self.seen]
        duplicates = len(episodes) - len(fresh)
        self.seen.update(e.episode_id for e in fresh)  # claimed before any await
        try:
            unscored = [e for e in fresh if e.reward is None]
            scored = {e.episode_id: e for e in await self.score(unscored)} if unscored else {}
            fresh = [scored.get(e.episode_id, e) for e in fresh]
            queued = await self.enqueue(fresh) if self.enqueue and fresh else set()
            await self.store([e for e in fresh if e.episode_id not in queued])
        except Exception:
            self.seen.difference_update(e.episode_id for e in fresh)  # a retry may succeed
            raise
        self.counts.accepted += len(fresh)
        self.counts.duplicates += duplicates
        self.counts.queued_for_training += len(queued)
        return {
            "accepted": len(fresh),
            "duplicates": duplicates,
            "scored": len(unscored),
            "queued_for_training": len(queued),
        }

    def health(self) -> dict[str, Any]:
        return {"status": "ok", **self.counts.__dict__}


def _unique(episodes: list[Episode]) -> list[Episode]:
    by_id: dict[str, Episode] = {}
    for episode in episodes:
        by_id.setdefault(episode.episode_id, episode)
    return list(by_id.values())


def make_app(service: IngestService, max_body_bytes: int) -> web.Application:
    """Returns the aiohttp application serving the two routes."""

    async def post_episodes(request: web.Request) -> web.Response:
        try:
            service.check_token(request.headers.get("Authorization"))
            if (request.content_length or 0) > max_body_bytes:
                raise IngestError(413, f"body over the limit of {max_body_bytes} bytes")
            body = await request.read()
            return web.json_response(await service.ingest(body))
        except web.HTTPRequestEntityTooLarge:
            return _refuse(service, 413, f"body over the limit of {max_body_bytes} bytes")
        except IngestError as err:
            return _refuse(service, err.status, str(err))

    async def health(request: web.Request) -> web.Response:
        return web.json_response(service.health())

    app = web.Application(client_max_size=max_body_bytes)
    app.router.add_post("/v1/episodes", post_episodes)
    app.router.add_get("/v1/health", health)
    return app


def _refuse(service: IngestService, status: int, message: str) -> web.Response:
    service.counts.rejected += 1
    return web.json_response({"error": message}, status=status)
