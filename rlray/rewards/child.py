"""The child process of rlray.rewards.process: `python -m rlray.rewards.child FD`.

Loads the rewards it is sent, then answers calls over the connection on file descriptor
FD until its parent goes away. A module of its own, which the rewards package does not
import, so that `-m` runs it fresh.
"""

from __future__ import annotations

import signal
import sys
from multiprocessing.connection import Connection

from rlray.rewards.loading import accepted_columns, load_reward


def _serve(conn: Connection) -> None:
    """The child's loop: load the rewards, then answer calls until the parent goes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent_path, specs = conn.recv()
    sys.path[:] = parent_path
    try:
        rewards = [load_reward(spec) for spec in specs]
    except BaseException as err:
        conn.send(("error", _describe(err)))
        return
    conn.send(("ready", None))
    while True:
        try:
            index, arguments = conn.recv()
        except EOFError:
            return  # the reward worker is gone
        reward = rewards[index]
        columns = arguments.pop("columns")
        try:
            value = reward.fn(**arguments, **accepted_columns(reward.fn, columns), **reward.kwargs)
        except BaseException as err:  # SystemExit and KeyboardInterrupt too: a failed call
            conn.send(("error", _describe(err)))
            continue
        try:
            conn.send(("ok", value))
        except Exception as err:
            conn.send(("error", f"returned a value that cannot be sent back: {_describe(err)}"))


def _describe(err: BaseException) -> str:
    if isinstance(err, SystemExit):
        return f"called sys.exit({err.code!r})"
    return f"raised {type(err).__name__}: {err}"


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])))
