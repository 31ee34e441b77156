"""Partial rollouts: a generate call that ends once it has a batch of whole groups, and
leaves the groups still running in the engine for the next call.

A colocated engine (ray.placement colocated) generates only in its turn, so with
rollout.in_flight_updates its turn would otherwise last as long as the batch's longest
completion, the engine decoding a few requests a step for most of it. Here a turn ends
once all but a few of its batch's groups (every sample of a prompt) are whole
(rollout.in_flight_carry) and it has a batch's worth of whole groups; the unfinished
requests stay in the engine while the learner trains, take the new weights with the
next weight load (their KV recomputed or kept: rollout.in_flight_kv_cache), and go on
in the next turn beside the next batch's requests. A call returns the oldest whole
groups, so a batch holds the groups an earlier call left as well as its own: its prompts
need not be one contiguous run of the stream. Only a run's first batch is short (nothing
was left before it).

A group is carried only while it stays fresh enough to be trained: a call is given the
oldest policy version (`carry_floor`) a request still running may have started under,
and steps on until every running request started at or after it.

Multi-turn trajectories (rollout.environment) are carried the same way
(`PartialTrajectories`): a group is a prompt's trajectories, whole once each ended, and
a trajectory's version is its first turn's; one left running keeps its turns, its
environment and any step of it under way, and goes on with its next turn in the next
call.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlray.rollout.engine_loop import EngineLoop, Versions
from rlray.rollout.multiturn import Trajectory, TrajectoryRunner


@dataclass
class Group:
    """One prompt's samples: their requests, and the outputs of those that finished."""

    prompt_index: int
    keys: dict[str, Any]
    """What the caller needs to make each request's episode, by request id."""
    outputs: dict[str, tuple[Any, Versions]] = field(default_factory=dict)

    @property
    def whole(self) -> bool:
        return len(self.outputs) == len(self.keys)


class _Carried(ABC):
    """What both kinds of partial rollout share: the groups callers started and have not
    taken yet, by prompt index (a dict keeps them in the order they were started), and
    when a call may stop. A kind says how the engine runs (`_run`), when a group is
    whole and the oldest version it started under, and what an error leaves (`drop_all`)."""

    groups: dict[int, Any]

    def carried_prompts(self) -> list[int]:
        """Returns the prompt indices of the groups still held, lowest first."""
        return sorted(self.groups)

    def take(self, started: list[int], may_leave: int, carry_floor: int | None) -> list[Any]:
        """Runs the engine until at most `may_leave` of the groups `started` (this call's
        prompt indices) are unfinished, every unfinished group started at or after
        version `carry_floor`, and as many groups as `started` are whole (unless nothing
        was held before this call: a run's first batch is short). Removes and returns
        that many whole groups, oldest first, and every whole group older than the floor;
        `carry_floor` None: waits for and returns every group."""
        wanted = len(started) if carry_floor is not None else len(self.groups)
        first_batch = len(self.groups) == len(started)
        try:
            self._run(lambda: self._may_stop(started, may_leave, carry_floor, wanted, first_batch))
        except BaseException:
            self.drop_all()  # their requests were aborted: none can become whole
            raise
        return self._remove_whole(wanted, carry_floor)

    def _may_stop(
        self,
        started: list[int],
        may_leave: int,
        carry_floor: int | None,
        wanted: int,
        first_batch: bool,
    ) -> bool:
        if carry_floor is None:
            return False
        unfinished = [index for index, g in self.groups.items() if not self._whole(g)]
        if not first_batch and len(self.groups) - len(unfinished) < wanted:
            return False
        if len(set(unfinished).intersection(started)) > may_leave:
            return False
        return all(self._first_version(self.groups[i]) >= carry_floor for i in unfinished)

    def _remove_whole(self, wanted: int, carry_floor: int | None) -> list[Any]:
        """Removes and returns the oldest `wanted` whole groups, and any other whole one
        that started before `carry_floor` (too old to wait for the next call)."""
        whole = [(index, g) for index, g in self.groups.items() if self._whole(g)]
        taken = [
            (index, g)
            for i, (index, g) in enumerate(whole)
            if i < wanted or carry_floor is None or self._first_version(g) < carry_floor
        ]
        for index, _ in taken:
            del self.groups[index]
        return [g for _, g in taken]

    @abstractmethod
    def _run(self, until: Callable[[], bool]) -> None:
        """Runs the engine until `until()` holds or nothing is left running."""

    @abstractmethod
    def _whole(self, group: Any) -> bool:
        """Returns whether every sample of the group is done."""

    @abstractmethod
    def _first_version(self, group: Any) -> int:
        """Returns the oldest policy version a sample of the group started under."""

    @abstractmethod
    def drop_all(self) -> None:
        """Drops every group: an error aborted their requests, or the engine shuts down."""


class PartialBatches(_Carried):
    """Single-turn groups of one engine: each sample one request."""

    def __init__(self, loop: EngineLoop):
        self.session = loop.session()
        self.groups: dict[int, Group] = {}
        self.group_of: dict[str, int] = {}
        """Each running request's prompt index."""

    def add(self, prompt_index: int, requests: list[tuple[str, Any, Any, Any]]) -> None:
        """Starts a group: (request id, prompt, sampling params, key) per sample."""
        group = Group(prompt_index, {rid: key for rid, _, _, key in requests})
        self.groups[prompt_index] = group
        for rid, prompt, params, _ in requests:
            self.group_of[rid] = prompt_index
            self.session.add_request(rid, prompt, params)

    def _run(self, until: Callable[[], bool]) -> None:
        with self.session.aborted_on_error():
            while self.session.pending and not until():
                for output in self.session.step():
                    self._finished(output)

    def _whole(self, group: Group) -> bool:
        return group.whole

    def _first_version(self, group: Group) -> int:
        """The oldest version a request of the group started under."""
        return min(
            group.outputs[rid][1].first if rid in group.outputs else self.session.first_version(rid)
            for rid in group.keys
        )

    def drop_all(self) -> None:
        self.groups.clear()
        self.group_of.clear()

    def _finished(self, output: Any) -> None:
        prompt_index = self.group_of.pop(output.request_id)
        versions = self.session.versions.pop(output.request_id)
        self.groups[prompt_index].outputs[output.request_id] = (output, versions)


class PartialTrajectories(_Carried):
    """Multi-turn groups of one engine: each sample a trajectory, run by a
    TrajectoryRunner made when the first group starts (and made again after an error)."""

    def __init__(self, make_runner: Callable[[], TrajectoryRunner]):
        self.make_runner = make_runner
        self.runner: TrajectoryRunner | None = None
        self.groups: dict[int, list[Trajectory]] = {}

    def add(self, prompt_index: int, trajectories: list[Trajectory]) -> None:
        """Starts a group: one prompt's trajectories."""
        if self.runner is None:
            self.runner = self.make_runner()
        self.groups[prompt_index] = trajectories
        self.runner.start(trajectories)

    def _run(self, until: Callable[[], bool]) -> None:
        if self.runner is not None:
            self.runner.run(until)

    def _whole(self, group: list[Trajectory]) -> bool:
        return all(t.ended for t in group)

    def _first_version(self, group: list[Trajectory]) -> int:
        assert self.runner is not None  # a group was added
        return min(self.runner.first_version(t) for t in group)

    def drop_all(self) -> None:
        self.groups.clear()
        if self.runner is not None:
            self.runner.close()
            self.runner = None
