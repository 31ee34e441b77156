"""RewardProcess: a reward worker's reward functions, run in a child process of their own
(InProcessRewards: built-ins that need none, called where the worker runs).

User reward code can end the process it runs in: `sys.exit`, `os._exit`, a crash in a C
extension. Run in the reward actor itself, any of those would kill the actor and the run
with it. In a child process they end only the child: the call fails (the episodes it
scored count as that reward's failures), and the next call starts a fresh child. A call
past its timeout kills the child too, so a stuck reward stops using the CPU.

The child is `python -m rlray.rewards.child FD`, not a multiprocessing spawn: inside a
Ray actor, spawn would re-import Ray's worker script as the child's main module. Requests
and answers are pickled over a socket pair (file descriptor FD), so what user code prints
on stdout cannot corrupt them. The child loads every reward once when it starts (classes
are constructed then), and ignores SIGINT: Ctrl-C stops the run through its driver.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Any

from rlray.config import RewardSpec
from rlray.rewards.loading import IN_PROCESS_REWARDS, call_reward, describe_failure, load_reward

# How long a child may take to import and load its rewards (model rewards load models).
START_TIMEOUT_S = 600.0


class RewardCallError(RuntimeError):
    """A reward raised, exited or crashed in the child; the message says which."""


def reward_caller(specs: list[RewardSpec]) -> RewardProcess | InProcessRewards:
    """Returns what calls these rewards: this process when each is a built-in that needs
    no child (loading.IN_PROCESS_REWARDS), else a child process (whose memory is spared
    where no reward needs one)."""
    if all(spec.name in IN_PROCESS_REWARDS for spec in specs):
        return InProcessRewards(specs)
    return RewardProcess(specs)


class InProcessRewards:
    """Calls built-in rewards in this process, as RewardProcess calls any reward in its
    child: a reward that raises fails its call with RewardCallError."""

    def __init__(self, specs: list[RewardSpec]):
        self.specs = specs
        self.rewards = [load_reward(spec) for spec in specs]

    def call(self, index: int, arguments: dict[str, Any], timeout_s: float) -> Any:
        """Returns reward `index`'s result for these call arguments; `timeout_s` does not
        apply (these rewards are linear in their input)."""
        try:
            return call_reward(self.rewards[index], arguments)
        except Exception as err:
            raise RewardCallError(describe_failure(err)) from err

    def close(self) -> None:
        """Nothing to stop."""


class RewardProcess:
    """Calls the rewards of `specs` in a child process, restarting it when it dies."""

    def __init__(self, specs: list[RewardSpec]):
        self.specs = specs
        self._process: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._start()

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        self._process = subprocess.Popen(
            [sys.executable, "-m", "rlray.rewards.child", str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
        )
        theirs.close()
        self._conn = Connection(ours.detach())
        self._conn.send((list(sys.path), self.specs))
        status, detail = self._receive(START_TIMEOUT_S, "loading the rewards")
        if status != "ready":
            self.close()
            raise RuntimeError(f"reward process could not load the rewards: {detail}")

    def call(self, index: int, arguments: dict[str, Any], timeout_s: float) -> Any:
        """Returns reward `index`'s result for these call arguments (prompts, completions,
        columns). Raises TimeoutError past `timeout_s`, RewardCallError if the reward
        raised, exited or crashed (the child is restarted before the next call)."""
        if self._process is None or self._process.poll() is not None:
            self._start()
        self._conn.send((index, arguments))
        status, detail = self._receive(timeout_s, "a reward call")
        if status == "ok":
            return detail
        raise RewardCallError(detail)

    def _receive(self, timeout_s: float, what: str) -> tuple[str, Any]:
        if not self._conn.poll(timeout_s):
            self._kill()
            raise TimeoutError(f"no answer to {what} within {timeout_s:g} s")
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            code = self._process.wait(timeout=10)
            self._kill()
            return "died", f"the reward process exited with code {code} ({_exit_reason(code)})"

    def _kill(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()
        if self._conn is not None:
            self._conn.close()
        self._process, self._conn = None, None

    def close(self) -> None:
        """Stops the child."""
        self._kill()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._kill()


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        return f"killed by signal {signal.Signals(-code).name}"
    return "sys.exit or os._exit in reward code" if code else "exited"
