"""The child process of rlray.rewards.process: `python -m rlray.rewards.child FD`.

Loads the rewards it is sent, then answers calls over the connection on file descriptor
FD until its parent goes away. A module of its own, which the rewards package does not
import, so that `-m` runs it fresh.
"""

from __future__ import annotations

import signal
import sys
from multiprocessing.connection import Connection

from rlray.rewards.loading import call_reward, describe_failure, load_reward


def _serve(conn: Connection) -> None:
    """The child's loop: load the rewards, then answer calls until the parent goes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent_path, specs = conn.recv()
    sys.path[:] = parent_path
    try:
        rewards = [load_reward(spec) for spec in specs]
    except BaseException as err:
        conn.send(("error", describe_failure(err)))
        return
    conn.send(("ready", None))
    while True:
        try:
            index, arguments = conn.recv()
        except EOFError:
            return  # the reward worker is gone
        try:
            value = call_reward(rewards[index], arguments)
        except BaseException as err:  # SystemExit and KeyboardInterrupt too: a failed call
            conn.send(("error", describe_failure(err)))
            continue
        try:
            conn.send(("ok", value))
        except Exception as err:
            message = f"returned a value that cannot be sent back: {describe_failure(err)}"
            conn.send(("error", message))


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])))
