"""Runs untrusted Python source in a sandboxed child process: `run_python(source, limits)`.

What the child gets, where the machine allows it (probed once per process and logged):
- a fresh temporary directory as cwd, deleted afterwards, and a minimal environment;
- a wall-clock limit, after which its process group, and any process left in its network
  namespace, is killed; RLIMIT_CPU, RLIMIT_AS, RLIMIT_NPROC; output cut at a byte limit;
- when started as root, an unprivileged user (`nobody`), since RLIMIT_NPROC does not bind
  uid 0, and `nobody` cannot touch root's files;
- a new network namespace, whose only interface (lo) is down. Where namespaces are
  refused, a socket guard in the child instead, which determined code can undo.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import grp
import itertools
import logging
import os
import pwd
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
PR_SET_NO_NEW_PRIVS = 38
_LIBC = ctypes.CDLL(None, use_errno=True)
# Looked up now, not in the child: a symbol lookup after fork could wait on a lock that
# another thread of this process held at the fork.
_UNSHARE = _LIBC.unshare
_PRCTL = _LIBC.prctl

_SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"
# Isolated mode (no PYTHON* variables, no user site), no site-packages, no .pyc writes.
_PYTHON_FLAGS = ("-I", "-S", "-B")
_MAX_FILE_BYTES = 64 * 2**20  # RLIMIT_FSIZE: one run cannot fill the disk with one file
_NOBODY = 65534  # uid and gid of nobody/nogroup where the names are missing

# Without a network namespace: refuse connections and datagrams from Python code, then run
# the source (read from stdin, as `python -` would) as __main__.
_SOCKET_GUARD = """\
import socket as _socket
def _refuse(*args, **kwargs):
    raise PermissionError("network access is disabled in this sandbox")
for _name in ("connect", "connect_ex", "sendto", "sendmsg"):
    setattr(_socket.socket, _name, _refuse)
_socket.create_connection = _refuse
del _socket, _refuse, _name
exec(compile(__import__("sys").stdin.buffer.read(), "<stdin>", "exec"))
"""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run."""

    timeout_s: float = 5.0
    """Wall-clock limit; the whole process group is killed at the limit."""
    cpu_s: int = 5
    """CPU seconds per process (RLIMIT_CPU)."""
    memory_mb: int = 512
    """Address space per process (RLIMIT_AS)."""
    max_processes: int = 16
    """Processes and threads the run may have at once, its first one included."""
    max_output_bytes: int = 65536
    """Bytes kept of stdout and of stderr each; the rest is read and dropped."""


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one sandboxed run."""

    returncode: int | None
    """Exit status (negative: killed by that signal); None when killed at the timeout."""
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float
    """Wall-clock seconds from start to the end of clean-up."""


@dataclass(frozen=True)
class _Isolation:
    """How children start on this machine."""

    interpreter: str
    user: tuple[int, int] | None
    """(uid, gid) the child switches to; None: it stays this process's user."""
    unshare_flags: int
    """Namespaces the child enters; 0: none, the socket guard instead."""


