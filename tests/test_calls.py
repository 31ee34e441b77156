"""What Ray's errors for a call mean to the driver (rlray.cluster.calls.failure_of): the
errors are Ray's own classes, as a failed ray.get raises them."""

from __future__ import annotations

from ray.exceptions import ObjectReconstructionFailedError, RayTaskError

from rlray.cluster.calls import ActorRestarted, failure_of


def lost_object() -> ObjectReconstructionFailedError:
    return ObjectReconstructionFailedError("32cc" * 10, None, "")


def test_a_task_whose_argument_was_lost_with_its_node_is_told_to_make_it_again():
    # A reward worker's score of a batch whose episodes were on a node that was removed.
    failure = failure_of(RayTaskError("score", "", lost_object()), "reward-1", "score")
    assert failure.died and failure.lost
    assert str(failure).startswith("reward-1: score failed: ObjectReconstructionFailedError")


def test_an_object_lost_on_its_own_is_lost_and_an_error_of_the_call_is_not():
    failure = failure_of(lost_object(), "learner", "train step")
    assert failure.died and failure.lost
    raised = failure_of(RayTaskError("score", "", ValueError("bad")), "reward-0", "score")
    assert not raised.died and not raised.lost
    assert str(raised) == "reward-0: score failed: ValueError: bad"


def test_a_restarted_actor_that_refuses_the_call_is_a_death_to_restore_from():
    cause = ActorRestarted("buffer was restarted and has not been restored since")
    failure = failure_of(RayTaskError("add", "", cause), "buffer", "add")
    assert failure.died and failure.refused and not failure.lost
