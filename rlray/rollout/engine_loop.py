"""One vLLM engine shared by every caller of a rollout worker, stepped one step at a time.

vLLM's LLMEngine runs a batch by steps: each step decodes one token of every running
request (or prefills new ones). `EngineLoop` lets several callers in one process share
it: each call opens a `Session`, adds its requests and steps until they are done; a
step advances every caller's requests, and outputs go to the session that added them.
One caller steps at a time, for all: the others wait, each woken when one of its
requests finished or to step next, and requests being added go before the next step.
So many callers of one request each (agents' model calls, rlray.agent) share steps as
one batch would. Between two steps, `paused()` gives the engine to one caller alone: a
weight load.

That is how weights are updated in flight (rollout.in_flight_updates): a sync loads the
new weights between two steps while requests run, and they go on under the new policy.
Each request records the policy version of its first step (the first engine step after
it was added: a load between its add and that step is the version it starts under) and
of its last one, so an episode knows the oldest version that produced its tokens
(staleness counts from it).
What happens to the running requests' KV cache, computed by the old weights, is
rollout.in_flight_kv_cache's choice: kept, or recomputed by the new weights.

A weight transfer (vLLM's, rlray.weights.transfer) holds the engine across calls, from
its start to its finish. If its sender dies in between, the weights are neither version
and the finish never comes: `fail()` then ends the engine's service for good, and every
caller waiting for it, or coming later, raises EngineFailed instead of waiting forever.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


class EngineFailed(RuntimeError):
    """The engine runs no step again (EngineLoop.fail); the message says why."""


@dataclass
class Versions:
    """The policy versions a request ran under: at its first step and at its last."""

    first: int
    last: int


class EngineLoop:
    """Steps one vLLM LLMEngine for every caller in this process; a caller that needs the
    engine alone (a weight load) gets it between two steps, before the next one."""

    def __init__(self, engine: Any, version: int = 0):
        self.engine = engine
        self.version = version
        """The policy version the engine's weights are; set by whoever loads weights."""
        self._lock = threading.Lock()
        self._free = threading.Condition(self._lock)  # the engine is free: adds, steps, pauses
        self._stepping = False  # a caller steps for every caller
        self._sleepers: list[tuple[set[str], threading.Condition]] = []
        """Callers waiting while another steps: the requests each waits for, and its wake."""
        self._busy = False  # a step or a paused() section holds the engine
        self._waiting_pauses = 0  # pauses waiting: steps and adds defer to them
        self._waiting_adds = 0  # adds waiting: steps defer to them
        self._held = False  # hold(): paused across calls (a layerwise weight transfer)
        self._failed: str | None = None  # why no step runs again (fail())
        self._outputs: dict[str, Any] = {}  # finished outputs not yet taken by their session
        self._versions: dict[str, Versions] = {}
        self._unstepped: set[str] = set()  # added, no engine step since: versions not stamped
        self.steps = 0
        self.updates_in_flight = 0
        """Pauses (weight loads) that found requests running."""
        self.late_handoffs = 0
        """Waiting callers that found nobody stepping only at their backstop (_sleep)."""

    def session(self) -> Session:
        """Returns a new session: one caller's requests."""
        return Session(self)

    def generate(self, requests: list[tuple[str, Any, Any]]) -> list[tuple[Any, Versions]]:
        """Runs (request id, prompt, sampling params) requests to their end; returns each
        one's final output and versions, in the order given."""
        session = self.session()
        for request_id, prompt, params in requests:
            session.add_request(request_id, prompt, params)
        done: dict[str, Any] = {}
        with session.aborted_on_error():
            while session.pending:
                for output in session.step():
                    done[output.request_id] = output
        return [(done[rid], session.versions.pop(rid)) for rid, _, _ in requests]

    @contextmanager
    def paused(self) -> Iterator[bool]:
        """Holds the engine alone between two steps; yields whether requests are running
        (they go on after it). Inside a hold() it runs at once, and ends the hold."""
        if self._failed is not None:  # a hold() left by a failed update included
            raise EngineFailed(self._failed)
        if self._held:
            try:
                yield self.engine.has_unfinished_requests()
            finally:
                self.release()
            return
        self._acquire(pause=True)
        try:
            running = self.engine.has_unfinished_requests()
            self.updates_in_flight += running
            yield running
        finally:
            self._release()

    def hold(self) -> None:
        """Pauses the engine until release() (a weight update made by several calls); a
        second hold() while held does nothing."""
        if not self._held:
            self._acquire(pause=True)
            self.updates_in_flight += self.engine.has_unfinished_requests()
            self._held = True

    def release(self) -> None:
        """Ends a hold(); nothing if none."""
        if self._held:
            self._held = False
            self._release()

    def fail(self, reason: str) -> None:
        """Ends the engine's service for good: every caller waiting for it (to add, step
        or pause) and every later one raises EngineFailed(reason). For weights a transfer
        left half-loaded, whose sender died before finishing (and releasing) it."""
        with self._free:
            self._failed = reason
            self._free.notify_all()
            for _, wake in self._sleepers:
                wake.notify()

    def _acquire(self, pause: bool = False, add: bool = False) -> None:
        """Takes the engine: a pause before anything else, then adds before steps, so
        that callers' new requests join the next step rather than wait behind a caller
        that keeps stepping its own (Python's lock is not fair: calls made one at a time
        would run one at a time)."""
        with self._free:
            if pause:
                self._waiting_pauses += 1
            elif add:
                self._waiting_adds += 1
            try:
                while self._failed is None and (
                    self._busy
                    or (not pause and (self._waiting_pauses or (not add and self._waiting_adds)))
                ):
                    self._free.wait()
            finally:
                if pause:
                    self._waiting_pauses -= 1
                elif add:
                    self._waiting_adds -= 1
            if self._failed is not None:
                raise EngineFailed(self._failed)
            self._busy = True

    def _release(self) -> None:
        with self._free:
            self._busy = False
            self._free.notify_all()

    def _add(self, request_id: str, prompt: Any, params: Any) -> None:
        self._acquire(add=True)
        try:
            self.engine.add_request(request_id, prompt, params)
            self._versions[request_id] = Versions(self.version, self.version)
            self._unstepped.add(request_id)
        finally:
            self._release()

    def _step(self, waiting_for: set[str]) -> None:
        """Returns after one engine step, whose finished outputs are kept for their
        sessions. If another caller is stepping, returns instead once one of
        `waiting_for` finished or nobody steps on: a waiting caller is woken for its
        own outputs or to step next, not at every step (with many agents' calls, waking
        each at every step spends the rollout process's CPU on wake-ups that find
        nothing). None if one of
        `waiting_for` finished meanwhile."""
        with self._free:
            if self._stepping:
                self._sleep(waiting_for)
                return
            self._stepping = True
        try:
            self._acquire()
            try:
                if not waiting_for.isdisjoint(self._outputs):
                    return
                for request_id in self._unstepped:  # their first step: this version's
                    self._versions[request_id] = Versions(self.version, self.version)
                self._unstepped.clear()
                for output in self.engine.step():
                    if output.finished and output.request_id in self._versions:
                        self._versions[output.request_id].last = self.version
                        self._outputs[output.request_id] = output
                self.steps += 1
            finally:
                self._release()
        finally:
            with self._free:
                self._stepping = False
                self._wake(steps_on=not waiting_for.issubset(self._outputs))

    def _sleep(self, waiting_for: set[str]) -> None:
        """Waits (holding the lock) until one of `waiting_for` finished or nobody steps.
        The timeout is a backstop: a stepper whose caller never steps again (it failed
        between two steps) hands the stepping on within it."""
        sleeper = (waiting_for, threading.Condition(self._lock))
        self._sleepers.append(sleeper)
        try:
            while self._stepping and waiting_for.isdisjoint(self._outputs) and self._failed is None:
                if not sleeper[1].wait(timeout=0.5) and not self._stepping:
                    self.late_handoffs += 1
        finally:
            self._sleepers.remove(sleeper)
        if self._failed is not None and waiting_for.isdisjoint(self._outputs):
            raise EngineFailed(self._failed)

    def _wake(self, steps_on: bool) -> None:
        """Wakes (holding the lock) each waiting caller whose requests finished, and, if
        the caller that stepped will not step again (`steps_on` false: its own requests
        are done), one more to step next."""
        successor = not steps_on
        for waiting_for, wake in self._sleepers:
            if not waiting_for.isdisjoint(self._outputs):
                wake.notify()
            elif successor:
                wake.notify()
                successor = False

    def _forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._outputs.pop(rid, None)
            self._versions.pop(rid, None)
            self._unstepped.discard(rid)

    def _take(self, request_ids: set[str]) -> list[Any]:
        with self._free:
            ready = [rid for rid in request_ids if rid in self._outputs]
            return [self._outputs.pop(rid) for rid in ready]

    def _abort(self, request_ids: list[str]) -> None:
        try:
            self._acquire()
        except EngineFailed:  # no step runs them again: forgetting them is enough
            with self._free:
                self._forget(request_ids)
            return
        try:
            self.engine.abort_request(request_ids)
            self._forget(request_ids)
        finally:
            self._release()
        with self._free:  # an aborting caller may have been the one that stepped
            if not self._stepping:
                self._wake(steps_on=False)


