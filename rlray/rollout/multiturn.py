"""Multi-turn rollouts, token in and token out.

A trajectory alternates the policy's turns with an environment's observations. The
worker keeps the exact token ids vLLM sampled and appends each observation's tokens
itself: no earlier turn is ever tokenised again. (Re-tokenising a conversation can
merge or split tokens at a turn boundary, and then the learner scores tokens vLLM never
sampled: the importance ratio breaks without an error.) `completion_mask` says whose
each completion token is: 1 the policy's, 0 the environment's.

Trajectories run concurrently through vLLM's engine (continuous batching). When a turn
finishes, its environment step runs in a thread while the engine goes on generating
the other trajectories' turns, and the next turn is submitted as soon as the
observation is back, so a long trajectory (or a slow tool) never holds the others.
`TrajectoryRunner` may also stop before every trajectory ended and go on in a later call
with the others still running (partial rollouts, rlray.rollout.partial).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlray.core.episode import Episode, Span

if TYPE_CHECKING:
    from rlray.config import RolloutConfig
    from rlray.rollout.engine_loop import Session, Versions

# A trajectory's environment step is one thread; more than this many wait their turn.
MAX_ENVIRONMENT_THREADS = 32


@dataclass(frozen=True)
class TurnLimits:
    """How long a trajectory may run."""

    max_turns: int
    """Model turns at most; the environment's answer to the last one is not appended."""
    max_new_tokens: int
    """Tokens the model may sample in one turn."""
    max_completion_tokens: int
    """All turns and observations together (the token budget): a turn gets what is left,
    and an observation that does not fit ends the trajectory ('length')."""


@dataclass
class Trajectory:
    """One episode generated turn by turn: the prompt, then model turns and observations."""

    key: str
    """Unique within one run_trajectories call (vLLM's request id, plus the turn)."""
    row: Any
    """The dataset row, handed to the environment's reset."""
    prompt_token_ids: list[int]
    environment: Any
    """One environment per trajectory: reset(row) -> str, step(text) -> a result with
    observation (str), reward (float or None) and done (bool); either may be async."""
    prompt_index: int = 0
    sample_index: int = 0
    completion_token_ids: list[int] = field(default_factory=list)
    completion_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    """vLLM's logprob of each policy token; 0.0 on observation tokens (masked out)."""
    pieces: list[str] = field(default_factory=list)
    """The completion's text: model outputs and observations, in order."""
    spans: list[Span] = field(default_factory=list)
    turn_rewards: list[float | None] = field(default_factory=list)
    """What the environment's step returned after each model turn."""
    turns: int = 0
    turn_started: float = 0.0
    """When the current model turn was submitted (Unix seconds)."""
    finish_reason: str = "stop"
    """stop (the environment said done, or the model ended), length (out of tokens or
    turns), or error (the environment raised; see the last span)."""
    prompt_text: str = ""
    """The prompt as the model reads it (a chat prompt's rendering): the episode's prompt."""
    versions: Versions | None = None
    """The policy versions of its first turn's first step and of its last turn's last
    step; None before its first turn."""
    attempt: str = ""
    """The generation attempt's tag (the last part of its episode's id)."""
    ended: bool = False
    """No turn or observation is left to come: its completion is whole."""

    @property
    def context(self) -> list[int]:
        """Returns every token so far: what the next turn is generated from."""
        return self.prompt_token_ids + self.completion_token_ids

    @property
    def completion(self) -> str:
        return "".join(self.pieces)

    def add_model_turn(self, token_ids: list[int], logprobs: list[float], text: str) -> None:
        self.completion_token_ids += token_ids
        self.completion_mask += [1] * len(token_ids)
        self.rollout_logprobs += logprobs
        self.pieces.append(text)
        self.turns += 1

    def add_observation(self, token_ids: list[int], text: str) -> None:
        self.completion_token_ids += token_ids
        self.completion_mask += [0] * len(token_ids)
        self.rollout_logprobs += [0.0] * len(token_ids)
        self.pieces.append(text)


