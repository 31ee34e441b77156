"""Calls with timeouts: every remote wait of the driver and the learner, and what a dead
or stuck actor turns into (an `ActorFailure` that names it).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import ray
from ray.exceptions import (
    ActorUnavailableError,
    GetTimeoutError,
    ObjectLostError,
    RayActorError,
    RayTaskError,
)

from rlray.core.episode import Episode
from rlray.core.groups import select_groups


class ActorFailure(RuntimeError):
    """A remote call failed or timed out; the message names the actor and its last error.
    `died` is True when the actor's process (or node) died, False for an error raised by
    the call or a timeout; `actor_id` is the dead actor's id where Ray names it (it can be
    another actor than the one called: the one that made the call's argument)."""

    def __init__(
        self,
        message: str,
        died: bool = False,
        actor_id: str | None = None,
        restarting: bool = False,
        lost: bool = False,
        refused: bool = False,
    ):
        super().__init__(message)
        self.died = died
        self.actor_id = actor_id
        self.restarting = restarting
        """Ray is restarting the actor (it answers once it is up again)."""
        self.lost = lost
        """An object the call needed was lost with its node: make it again, then retry."""
        self.refused = refused
        """A restarted actor refused the call until it is restored (ActorRestarted)."""


class ActorRestarted(RuntimeError):
    """Raised by a restarted actor whose state its caller must restore first (a rollout
    worker's weights, the buffer's batches): a restart between two calls is otherwise
    invisible to the caller."""


def _restarted() -> bool:
    with warnings.catch_warnings():  # Ray's own property reads a deprecated one
        warnings.simplefilter("ignore")
        return ray.get_runtime_context().was_current_actor_reconstructed


def wait_for(ref: Any, actor: str, what: str, timeout_s: float) -> Any:
    """Returns ray.get(ref) within timeout_s, or raises ActorFailure naming the actor."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except GetTimeoutError:
        raise ActorFailure(f"{actor}: no answer to {what} within {timeout_s:.0f} s") from None
    except (RayTaskError, RayActorError, ObjectLostError) as err:
        raise failure_of(err, actor, what) from err


def failure_of(err: Exception, actor: str, what: str) -> ActorFailure:
    """What Ray's error for a call on `actor` means to the caller: an error the call
    raised; the actor's death (or the death of the actor that made an argument); or an
    argument lost with its node, which a task whose argument could not be fetched reports
    as its own error (RayTaskError caused by ObjectLostError)."""
    if isinstance(err, RayTaskError):
        message = f"{actor}: {what} failed: {_last_line(err)}"
        if isinstance(err.cause, RayActorError):  # the actor that made an argument died
            return ActorFailure(message, died=True, actor_id=err.cause.actor_id)
        if isinstance(err.cause, ObjectLostError):
            return ActorFailure(message, died=True, lost=True)
        restarted = isinstance(err.cause, ActorRestarted)
        return ActorFailure(message, died=restarted, refused=restarted)
    if isinstance(err, RayActorError):
        message = f"{actor} died during {what}: {_last_line(err)}"
        restarting = isinstance(err, ActorUnavailableError)
        return ActorFailure(message, True, err.actor_id, restarting)
    message = f"{actor}: {what} lost its input with a node: {_last_line(err)}"
    return ActorFailure(message, died=True, lost=True)


def _last_line(err: Exception) -> str:
    cause = getattr(err, "cause", None)
    if isinstance(cause, BaseException) and not isinstance(cause, (RayTaskError, RayActorError)):
        return f"{type(cause).__name__}: {cause}"
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__


def resolve_episodes(batch_refs: Sequence[list[Any]], timeout_s: float) -> list[Episode]:
    """Returns the episodes behind buffered references, fetched here: [ref] for a whole
    batch, [ref, start, stop] for its groups start to stop (rlray.episodes.buffer)."""
    batches = ray.get([box[0] for box in batch_refs], timeout=timeout_s)
    return [
        episode
        for box, batch in zip(batch_refs, batches, strict=True)
        for episode in (select_groups(batch, box[1], box[2]) if len(box) == 3 else batch)
    ]