class Session:
    """One caller's requests on an EngineLoop: the face of vLLM's LLMEngine that
    rlray.rollout.multiturn drives (add_request, step, abort_request)."""

    def __init__(self, loop: EngineLoop):
        self.loop = loop
        self.pending: set[str] = set()
        self.versions: dict[str, Versions] = {}
        """Each finished request's versions, by request id (taken by the caller)."""

    def add_request(self, request_id: str, prompt: Any, params: Any) -> None:
        # as the engine's caller
        from vllm.sampling_params import RequestOutputKind

        params.output_kind = RequestOutputKind.FINAL_ONLY  # as vLLM's LLM.generate asks
        self.loop._add(request_id, prompt, params)
        self.pending.add(request_id)

    def step(self) -> list[Any]:
        """Returns this session's requests that finished, taking an engine step first
        unless some already did (in another caller's step)."""
        finished = self.loop._take(self.pending)
        if not finished and self.pending:
            self.loop._step(self.pending)
            # Other callers' threads get the GIL now: between two steps they add their
            # requests (to the next step) or take their outputs. Without it a caller
            # that steps holds the GIL across steps, and calls made one at a time (an
            # agent's) run one at a time: one request a step, however many callers.
            time.sleep(0)
            finished = self.loop._take(self.pending)
        for output in finished:
            self.pending.discard(output.request_id)
            self.versions[output.request_id] = self.loop._versions.pop(output.request_id)
        return finished

    def first_version(self, request_id: str) -> int:
        """Returns the policy version a running request of this session started under (or,
        before its first step, will start under: the engine's)."""
        if request_id in self.loop._unstepped:
            return self.loop.version
        return self.loop._versions[request_id].first

    def abort_request(self, request_ids: list[str]) -> None:
        self.loop._abort(request_ids)
        self.pending.difference_update(request_ids)

    @contextmanager
    def aborted_on_error(self) -> Iterator[None]:
        """Aborts this session's unfinished requests if the caller fails, so that no
        other caller's step keeps running them."""
        try:
            yield
        except BaseException:
            if self.pending:
                self.abort_request(list(self.pending))
            raise
