"""The agent endpoint: tasks out, OpenAI calls onto the policy, traces back as episodes.

    GET  /v1/tasks/next                         200 {"trace_id", "base_url", "task"};
                                                204 once the run needs no more traces
    POST /traces/{trace_id}/v1/chat/completions the OpenAI API at the trace's base_url
    POST /traces/{trace_id}/v1/completions
    POST /v1/traces/{trace_id}/reward           {"reward": r, "components": {...},
                                                 "call_rewards": {call id: r}} ends it
    POST /v1/traces/{trace_id}/end              ends it unscored: the run's rewards score it
    POST /v1/traces/{trace_id}/events           {"name": ..., "detail": ..., "value": ...}
    GET  /v1/health                             counts

Every request needs `Authorization: Bearer <agent.token>` (the openai client sends its
api_key so). A bad request gets a 4xx and a one-line JSON error in OpenAI's shape; no
request ends the run.

The run decides what is handed out: a rollout batch (`run_batch`) queues one trace per
prompt and sample, and returns when every one of them ended (or was dropped after
agent.trace_timeout_s) with the traces' episodes (rlray.agent.traces). A call's prompt
is rendered once by the model's chat template and generated from its token ids; the
engine's sampled ids and logprobs are what the episode keeps.

`AgentGateway` is a plain class over an asyncio event loop: everything here runs in
that one loop, so no lock guards the traces. The actor that serves it
(rlray.cluster.endpoints.AgentActor) gives it the engine (`generate`) and the tokenizer.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import web

from rlray.agent.openai_api import (
    ChatRequest,
    CompletionRequest,
    RequestError,
    Sampling,
    chat_chunks,
    chat_response,
    completion_chunks,
    completion_response,
    parse_chat_request,
    parse_completion_request,
)
from rlray.agent.traces import Call, Trace, trace_episodes
from rlray.core.episode import MAX_ABS_REWARD, Episode
from rlray.core.prompt import PromptRow
from rlray.core.stats import GenerateStats
from rlray.rollout.sampling import Generated

logger = logging.getLogger(__name__)

ENDED_KEPT = 65536
"""Ended traces remembered, so that a late call hears 409 (ended), not 404 (unknown)."""

Generate = Callable[[int, list[int], Sampling, int], Awaitable[list[Generated]]]
"""(rollout worker, prompt token ids, sampling, max tokens) -> the sampled choices."""


class EndpointBusy(Exception):
    """Nothing to serve now (no task yet, or the engine's worker is restarting): 503
    with Retry-After, and the client asks again."""


@dataclass(frozen=True)
class CallLimits:
    """The run's limits on what agents may ask of the engine."""

    max_model_len: int
    """Prompt plus completion of one call (model.max_model_len)."""
    max_new_tokens: int
    """Sampled tokens per call (rollout.max_new_tokens)."""
    trace_tokens: int
    """Sampled tokens per trace, all calls together (the run's multi-turn budget)."""
    max_calls: int
    """Model calls per trace (agent.max_calls_per_trace)."""
    temperature: float = 1.0
    """What every call samples at (rollout.temperature), whatever it asks: the learner
    scores the episodes at it, so the logprobs of a call are the behaviour policy's."""
    max_events: int = 64
    """Events an agent may post per trace."""
    max_event_bytes: int = 256 * 1024
    """Bytes of events' names and details per trace, all together."""


@dataclass
class _Batch:
    traces: list[Trace]
    worker: int
    started: float
    done: asyncio.Event = field(default_factory=asyncio.Event)
    open: int = 0


class AgentGateway:
    """Hands out tasks, serves each trace's model calls and turns ended traces into
    episodes; the HTTP application is `app()`."""

    def __init__(
        self,
        token: str,
        tokenizer: Any,
        limits: CallLimits,
        generate: Generate,
        run_id: str,
        worker_names: list[str],
        trace_timeout_s: float,
        task_wait_s: float,
        max_concurrent_calls: int = 64,
    ):
        self.token = token
        self.tokenizer = tokenizer
        self.limits = limits
        self.generate = generate
        self.run_id = run_id
        self.worker_names = worker_names
        self.trace_timeout_s = trace_timeout_s
        self.task_wait_s = task_wait_s
        self.calls = asyncio.Semaphore(max_concurrent_calls)
        self.url = ""
        """Where clients reach this endpoint (set once it listens)."""
        self.traces: dict[str, Trace] = {}
        self.batches: dict[str, _Batch] = {}  # by trace id
        self.queue: deque[Trace] = deque()
        self.ended: OrderedDict[str, str] = OrderedDict()
        """How the last ENDED_KEPT traces ended, by id: a late call on one is told so."""
        self.task_ready = asyncio.Event()
        self.closed = False
        self.waiting = 0
        """Requests waiting in tasks/next (close() answers them before it returns)."""
        self.counts = {"handed_out": 0, "ended": 0, "dropped": 0, "calls": 0, "refused": 0}

    # ---------------------------------------------------------------- the run's side

    async def run_batch(
        self, rows: list[PromptRow], first_prompt_index: int, samples: int, worker: int
    ) -> tuple[list[Episode], GenerateStats]:
        """Queues one trace per row and sample for agents to take, and returns when each
        ended or was dropped: the traces' episodes, and the batch's stats."""
        traces = [
            Trace(uuid.uuid4().hex[:16], row, first_prompt_index + offset, sample, worker)
            for offset, row in enumerate(rows)
            for sample in range(samples)
        ]
        batch = _Batch(traces, worker, time.perf_counter(), open=len(traces))
        for trace in traces:
            self.traces[trace.trace_id] = trace
            self.batches[trace.trace_id] = batch
            self.queue.append(trace)
        self.task_ready.set()
        await batch.done.wait()
        return self._batch_result(batch)

    def _batch_result(self, batch: _Batch) -> tuple[list[Episode], GenerateStats]:
        now = time.time()
        name = self.worker_names[batch.worker]
        episodes = []
        for trace in batch.traces:
            episodes += trace_episodes(trace, self.run_id, name, self._decode, now)
            del self.traces[trace.trace_id], self.batches[trace.trace_id]
            self.ended[trace.trace_id] = (
                "dropped (not ended within agent.trace_timeout_s, or by the run's end)"
                if trace.dropped
                else "ended"
            )
            if len(self.ended) > ENDED_KEPT:
                self.ended.popitem(last=False)
        spans = [s for t in batch.traces if not t.dropped for s in t.spans]
        tool_calls = [s for s in spans if s.kind == "tool_call"]
        stats = GenerateStats(
            worker=name,
            policy_version=min((e.policy_version for e in episodes), default=0),
            episodes=len(episodes),
            completion_tokens=sum(t.sampled_tokens for t in batch.traces if not t.dropped),
            seconds=time.perf_counter() - batch.started,
            tool_calls=len(tool_calls),
            tool_errors=sum(s.error is not None for s in tool_calls),
            updated_in_flight=sum(e.last_policy_version != e.policy_version for e in episodes),
            traces_dropped=sum(t.dropped for t in batch.traces),
        )
        return episodes, stats

    async def close(self, timeout_s: float = 10.0) -> None:
        """The run needs no more traces: tasks/next answers 204 from now on, and traces not
        yet handed out are dropped. Agents still playing a trace get `timeout_s` to end it;
        then every trace not ended is dropped (counted, logged), so that the batches in
        flight return with their ended traces' episodes: a run that stops waits for no
        absent agent longer. Returns once that is done, and every agent that was waiting
        for a task has been answered."""
        self.closed = True
        self.task_ready.set()
        queued = len(self.queue)
        for trace in self.queue:
            self._drop(trace)
        self.queue.clear()
        deadline = time.monotonic() + timeout_s
        while (self.waiting or self._playing()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = self._playing()
        for trace in left:
            self._drop(trace)
        if queued or left:
            logger.warning(
                "agent endpoint: at the run's end %d traces not handed out and %d not ended "
                "within %g s were dropped, never trained (every ended one is stored)",
                queued,
                len(left),
                timeout_s,
            )

    def _playing(self) -> list[Trace]:
        return [t for t in self.traces.values() if not t.ended and t.handed_out_at is not None]

    def _drop(self, trace: Trace) -> None:
        trace.ended = trace.dropped = True
        self._finished(trace)

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def _end(self, trace: Trace, reward: float | None, components: dict[str, float]) -> None:
        trace.end(reward, components, time.time())
        self._finished(trace)

    def _finished(self, trace: Trace) -> None:
        self.counts["dropped" if trace.dropped else "ended"] += 1
        batch = self.batches[trace.trace_id]
        batch.open -= 1
        if batch.open == 0:
            batch.done.set()

    def _expire(self, trace: Trace) -> None:
        """Drops a trace its agent did not end within agent.trace_timeout_s."""
        if not trace.ended:
            logger.warning(
                "trace %s dropped: not ended within agent.trace_timeout_s (%g s)",
                trace.trace_id,
                self.trace_timeout_s,
            )
            self._drop(trace)

    # ---------------------------------------------------------------- HTTP

    def app(self, max_body_bytes: int) -> web.Application:
        app = web.Application(
            client_max_size=max_body_bytes, middlewares=[self._errors, self._authorized]
        )
        app.router.add_get("/v1/tasks/next", self._next_task)
        app.router.add_get("/v1/health", self._health)
        app.router.add_post("/traces/{trace_id}/v1/chat/completions", self._chat)
        app.router.add_post("/traces/{trace_id}/v1/completions", self._completion)
        app.router.add_post("/v1/traces/{trace_id}/reward", self._reward)
        app.router.add_post("/v1/traces/{trace_id}/end", self._end_unscored)
        app.router.add_post("/v1/traces/{trace_id}/events", self._event)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Every refusal as one line of JSON in OpenAI's error shape."""
        try:
            return await handler(request)
        except RequestError as err:
            self.counts["refused"] += 1
            return _error(err.status, str(err))
        except EndpointBusy as err:
            return _error(503, str(err), {"Retry-After": "1"})
        except web.HTTPException as err:
            if err.status < 400:
                raise
            self.counts["refused"] += 1
            return _error(err.status, f"{err.reason}: {request.method} {request.path}")
        except Exception:  # the run never dies of a request
            logger.exception("agent endpoint: %s %s failed", request.method, request.path)
            # What failed inside (a worker's pid, a node's address) is the log's, not the
            # client's.
            return _error(500, f"the run failed to serve {request.method} {request.path}")

    @web.middleware
    async def _authorized(self, request: web.Request, handler: Any) -> web.StreamResponse:
        sent = request.headers.get("Authorization", "")
        if not hmac.compare_digest(sent.encode(), f"Bearer {self.token}".encode()):
            raise RequestError(401, "missing or wrong bearer token (agent.token)")
        return await handler(request)

    async def _health(self, request: web.Request) -> web.Response:
        queued = len(self.queue)
        return web.json_response({"status": "ok", "queued": queued, **self.counts})

    async def _next_task(self, request: web.Request) -> web.Response:
        """Hands out the next queued trace, waiting up to agent.task_wait_s for one."""
        deadline = time.monotonic() + self.task_wait_s
        self.waiting += 1
        try:
            while not self.queue and not self.closed:
                self.task_ready.clear()
                left = deadline - time.monotonic()
                try:
                    await asyncio.wait_for(self.task_ready.wait(), max(left, 0))
                except TimeoutError:
                    raise EndpointBusy("no task yet; ask again") from None
            if self.closed:
                return await _sent(request, web.Response(status=204))
        finally:
            self.waiting -= 1
        trace = self.queue.popleft()
        trace.handed_out_at = time.time()
        asyncio.get_running_loop().call_later(self.trace_timeout_s, self._expire, trace)
        self.counts["handed_out"] += 1
        task = {"prompt": trace.row.prompt, **trace.row.columns}
        base_url = f"{self.url}/traces/{trace.trace_id}/v1"
        return web.json_response({"trace_id": trace.trace_id, "base_url": base_url, "task": task})

    def _trace(self, request: web.Request) -> Trace:
        """Returns the request's open trace, or refuses it."""
        trace_id = request.match_info["trace_id"]
        trace = self.traces.get(trace_id)
        if trace is None and trace_id in self.ended:
            raise RequestError(409, f"trace {trace_id} has {self.ended[trace_id]}")
        if trace is None:
            raise RequestError(404, f"no trace {trace_id[:40]!r} in this run")
        if trace.ended:
            why = (
                "dropped (not ended within agent.trace_timeout_s, or by the run's end)"
                if trace.dropped
                else "ended"
            )
            raise RequestError(409, f"trace {trace_id} has {why}")
        if trace.handed_out_at is None:
            raise RequestError(409, f"trace {trace_id} was not handed out")
        return trace

    async def _body(self, request: web.Request) -> Any:
        try:
            return json.loads(await request.read())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise RequestError(400, f"body is not valid JSON: {err}".splitlines()[0]) from None
        except ValueError as err:  # an integer of more digits than Python reads
            raise RequestError(400, f"body: {err}".splitlines()[0][:200]) from None
        except RecursionError:
            raise RequestError(400, "body is nested too deeply") from None

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        trace = self._trace(request)
        chat = parse_chat_request(await self._body(request), self.limits.max_new_tokens)
        text = self._render(chat)
        token_ids = _tokens(self.tokenizer(text, add_special_tokens=False).input_ids)
        trace.add_tool_results(chat.messages, time.time())
        call_id, created, choices, headers = await self._call(trace, chat, text, token_ids)
        if not chat.stream:
            response = chat_response(chat, call_id, created, len(token_ids), choices)
            return web.json_response(response, headers=headers)
        chunks = chat_chunks(chat, call_id, created, len(token_ids), choices)
        return await _stream(request, chunks, headers)

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        trace = self._trace(request)
        plain = parse_completion_request(await self._body(request), self.limits.max_new_tokens)
        token_ids = _tokens(self.tokenizer(plain.prompt).input_ids)  # as vLLM tokenises text
        call_id, created, choices, headers = await self._call(trace, plain, plain.prompt, token_ids)
        if plain.stream:
            chunks = completion_chunks(plain, call_id, created, len(token_ids), choices)
            return await _stream(request, chunks, headers)
        response = completion_response(plain, call_id, created, len(token_ids), choices)
        return web.json_response(response, headers=headers)

    def _render(self, chat: ChatRequest) -> str:
        """Returns the chat rendered once by the model's chat template."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError(400, "the model has no chat template: use completions")
        try:
            return self.tokenizer.apply_chat_template(
                chat.messages,
                tools=chat.tools or None,
                add_generation_prompt=True,
                tokenize=False,
            )
        except Exception as err:  # the template's own refusal (jinja2 raise_exception)
            raise RequestError(400, f"messages: the chat template refused them: {err}") from None

    async def _call(
        self,
        trace: Trace,
        request: ChatRequest | CompletionRequest,
        prompt_text: str,
        token_ids: list[int],
    ) -> tuple[str, int, list[Generated], dict[str, str]]:
        """Generates the call's choices within the run's limits and records them; returns
        them with the headers that say how they were sampled. The call and its tokens
        are reserved against the trace's limits before it runs, so that calls of one
        trace at once cannot pass them together."""
        max_tokens = self._max_tokens(trace, request.sampling, len(token_ids))
        # The run's temperature, whatever the agent asked: the learner scores at it.
        sampling = replace(request.sampling, temperature=self.limits.temperature)
        reserved = max_tokens * sampling.n
        trace.reserved_calls += 1
        trace.reserved_tokens += reserved
        started = time.time()
        try:
            async with self.calls:
                choices = await self.generate(trace.worker, token_ids, sampling, max_tokens)
        finally:
            trace.reserved_calls -= 1
            trace.reserved_tokens -= reserved
        if trace.ended:  # dropped while it generated
            raise RequestError(409, f"trace {trace.trace_id} was dropped while the call ran")
        call_id = f"chatcmpl-{trace.trace_id}-{trace.model_calls}"
        ended = time.time()
        role = request.model
        records = [
            Call(call_id, role, prompt_text, list(token_ids), generated, started, ended)
            for generated in choices
        ]
        trace.add_call(records, _last_input(request))
        self.counts["calls"] += 1
        headers = {
            "X-RLray-Temperature": f"{sampling.temperature:g}",
            "X-RLray-Max-Tokens": str(max_tokens),
        }
        return call_id, int(started), choices, headers

    def _max_tokens(self, trace: Trace, sampling: Sampling, prompt_tokens: int) -> int:
        """Returns how many tokens the call may sample: what it asked (or the run's
        per-call limit), within the context window and the trace's budget."""
        limits = self.limits
        if trace.model_calls + trace.reserved_calls >= limits.max_calls:
            raise RequestError(
                400,
                f"trace {trace.trace_id} made its {limits.max_calls} calls "
                "(agent.max_calls_per_trace)",
            )
        room = limits.max_model_len - prompt_tokens
        if room < 1:
            raise RequestError(
                400,
                f"prompt is {prompt_tokens} tokens; model.max_model_len "
                f"({limits.max_model_len}) leaves no room to generate",
            )
        budget = (limits.trace_tokens - trace.sampled_tokens - trace.reserved_tokens) // sampling.n
        if budget < 1:
            raise RequestError(
                400,
                f"trace {trace.trace_id} used its {limits.trace_tokens} tokens "
                "(rollout.max_completion_tokens)",
            )
        return min(sampling.max_tokens or limits.max_new_tokens, room, budget)

    async def _reward(self, request: web.Request) -> web.Response:
        trace = self._trace(request)
        body = await self._body(request)
        if not isinstance(body, dict):
            raise RequestError(400, "body must be a JSON object")
        reward = _reward_number(body.get("reward"), "reward")
        components = _numbers(body.get("components", {}), "components")
        call_rewards = _numbers(body.get("call_rewards", {}), "call_rewards")
        known = {c.call_id for c in trace.calls}
        unknown = sorted(set(call_rewards) - known)
        if unknown:
            raise RequestError(400, f"call_rewards: no call {unknown[0]!r} in this trace")
        unexpected = sorted(set(body) - {"reward", "components", "call_rewards"})
        if unexpected:
            raise RequestError(400, f"{unexpected[0]}: unknown field")
        trace.call_rewards = call_rewards
        self._end(trace, reward, components)
        return web.json_response({"trace_id": trace.trace_id, "ended": True})

    async def _end_unscored(self, request: web.Request) -> web.Response:
        trace = self._trace(request)
        self._end(trace, None, {})
        return web.json_response({"trace_id": trace.trace_id, "ended": True})

    async def _event(self, request: web.Request) -> web.Response:
        trace = self._trace(request)
        body = await self._body(request)
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            raise RequestError(400, 'expected {"name": ..., "detail": ..., "value": ...}')
        detail = body.get("detail", "")
        if not isinstance(detail, str):
            detail = json.dumps(detail)
        value = body.get("value")
        value = None if value is None else _reward_number(value, "value")
        size = len(body["name"].encode()) + len(detail.encode())
        if trace.events >= self.limits.max_events:
            raise RequestError(400, f"trace {trace.trace_id} posted its {trace.events} events")
        if trace.event_bytes + size > self.limits.max_event_bytes:
            left = self.limits.max_event_bytes - trace.event_bytes
            raise RequestError(
                413,
                f"event of {size} bytes; trace {trace.trace_id} has {left} bytes of events left",
            )
        trace.add_event(body["name"], detail, value, time.time())
        return web.json_response({"trace_id": trace.trace_id, "events": len(trace.spans)})


def _last_input(request: ChatRequest | CompletionRequest) -> str:
    """Returns what a call's span shows as its input: a chat's last message."""
    if isinstance(request, CompletionRequest):
        return request.prompt
    last = request.messages[-1]
    return f"{last['role']}: {last['content']}"


def _reward_number(value: Any, name: str) -> float:
    """Returns a posted reward (or a component, an event's value) as a float, or refuses
    what the learner could not take: a non-number, NaN, an infinity, an integer beyond a
    float, a value beyond ±MAX_ABS_REWARD."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(400, f"{name}: expected a number")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number) or abs(number) > MAX_ABS_REWARD:
        raise RequestError(400, f"{name}: expected a finite number within ±{MAX_ABS_REWARD:g}")
    return number


def _numbers(value: Any, name: str) -> dict[str, float]:
    if not isinstance(value, dict):
        raise RequestError(400, f"{name}: expected an object of numbers")
    return {str(k)[:200]: _reward_number(v, f"{name}.{str(k)[:40]}") for k, v in value.items()}


def _tokens(token_ids: list[int]) -> list[int]:
    """Returns a call's prompt tokens, or refuses a prompt of none (the engine refuses
    one, and would fail every call sent with it)."""
    if not token_ids:
        raise RequestError(400, "the prompt is no tokens to the model")
    return token_ids


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "code": status}}
    return web.json_response(body, status=status, headers=headers)


async def _sent(request: web.Request, response: web.Response) -> web.Response:
    """Sends a response before the handler returns (so that close() knows it left)."""
    await response.prepare(request)
    await response.write_eof()
    return response


async def _stream(
    request: web.Request, chunks: list[dict[str, Any]], headers: dict[str, str]
) -> web.StreamResponse:
    """Sends chunks as server-sent events, ending with [DONE] as OpenAI's API does."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", **headers})
    await response.prepare(request)
    for chunk in chunks:
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
