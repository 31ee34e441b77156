"""The board where a node's rollout workers lend their idle cores to its learner
(rlray.core.idle_cores, learner.borrow_idle_cores)."""

from __future__ import annotations

import threading
import time

import pytest

from rlray.core.idle_cores import CoreLender, IdleCores, board_folder


@pytest.fixture
def run_id(tmp_path):
    run_id = f"test-{tmp_path.name}"
    yield run_id
    IdleCores(run_id).remove()


def test_idle_workers_lend_their_cores_and_generating_ones_do_not(run_id):
    board = IdleCores(run_id)
    assert board.idle() == 0  # no worker has posted: nothing to borrow
    one, two = CoreLender(run_id, "rollout-0", 1), CoreLender(run_id, "rollout-1", 2)
    assert board.idle() == 3
    with one.busy():
        assert board.idle() == 2
        with two.busy():
            assert board.idle() == 0
        assert board.idle() == 2
    assert board.idle() == 3
    assert IdleCores("another-run").idle() == 0


def test_overlapping_calls_hold_the_cores_until_the_last_ends(run_id):
    """In-flight updates and agents' calls run in threads of one worker."""
    lender, board = CoreLender(run_id, "rollout-0", 1), IdleCores(run_id)
    first_in, second_in, first_may_end = threading.Event(), threading.Event(), threading.Event()

    def first_call():
        with lender.busy():
            first_in.set()
            first_may_end.wait(10)

    thread = threading.Thread(target=first_call)
    thread.start()
    first_in.wait(10)
    with lender.busy():
        second_in.set()
        first_may_end.set()
        thread.join(10)
        assert board.idle() == 0  # the first call ended; this one still generates
    assert board.idle() == 1


def test_a_worker_idle_since_before_the_last_weights_lends_nothing(run_id):
    """It is about to load them and generate: the learner waits for its next idle spell."""
    lender, board = CoreLender(run_id, "rollout-0", 1), IdleCores(run_id)
    weights_sent_at = time.monotonic()
    assert board.idle(since=weights_sent_at) == 0
    with lender.busy():  # loads, generates
        pass
    assert board.idle(since=weights_sent_at) == 1


def test_a_garbled_post_counts_no_core_and_the_board_goes_at_the_end(run_id):
    CoreLender(run_id, "rollout-0", 2)
    (board_folder(run_id) / "rollout-1").write_bytes(b"half a")
    board = IdleCores(run_id)
    assert board.idle() == 2
    board.remove()
    assert not board_folder(run_id).exists()
    assert board.idle() == 0
