"""Ctrl-C held back while the driver moves batches between places.

Python raises KeyboardInterrupt at the next bytecode after the signal, which is often
inside a Ray call: `buffer.take` answered but its batches never reached the driver's
records, or a task went out and its reference never came back. Such a batch is then
lost (or stored twice) when the run stops. `interrupts_held` makes the call and the
record of it one step: a Ctrl-C (or SIGTERM) that arrives in between takes effect when
the block ends.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Defers SIGINT and SIGTERM until the block ends, then hands each one that arrived
    to the handler it would have reached (KeyboardInterrupt for Ctrl-C, by default).
    Blocks nest. Off the main thread, where Python delivers no signals, it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []

    def hold(signum: int, _frame: object) -> None:
        arrived.append(signum)

    # A handler installed from C (getsignal gives None) cannot be put back: left alone.
    installed = [signum for signum in HELD_SIGNALS if signal.getsignal(signum) is not None]
    previous = {signum: signal.signal(signum, hold) for signum in installed}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    for signum in dict.fromkeys(arrived):
        deliver(signum, previous[signum])


def deliver(signum: int, handler: object) -> None:
    """Hands a held signal to `handler`, as the signal itself would have."""
    if callable(handler):
        handler(signum, None)
    elif handler == signal.SIG_DFL:
        signal.raise_signal(signum)  # the default handler is restored: it acts now


def stop_on_sigterm() -> None:
    """Makes SIGTERM stop the run as Ctrl-C does (`ray job stop` sends it)."""
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)


def _raise_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def stop_at_once_on_signals() -> None:
    """Lets SIGINT and SIGTERM end the process at once, as their defaults do: for the
    shutdown after a run (Ray's, at exit), which a traceback would only clutter."""
    for signum in HELD_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)
