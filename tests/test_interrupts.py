"""Ctrl-C and SIGTERM held until a block ends, then delivered as they would have been."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from rlray.core.interrupts import interrupts_held


def send(signum: int) -> None:
    os.kill(os.getpid(), signum)


def test_a_ctrl_c_in_the_block_acts_when_the_block_ends():
    steps = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_held():
            send(signal.SIGINT)
            steps.append("after the signal")
        steps.append("after the block")
    assert steps == ["after the signal"]


def test_nested_blocks_deliver_at_the_outermost_end():
    steps = []
    with pytest.raises(KeyboardInterrupt), interrupts_held():
        with interrupts_held():
            send(signal.SIGINT)
        steps.append("inner ended")
    assert steps == ["inner ended"]


def test_each_held_signal_reaches_its_own_handler_once():
    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, _: received.append(signum))
    try:
        with interrupts_held():
            send(signal.SIGTERM)
            send(signal.SIGTERM)
            assert received == []
        assert received == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_the_handlers_are_put_back_also_when_the_block_raises():
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(ValueError), interrupts_held():
        raise ValueError("inside")
    assert {signum: signal.getsignal(signum) for signum in before} == before
    with pytest.raises(KeyboardInterrupt):
        send(signal.SIGINT)  # Python's own handler again


def test_off_the_main_thread_it_changes_nothing():
    seen = []

    def run() -> None:
        with interrupts_held():
            seen.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [signal.default_int_handler]