def run_python(source: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Returns the exit status and output of `source` run as __main__ under `limits`."""
    isolation = _isolation()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rlray-sandbox-") as workdir:
        if isolation.user is not None:
            os.chown(workdir, *isolation.user)
        with _start(isolation, limits, workdir) as process:
            netns = _network_namespace(process.pid) if isolation.unshare_flags else None
            try:
                _send_source(process, source)
                deadline = started + limits.timeout_s
                stdout, stderr, timed_out = _collect_output(process, deadline, limits)
            finally:
                _kill_what_is_left(process, netns)
    return SandboxResult(
        returncode=None if timed_out else process.returncode,
        stdout=stdout.decode("utf-8", errors="replace"),
        stderr=stderr.decode("utf-8", errors="replace"),
        timed_out=timed_out,
        seconds=time.monotonic() - started,
    )


def _start(isolation: _Isolation, limits: SandboxLimits, workdir: str) -> subprocess.Popen:
    if isolation.unshare_flags:
        command = [isolation.interpreter, *_PYTHON_FLAGS, "-"]
    else:
        command = [isolation.interpreter, *_PYTHON_FLAGS, "-c", _SOCKET_GUARD]
    rlimits = _resource_limits(limits, _process_limit(isolation, limits))
    return subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        bufsize=0,
        cwd=workdir,
        env={"PATH": _SYSTEM_PATH, "LANG": "C.UTF-8", "HOME": workdir},
        start_new_session=True,  # its own process group, killed as one
        preexec_fn=functools.partial(_prepare_child, isolation, rlimits),
    )


def _send_source(process: subprocess.Popen, source: str) -> None:
    # A blocking write cannot hang on untrusted code: the interpreter reads all of stdin
    # before it runs any of it. Source on stdin is in no file the code could read back.
    with contextlib.suppress(BrokenPipeError):
        process.stdin.write(source.encode("utf-8", errors="replace"))
    with contextlib.suppress(BrokenPipeError):
        process.stdin.close()


def _collect_output(
    process: subprocess.Popen, deadline: float, limits: SandboxLimits
) -> tuple[bytes, bytes, bool]:
    """Returns stdout, stderr (each cut at the limit) and whether the deadline passed first.

    Reads until the child has exited and every process sharing its output has closed it.
    The child is not reaped here, so that its process group id cannot be reused before
    the group is killed."""
    outputs = {process.stdout.fileno(): bytearray(), process.stderr.fileno(): bytearray()}
    exit_fd = os.pidfd_open(process.pid)  # readable once the child has exited
    timed_out = False
    try:
        with selectors.DefaultSelector() as selector:
            for fd in [*outputs, exit_fd]:
                selector.register(fd, selectors.EVENT_READ)
            while selector.get_map() and not timed_out:
                remaining = deadline - time.monotonic()
                timed_out = remaining <= 0
                for key, _ in selector.select(max(remaining, 0)):
                    _read_ready(key.fd, selector, outputs, limits.max_output_bytes)
    finally:
        os.close(exit_fd)
    stdout, stderr = outputs.values()
    return bytes(stdout), bytes(stderr), timed_out


def _read_ready(
    fd: int, selector: selectors.BaseSelector, outputs: dict[int, bytearray], max_bytes: int
) -> None:
    # Output beyond the limit is read and dropped, so that the child never blocks on a
    # full pipe. The exit fd (not in outputs) is done once readable, as is a closed pipe.
    chunk = os.read(fd, 65536) if fd in outputs else b""
    if not chunk:
        selector.unregister(fd)
    else:
        outputs[fd] += chunk[: max_bytes - len(outputs[fd])]


def _kill_what_is_left(process: subprocess.Popen, netns: str | None) -> None:
    """Kills the child's process group and, with a namespace, every process still in it
    (those that left the group with setsid), then reaps the child."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    if netns is not None:
        _kill_processes_in(netns)
    process.wait()


def _network_namespace(pid: int) -> str | None:
    # Read right after the exec, while the interpreter is still starting up.
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def _kill_processes_in(netns: str) -> None:
    # Only this run's processes are in its namespace; one leaves it only for a namespace
    # of its own (a new user namespace), which this misses. Rounds repeat while the
    # survivors of one could still fork during it.
    for _ in range(10):
        found = False
        for link in Path("/proc").glob("[0-9]*/ns/net"):
            with contextlib.suppress(OSError):
                if os.readlink(link) == netns:
                    os.kill(int(link.parent.parent.name), signal.SIGKILL)
                    found = True
        if not found:
            return


def _prepare_child(isolation: _Isolation, rlimits: list[tuple[int, int]]) -> None:
    """Runs in the child between fork and exec: system calls only, with everything they
    need computed beforehand, because another thread may have held a lock at the fork."""
    for which, value in rlimits:
        resource.setrlimit(which, (value, value))
    if isolation.unshare_flags:
        _enter_namespaces(isolation.unshare_flags)  # needs privileges, so before the drop
    if isolation.user is not None:
        _drop_privileges(*isolation.user)
    _PRCTL(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # no setuid program gives them back


def _enter_namespaces(flags: int) -> None:
    if _UNSHARE(flags) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


def _drop_privileges(uid: int, gid: int) -> None:
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)


def _resource_limits(limits: SandboxLimits, max_tasks: int) -> list[tuple[int, int]]:
    """Returns (resource, limit) pairs, each capped at this process's hard limit (which an
    unprivileged child could not raise)."""
    wanted = {
        resource.RLIMIT_CPU: limits.cpu_s,
        resource.RLIMIT_AS: limits.memory_mb * 2**20,
        resource.RLIMIT_NPROC: max_tasks,
        resource.RLIMIT_FSIZE: _MAX_FILE_BYTES,
        resource.RLIMIT_CORE: 0,
    }
    capped = []
    for which, value in wanted.items():
        hard = resource.getrlimit(which)[1]
        capped.append((which, value if hard == resource.RLIM_INFINITY else min(value, hard)))
    return capped


def _process_limit(isolation: _Isolation, limits: SandboxLimits) -> int:
    """Returns the RLIMIT_NPROC value that lets the child's user have max_processes more.

    The limit binds the count of all tasks (threads too) of the child's real uid on the
    machine, not the run's own: those of this user's other processes, and of concurrent
    runs as the same user, are added so that the run gets its own max_processes."""
    uid = isolation.user[0] if isolation.user is not None else os.getuid()
    return _tasks_of_user(uid) + limits.max_processes


def _tasks_of_user(uid: int) -> int:
    count = 0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            lines = status.read_text().splitlines()
        except OSError:
            continue  # exited while listed
        fields = {key: value for key, _, value in (line.partition(":") for line in lines)}
        if int(fields["Uid"].split()[0]) == uid:
            count += int(fields["Threads"])
    return count


_ISOLATION_LOCK = threading.Lock()


def _isolation() -> _Isolation:
    with _ISOLATION_LOCK:  # probe and log once, even when two threads start together
        return _probe_isolation()


@functools.cache
def _probe_isolation() -> _Isolation:
    """Returns the most isolated way to start a child that works here, and logs it."""
    for candidate in _candidates():
        if _starts(candidate):
            _log_isolation(candidate)
            return candidate
    raise RuntimeError(f"cannot start {sys.executable} as a child process")


def _candidates() -> list[_Isolation]:
    """Returns the ways to start a child, best first: another user, then namespaces, then
    this interpreter over the system's (root's may lie where `nobody` cannot read it)."""
    interpreters = [sys.executable]
    system_python = shutil.which("python3", path=_SYSTEM_PATH)
    if system_python is not None and system_python != sys.executable:
        interpreters.append(system_python)
    if os.geteuid() == 0:
        users, flags = [_unprivileged_user(), None], [CLONE_NEWNET, 0]
    else:
        # A user namespace lets an unprivileged process create the network namespace.
        users, flags = [None], [CLONE_NEWUSER | CLONE_NEWNET, 0]
    return [
        _Isolation(interpreter, user, flag)
        for user, flag, interpreter in itertools.product(users, flags, interpreters)
    ]


def _unprivileged_user() -> tuple[int, int]:
    try:
        uid = pwd.getpwnam("nobody").pw_uid
    except KeyError:
        uid = _NOBODY
    for group in ("nogroup", "nobody"):
        with contextlib.suppress(KeyError):
            return uid, grp.getgrnam(group).gr_gid
    return uid, _NOBODY


def _starts(isolation: _Isolation) -> bool:
    """Returns whether a child started this way runs Python."""
    limits = SandboxLimits()
    rlimits = _resource_limits(limits, _process_limit(isolation, limits))
    try:
        probe = subprocess.run(
            [isolation.interpreter, *_PYTHON_FLAGS, "-c", "pass"],
            capture_output=True,
            cwd="/",
            env={"PATH": _SYSTEM_PATH, "LANG": "C.UTF-8"},
            timeout=30,
            preexec_fn=functools.partial(_prepare_child, isolation, rlimits),
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return probe.returncode == 0


def _log_isolation(isolation: _Isolation) -> None:
    weaker = []
    if isolation.user is None:
        who = "root: RLIMIT_NPROC does not bind it" if os.geteuid() == 0 else "this user"
        weaker.append(f"code runs as {who}, and can read and write that user's files")
    if not isolation.unshare_flags:
        weaker.append(
            "no network namespace: a socket guard that code can undo blocks the network, "
            "and processes that leave the process group outlive the run"
        )
    if weaker:
        logger.warning("sandbox isolation is weaker here: %s", "; ".join(weaker))
    # root's interpreter may lie where `nobody` cannot read it (/root is private).
    logger.info(
        "sandbox runs %s as uid/gid %s, namespaces %#x",
        isolation.interpreter,
        isolation.user or "of this process",
        isolation.unshare_flags,
    )