def call_maybe_async(method: Callable[..., Any], *args: Any) -> Any:
    """Returns method(*args), run to completion if it is a coroutine function (each
    environment thread runs its own event loop)."""
    result = method(*args)
    return asyncio.run(result) if inspect.isawaitable(result) else result


def run_trajectories(
    engine: Session,
    encode: Callable[[str], list[int]],
    text: Callable[[Any], str],
    trajectories: list[Trajectory],
    sampling: Callable[[Trajectory, int], Any],
    limits: TurnLimits,
) -> None:
    """Runs every trajectory to its end, filling in its completion (TrajectoryRunner)."""
    runner = TrajectoryRunner(engine, encode, text, sampling, limits, threads=len(trajectories))
    try:
        runner.start(trajectories)
        runner.run()
    finally:
        runner.close()


class TrajectoryRunner:
    """Runs trajectories turn by turn on a session of the worker's vLLM engine.

    `engine` is the session (add_request, step, abort_request; rlray.rollout.engine_loop),
    `encode` the tokenizer's text -> ids without special tokens (for observations),
    `text(completion)` a finished turn's text (as vLLM's detokenizer makes it), and
    `sampling(trajectory, max_tokens)` the SamplingParams of its next turn. Trajectories
    started in one call may end in a later one: `run(until)` returns once `until()`
    holds, the others still running (their environments' steps go on in their threads)."""

    def __init__(
        self,
        engine: Session,
        encode: Callable[[str], list[int]],
        text: Callable[[Any], str],
        sampling: Callable[[Trajectory, int], Any],
        limits: TurnLimits,
        threads: int = MAX_ENVIRONMENT_THREADS,
    ):
        self.engine = engine
        self.encode = encode
        self.text = text
        self.sampling = sampling
        self.limits = limits
        workers = min(MAX_ENVIRONMENT_THREADS, max(1, threads))
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="environment")
        self.in_engine: dict[str, Trajectory] = {}
        """Trajectories whose turn the engine is generating, by request id."""
        self.stepping: dict[Future, tuple[Trajectory, float]] = {}
        """Trajectories whose environment is answering, and since when."""

    @property
    def running(self) -> bool:
        return bool(self.in_engine or self.stepping)

    def start(self, trajectories: list[Trajectory]) -> None:
        """Resets each trajectory's environment; its first turn follows."""
        for t in trajectories:
            reset = self.pool.submit(call_maybe_async, t.environment.reset, t.row)
            self.stepping[reset] = (t, time.time())

    def run(self, until: Callable[[], bool] | None = None) -> None:
        """Runs the trajectories until every one ended or `until()` holds (checked after
        each engine step or observation)."""
        with _aborted_on_error(self.engine, self.in_engine):
            while self.running and not (until is not None and until()):
                self._advance()

    def first_version(self, t: Trajectory) -> int:
        """Returns the policy version the trajectory's first turn started under (or
        will: the engine's current one, if its first turn is still to come)."""
        if t.versions is not None:
            return t.versions.first
        request = next((r for r, other in self.in_engine.items() if other is t), None)
        return self.engine.first_version(request) if request else self.engine.loop.version

    def close(self) -> None:
        """Aborts the turns still in the engine and ends the environments' threads."""
        if self.in_engine:
            self.engine.abort_request(list(self.in_engine))
            self.in_engine.clear()
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.stepping.clear()

    def _advance(self) -> None:
        """Takes an engine step (if a turn is running), then every observation that is
        back; with nothing to generate, waits for the next observation."""
        if self.in_engine:
            for output in self.engine.step():
                if output.finished:
                    t = self.in_engine.pop(output.request_id)
                    _take_versions(t, self.engine.versions.pop(output.request_id))
                    completion = output.outputs[0]
                    if _take_turn(t, completion, self.text(completion), self.limits):
                        step = self.pool.submit(call_maybe_async, t.environment.step, t.pieces[-1])
                        self.stepping[step] = (t, time.time())
                    else:
                        t.ended = True
        # Observations that are back go in at once; with nothing to generate, the loop
        # waits for the next one instead of spinning.
        timeout = 0 if self.in_engine else None
        finished, _ = wait(list(self.stepping), timeout=timeout, return_when=FIRST_COMPLETED)
        for future in finished:
            t, started = self.stepping.pop(future)
            if _take_observation(t, future, started, self.encode, self.limits):
                self._submit_turn(t)
            else:
                t.ended = True

    def _submit_turn(self, t: Trajectory) -> None:
        request = f"{t.key}-turn{t.turns}"
        budget = self.limits.max_completion_tokens - len(t.completion_token_ids)
        max_tokens = min(self.limits.max_new_tokens, budget)
        prompt = {"prompt_token_ids": t.context}
        self.engine.add_request(request, prompt, self.sampling(t, max_tokens))
        t.turn_started = time.time()
        self.in_engine[request] = t


