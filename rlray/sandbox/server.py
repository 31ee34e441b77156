"""The caller's side of the sandbox server: `launcher.py` serving runs, one per process.

A run is requested with its limits and the child's ends of three pipes (stdin, stdout,
stderr), passed as file descriptors; the server forks the run and answers with its pid
and a pidfd, and reports its exit status once it has reaped it. Requests, answers and
exits travel as JSON on a SOCK_SEQPACKET socket (one message each). A reader thread takes
the server's messages; a thread of its own starts the server and waits for it, because
the server's parent-death signal follows the thread that started it, and a pool's
thread ends before the process does.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import threading
from typing import Any

_START_TIMEOUT_S = 30.0  # a fork's answer; the server's own start takes well under that


class ServerGone(RuntimeError):
    """The sandbox server ended: its runs are gone with it."""


class Child:
    """One run of the server's, as the caller holds it."""

    def __init__(self, server: SandboxServer, pid: int, pidfd: int, pipes: tuple[int, int, int]):
        self.server, self.pid, self.pidfd = server, pid, pidfd
        stdin, stdout, stderr = pipes
        self.stdin = open(stdin, "wb", buffering=0)  # noqa: SIM115 (closed by close())
        self.stdout = open(stdout, "rb", buffering=0)  # noqa: SIM115
        self.stderr = open(stderr, "rb", buffering=0)  # noqa: SIM115

    @property
    def returncode(self) -> int | None:
        """Its exit status (negative: the signal that killed it); None until reaped."""
        return self.server.exit_code(self.pid)

    def wait(self, timeout: float) -> int | None:
        """Returns its exit status once reaped, None if that takes over `timeout`."""
        return self.server.wait_exit(self.pid, timeout)

    def stop(self) -> None:
        """Asks the server to kill it (its watcher, or its process group)."""
        self.server.stop(self.pid)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)

    def close(self) -> None:
        for stream in (self.stdin, self.stdout, self.stderr):
            with contextlib.suppress(OSError):
                stream.close()
        with contextlib.suppress(OSError):
            os.close(self.pidfd)
        self.server.forget(self.pid)


class SandboxServer:
    """A running `launcher.py` in serving mode, started with `command` and `config`."""

    def __init__(self, command: list[str], config: dict[str, Any], env: dict[str, str]):
        self.socket, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        config = {**config, "caller": os.getpid(), "socket": theirs.fileno()}
        argv = [*command, json.dumps(config)]
        self._started = threading.Event()
        self._process: subprocess.Popen | None = None
        self._failed: BaseException | None = None
        owner = threading.Thread(
            target=self._own, args=(argv, theirs, env), name="sandbox-server", daemon=True
        )
        owner.start()
        self._started.wait()
        theirs.close()
        if self._failed is not None:
            raise ServerGone(f"the sandbox server did not start: {self._failed}")
        self.pid = os.getpid()  # the process that owns it: a fork of it has none
        self._ids = itertools.count()
        self._send_lock = threading.Lock()
        self._changed = threading.Condition()
        self._replies: dict[int, tuple[int, int]] = {}
        self._exits: dict[int, int] = {}
        self._forgotten: set[int] = set()  # runs whose exit nobody waits for
        self.alive = True
        threading.Thread(target=self._read, name="sandbox-server-reader", daemon=True).start()

    def _own(self, argv: list[str], theirs: socket.socket, env: dict[str, str]) -> None:
        try:
            self._process = subprocess.Popen(
                argv,
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                cwd="/",
                env=env,
                start_new_session=True,
            )
        except BaseException as error:
            self._failed = error
            self._started.set()
            return
        self._started.set()
        self._process.wait()

    def _read(self) -> None:
        while True:
            try:
                message, fds, _, _ = socket.recv_fds(self.socket, 65536, 1)
            except OSError:
                message, fds = b"", []
            with self._changed:
                if not message:
                    self.alive = False
                    self._changed.notify_all()
                    return
                news = json.loads(message)
                if "exited" in news and news["exited"] in self._forgotten:
                    self._forgotten.discard(news["exited"])
                elif "exited" in news:
                    self._exits[news["exited"]] = news["code"]
                else:
                    self._replies[news["id"]] = (news["pid"], fds[0])
                self._changed.notify_all()

    def start(self, run: dict[str, Any], pipes: tuple[int, int, int]) -> int:
        """Requests a run with the child's ends of its three pipes; returns its pid and
        pidfd. Raises ServerGone if the server has ended."""
        with self._send_lock:
            request = next(self._ids)
            message = json.dumps({**run, "id": request}).encode()
            try:
                socket.send_fds(self.socket, [message], list(pipes))
            except OSError as error:
                raise ServerGone(f"the sandbox server ended: {error}") from None
        with self._changed:
            if not self._changed.wait_for(
                lambda: request in self._replies or not self.alive, _START_TIMEOUT_S
            ):
                raise ServerGone("the sandbox server did not answer")
            if request not in self._replies:
                raise ServerGone("the sandbox server ended")
            return self._replies.pop(request)

    def stop(self, pid: int) -> None:
        with self._send_lock, contextlib.suppress(OSError):
            socket.send_fds(self.socket, [json.dumps({"stop": pid}).encode()], [])

    def exit_code(self, pid: int) -> int | None:
        with self._changed:
            return self._exits.get(pid)

    def wait_exit(self, pid: int, timeout: float) -> int | None:
        """Returns the run's exit status once reaped; None after `timeout`. A run of a
        server that ended was killed with it."""
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exits or not self.alive, timeout)
            return self._exits.get(pid, None if self.alive else -signal.SIGKILL)

    def forget(self, pid: int) -> None:
        """Drops the run's exit status, now or when it comes."""
        with self._changed:
            if self._exits.pop(pid, None) is None:
                self._forgotten.add(pid)

    def close(self) -> None:
        """Ends the server (its runs die with it)."""
        with contextlib.suppress(OSError):
            self.socket.shutdown(socket.SHUT_RDWR)
        if self._process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(timeout=10)
