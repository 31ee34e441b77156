"""Ingestion endpoint: episodes produced elsewhere, posted over HTTP into a running job.

    POST /v1/episodes   {"episodes": [{...}, ...]} or one episode object
    GET  /v1/health     {"status": "ok", "accepted": n, "rejected": m, "duplicates": d}

An episode needs `run_id`, `episode_id`, `prompt` and `completion`; it may carry a
`reward` (else the run's rewards score it, given the `columns` they need),
`reward_components`, `reward_details`, `columns`, `spans`, `policy_version` and token
ids. Posted episodes are validated against the episode schema, scored, stored, and —
when the run allows off-policy data (`ingest.train`) — queued for training. An episode id
seen before is acknowledged and skipped, so a retried POST never stores or trains on it
twice.

Why an aiohttp server in a Ray actor rather than Ray Serve: one endpoint, one process,
no HTTP proxy or controller actors to run on a 2-core laptop; it starts with the job,
sits next to the other actors (`ingest`), and the code is ~200 lines we can read.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from rlray.core.episode import (
    Episode,
    EpisodeError,
    ModelLimits,
    Span,
    check_rollout_logprobs,
    validate_episode,
    validate_episodes,
)
from rlray.data.models import read_as

logger = logging.getLogger(__name__)

REQUIRED = ("run_id", "episode_id", "prompt", "completion")
EXTERNAL_POLICY_VERSION = -1
"""policy_version of an episode that no rollout worker of this run produced."""
OPTIONAL = {  # what a client may post besides REQUIRED, and what it defaults to
    "reward": None,
    "reward_components": dict,
    "reward_details": dict,
    "columns": dict,
    "spans": list,
    "policy_version": EXTERNAL_POLICY_VERSION,
    "finish_reason": "stop",
    "prompt_token_ids": list,
    "completion_token_ids": list,
    "rollout_logprobs": list,
    "completion_mask": list,
    "generated_at": time.time,
}


class IngestError(Exception):
    """A request the endpoint refuses: an HTTP status and a one-line reason."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def parse_episodes(body: bytes) -> list[Episode]:
    """Returns the episodes in a request body, or raises IngestError(400) naming the
    first bad field. Types and ranges are EPISODE_SCHEMA's (rlray.core.episode.validate_episode)."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise IngestError(400, f"body is not valid JSON: {err}") from None
    except RecursionError:  # the decoder recurses once per level
        raise IngestError(400, "body is nested too deeply") from None
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
    for name in REQUIRED:
        if name not in item:
            raise IngestError(400, f"{where}.{name}: missing")
    for i, span in enumerate(item.get("spans") or []):
        extra = sorted(set(span) - set(Span.__dataclass_fields__)) if isinstance(span, dict) else []
        if extra:
            raise IngestError(400, f"{where}.spans[{i}].{extra[0]}: unknown field")
    values = {
        name: item[name] if name in item else (default() if callable(default) else default)
        for name, default in OPTIONAL.items()
    }
    episode = Episode(
        **{name: item[name] for name in REQUIRED},
        **values,
        prompt_index=-1,
        sample_index=0,
        rollout_worker="ingest",
    )
    try:
        validate_episode(episode, where=where)
    except EpisodeError as err:
        raise IngestError(400, str(err)) from None
    return _as_floats(episode)


def _as_floats(episode: Episode) -> Episode:
    """Returns the validated episode with its numbers as the Episode type has them
    (JSON's 1 is a float reward) and its spans as Spans."""
    if episode.reward is not None:
        episode.reward = float(episode.reward)
    episode.reward_components = {
        k: None if v is None else float(v) for k, v in episode.reward_components.items()
    }
    episode.rollout_logprobs = [float(x) for x in episode.rollout_logprobs]
    episode.generated_at = float(episode.generated_at)
    episode.spans = [Span(**span) for span in episode.spans]
    return episode


@dataclass
class IngestCounts:
    accepted: int = 0
    rejected: int = 0
    duplicates: int = 0
    queued_for_training: int = 0


Score = Callable[[list[Episode]], Awaitable[list[Episode]]]
Store = Callable[[list[Episode]], Awaitable[None]]
Enqueue = Callable[[list[Episode]], Awaitable[set[str]]]
Tokenize = Callable[[list[Episode]], None]


class IngestService:
    """Validates, deduplicates, scores, stores and (optionally) queues posted episodes.

    `score`, `store` and `enqueue` are the run's reward, store and buffer, as async
    callables (actor calls in a job, plain objects in tests). `enqueue` returns the ids it
    queued for training: those reach the store from the buffer, with the time they were
    trained on, like the run's own episodes; the rest are stored here.

    With `limits` (the run's model), token ids must be in its vocabulary and prompt plus
    completion within its context window; `tokenize`, if given, first fills in the token
    ids of episodes posted without them, and `check_tokens` refuses token ids that
    contradict their text. With a `ledger` (a file), the ids of accepted
    episodes outlive the process: a service started again on the same ledger (a
    restarted endpoint) still knows them, so a client's retry stores nothing twice."""

    def __init__(
        self,
        token: str,
        score: Score,
        store: Store,
        enqueue: Enqueue | None,
        limits: ModelLimits | None = None,
        tokenize: Tokenize | None = None,
        ledger: Path | None = None,
        check_tokens: Tokenize | None = None,
    ):
        self.token = token
        self.score, self.store, self.enqueue = score, store, enqueue
        self.limits, self.tokenize, self.check_tokens = limits, tokenize, check_tokens
        self.ledger = ledger
        self.seen: set[str] = _read_ledger(ledger) if ledger is not None else set()
        self.counts = IngestCounts()
        self.policy_version = 0
        """The run's newest policy version: what a posted episode may claim at most."""

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
        self.check_policy_versions(episodes)
        if self.tokenize is not None:
            self.tokenize(episodes)
        if self.limits is not None:
            try:
                validate_episodes(episodes, self.limits)
                for i, episode in enumerate(episodes):
                    check_rollout_logprobs(episode, f"episodes[{i}]")
            except EpisodeError as err:
                raise IngestError(400, str(err)) from None
        if self.check_tokens is not None:
            self.check_tokens(episodes)
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
        if self.ledger is not None:
            _append_to_ledger(self.ledger, [e.episode_id for e in fresh])
        self.counts.accepted += len(fresh)
        self.counts.duplicates += duplicates
        self.counts.queued_for_training += len(queued)
        return {
            "accepted": len(fresh),
            "duplicates": duplicates,
            "scored": len(unscored),
            "queued_for_training": len(queued),
        }

    def check_policy_versions(self, episodes: list[Episode]) -> None:
        """Raises IngestError(400) unless each episode was made elsewhere (version -1) or
        by a policy version this run has had."""
        for i, episode in enumerate(episodes):
            version = episode.policy_version
            if version != EXTERNAL_POLICY_VERSION and not 0 <= version <= self.policy_version:
                raise IngestError(
                    400,
                    f"episodes[{i}].policy_version: {version} is neither -1 (made elsewhere) "
                    f"nor a version of this run's policy (0 to {self.policy_version})",
                )

    def health(self) -> dict[str, Any]:
        return {"status": "ok", **self.counts.__dict__}


class TokenIds:
    """Gives episodes posted without token ids those of the model's tokenizer (checked
    against the model's limits next), and refuses token ids posted with a text they do
    not read as (`check_texts`); the first prompt that loses characters to the tokenizer
    is logged, once."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.warned_lost_characters = False

    def __call__(self, episodes: list[Episode]) -> None:
        tokenizer = self.tokenizer
        for episode in episodes:
            if episode.prompt_token_ids and episode.completion_token_ids:
                continue
            episode.prompt_token_ids = tokenizer(episode.prompt).input_ids
            completion = tokenizer(episode.completion).input_ids
            episode.completion_token_ids = [*completion, tokenizer.eos_token_id]
            episode.rollout_logprobs = []  # unknown: the learner uses its own
            lost = read_as(tokenizer, episode.prompt, episode.prompt_token_ids)
            if lost is not None and not self.warned_lost_characters:
                self.warned_lost_characters = True
                logger.warning(
                    "ingest: posted prompts lose characters to the model's tokenizer, "
                    "e.g. %r (episode %s) reads as %r",
                    episode.prompt[:40],
                    episode.episode_id,
                    lost[:40],
                )

    def check_texts(self, episodes: list[Episode]) -> None:
        """Raises IngestError(400) unless each episode's token ids (in the vocabulary:
        checked first) read as its text: the prompt's as the prompt, the completion's as
        the completion (or, where a stop string was cut from the text, as text that begins
        with it). Special tokens and spacing are left out of the comparison: tokenizers
        differ in how they decode them."""
        for i, episode in enumerate(episodes):
            self._check_text(episode, f"episodes[{i}]")

    def _check_text(self, episode: Episode, where: str) -> None:
        for name, ids, text in (
            ("prompt", episode.prompt_token_ids, episode.prompt),
            ("completion", episode.completion_token_ids, episode.completion),
        ):
            decoded = self._visible(self.tokenizer.decode(ids, skip_special_tokens=True))
            given = self._visible(text)
            if decoded != given and not (name == "completion" and decoded.startswith(given)):
                raise IngestError(
                    400,
                    f"{where}.{name}_token_ids: read as {decoded[:40]!r}, not as the "
                    f"{name} {given[:40]!r}",
                )

    def _visible(self, text: str) -> str:
        for special in self.tokenizer.all_special_tokens:
            text = text.replace(special, "")
        return "".join(text.split())


def _read_ledger(ledger: Path) -> set[str]:
    """Returns the episode ids an earlier process of the endpoint accepted."""
    return set(ledger.read_text().split("\n")) - {""} if ledger.exists() else set()


def _append_to_ledger(ledger: Path, ids: list[str]) -> None:
    ledger.parent.mkdir(parents=True, exist_ok=True)
    with ledger.open("a") as file:  # one write: a line is whole or absent after a kill
        file.write("".join(f"{episode_id}\n" for episode_id in ids))


def store_key(episodes: list[Episode]) -> str:
    """Returns the store append key of posted episodes: the same ids give the same key,
    so that an append retried after the endpoint died, its answer lost, is stored once."""
    ids = "\n".join(sorted(e.episode_id for e in episodes))
    return "ingest-" + hashlib.sha256(ids.encode()).hexdigest()[:40]


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


RETRY_AFTER_S = 5
"""What a 503 asks a client to wait before it retries (an actor restarts in seconds)."""


def _refuse(service: IngestService, status: int, message: str) -> web.Response:
    if status == 503:  # not the request's fault: a retry will do
        headers = {"Retry-After": str(RETRY_AFTER_S)}
        return web.json_response({"error": message}, status=status, headers=headers)
    service.counts.rejected += 1
    return web.json_response({"error": message}, status=status)