@contextlib.contextmanager
def _aborted_on_error(engine: Session, in_engine: dict[str, Trajectory]) -> Iterator[None]:
    """Aborts the requests still in the engine if the loop fails, so that the engine's
    next caller does not receive their outputs."""
    try:
        yield
    except BaseException:
        if in_engine:
            engine.abort_request(list(in_engine))
            in_engine.clear()
        raise


def _take_versions(t: Trajectory, turn: Versions) -> None:
    if t.versions is None:
        t.versions = turn
    else:
        t.versions.last = turn.last


def _take_turn(t: Trajectory, completion: Any, text: str, limits: TurnLimits) -> bool:
    """Appends a finished model turn (`text`: its text); returns whether the environment
    should answer it."""
    token_ids = list(completion.token_ids)
    logprobs = [
        step[token].logprob for step, token in zip(completion.logprobs, token_ids, strict=True)
    ]
    t.add_model_turn(token_ids, logprobs, text)
    t.spans.append(Span("model_call", t.turn_started, time.time(), output=text))
    if completion.finish_reason == "length" and len(t.completion_token_ids) >= (
        limits.max_completion_tokens
    ):
        t.finish_reason = "length"
        return False
    return True


def _take_observation(
    t: Trajectory, future: Future, started: float, encode: Callable, limits: TurnLimits
) -> bool:
    """Appends an environment's answer (to reset or to a turn); returns whether the
    model takes another turn."""
    first = t.turns == 0
    try:
        result = future.result()
    except Exception as err:  # the environment's own bug: this trajectory ends, not the run
        t.spans.append(Span("tool_call", started, time.time(), name="environment", error=repr(err)))
        t.finish_reason = "error"
        return False
    observation = result if first else result.observation
    if not first:
        t.turn_rewards.append(result.reward)
        t.spans += getattr(t.environment, "take_spans", lambda: [])()
        if result.reward is not None:
            now = time.time()
            t.spans.append(Span("reward", now, now, value=result.reward, source="environment"))
        if result.done:
            return False
        if t.turns >= limits.max_turns:
            t.finish_reason = "length"
            return False
    token_ids = encode(observation) if observation else []
    if first:
        t.prompt_token_ids = t.prompt_token_ids + token_ids
        return True
    if len(t.completion_token_ids) + len(token_ids) >= limits.max_completion_tokens:
        t.finish_reason = "length"
        return False
    t.add_observation(token_ids, observation)
    return True


def turn_limits(rollout: RolloutConfig) -> TurnLimits:
    """Returns the turn limits rollout settings give (see RolloutConfig)."""
    return TurnLimits(rollout.max_turns, rollout.max_new_tokens, rollout.turn_budget)


def tool_calls(episodes: list[Episode]) -> tuple[int, int]:
    """Returns (tool calls, of which failed) over the episodes' spans."""
    calls = [s for e in episodes for s in e.spans if s.kind == "tool_call"]
    return len(calls), sum(s.error is not None for s in calls)
