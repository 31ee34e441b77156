"""Actor restarts, as the driver lives through them.

Ray restarts a dead rollout, reward, buffer or store actor (ray.max_actor_restarts). A
restarted actor comes back empty, so the part of the driver that owns what it held
puts it back: a rollout worker gets the current weights (weight sync), the buffer its
batches (training), the store every write it had not confirmed (store writes). Each
part registers that as a restorer for its role. A learner is never restarted: its
weights would be lost, and the run resumes from its checkpoint instead.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from rlray.cluster.calls import ActorFailure, wait_for
from rlray.cluster.start import Actors, restart_count

logger = logging.getLogger(__name__)

Restorer = Callable[[str], None]
"""Brings a restarted actor (by name) up to date."""


class Recovery:
    """Waits for Ray to restart a dead actor, counts the restart, and has the actor's
    role restore it; calls that may meet a dead actor go through `retrying`."""

    def __init__(self, actors: Actors, call_timeout_s: float, start_timeout_s: float):
        self.actors = actors
        self.timeout_s = call_timeout_s
        self.start_timeout_s = start_timeout_s
        self.restarts: dict[str, int] = {}
        """Actor restarts seen by this driver, by actor name."""
        self.restorers: dict[str, Restorer] = {}
        """By role: "rollout", "reward", "buffer", "store"."""
        self.restored: dict[str, int] = {}
        """By process (its first actor name): Ray's restart count when it was last
        restored. Every call in flight meets one death: the first restores the process,
        the others find it restored (a restored buffer refuses a second restore)."""

    def call(self, actor: str, ref: Any, what: str) -> Any:
        """Returns ray.get(ref) within the call timeout, or raises ActorFailure."""
        return wait_for(ref, actor, what, self.timeout_s)

    def retrying(self, name: str, call: Callable[[], Any], what: str) -> Any:
        """Returns the result of `call()` (a remote call on actor `name`), made again on
        the restarted actor for as long as Ray restarts it."""
        while True:
            try:
                return self.call(name, call(), what)
            except ActorFailure as err:
                if not err.died or err.lost:  # a lost input is not made again by a retry
                    raise
                self.recover(name, err)

    def recover(self, name: str, failure: ActorFailure) -> None:
        """Waits for Ray to restart the dead actor `name` and has its role restore it.
        Raises the failure, still marked died, if Ray does not restart it."""
        if failure.lost:
            logger.warning("%s; making it again", failure)
            return
        name = self.actors.name_of(failure.actor_id) or name  # the one that died
        if name.startswith("learner"):  # not restarted: its weights would be lost
            raise ActorFailure(f"learner died; {failure}", died=True) from failure
        process = self.actors.process_name(name)  # store, for the buffer and the scorer
        logger.warning("%s; waiting for Ray to restart %s", failure, process)
        self._wait_until_up(name, failure)
        restarts = restart_count(self.actors.handle(name))
        if not failure.refused and restarts <= self.restored.get(process, 0):
            return  # another call met the same death and restored the process
        for role in self.actors.sharing(name):  # the store's restart is the buffer's too
            restore = self.restorers.get(_role(role))
            if restore is not None:
                restore(role)
        self.restored[process] = restarts
        self.count_restarts()  # one death fails every call in flight: count it once

    def restore_restarted(self, names: list[str]) -> None:
        """Restores those of the actors `names` that Ray restarted since the driver last
        counted: deaths no call of the driver met (the agent endpoint's calls did)."""
        counts = self.actors.restart_counts()
        for name in names:
            if counts.get(name, 0) > self.restarts.get(name, 0):
                self.recover(name, ActorFailure(f"{name} died under the agents' calls", died=True))

    def count_restarts(self) -> dict[str, int]:
        """Returns Ray's count of each actor's restarts in this run, logging each new one
        (an endpoint's too, which no call of the driver may meet)."""
        for name, count in self.actors.restart_counts().items():
            if count > self.restarts.get(name, 0):
                self.restarts[name] = count
                logger.warning("%s restarted (restart %d of this run)", name, count)
        return dict(self.restarts)

    def _wait_until_up(self, name: str, failure: ActorFailure) -> None:
        """Waits until the restarted actor answers; raises, naming it, if Ray gave up."""
        handle = self.actors.handle(name)
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            try:
                self.call(name, handle.__ray_ready__.remote(), "restart")
                return
            except ActorFailure as again:
                if not again.restarting or time.monotonic() > deadline:
                    raise ActorFailure(f"{failure} (not restarted: {again})", died=True) from None
            time.sleep(0.5)


def _role(name: str) -> str:
    """Returns an actor's role: rollout-0 -> rollout, store -> store."""
    return name.partition("-")[0]
