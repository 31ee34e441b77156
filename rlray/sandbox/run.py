"""Runs untrusted Python source in a sandboxed child process: `run_python(source, limits)`
for a run whose output is read at its end, `SandboxSession(source, limits)` for one that
answers requests line by line while it runs.

What the child gets, where the machine allows it (probed once per process and logged):
- its own user-visible world: new mount, pid, network, IPC, UTS and cgroup namespaces
  (and a user namespace when rlray is not root), and a root of its own, a tmpfs it is
  pivoted into, the host's root detached. It sees, read-only, the system's programs and
  libraries (/usr, /bin, /sbin, /lib*), the interpreter's prefix wherever that lies (the
  directories on the way to it, /root/.pyenv say, can be passed through, not listed),
  /dev/{null,zero,full,random,urandom}, /etc/ld.so.cache and /etc/localtime, and a
  passwd and group naming root and its own user. Nothing else of the host: no /work,
  /root, /home or /tmp, no run directory (config.yaml, checkpoints, Parquet files), not
  the caller's cwd. One private tmpfs of `tmp_mb` is its cwd and $HOME and is mounted
  at /tmp, /var/tmp and /dev/shm: no shared writable directory (nor Ray's session
  directory) is reachable, and shared memory counts against a limit. /proc shows only
  its processes; its network has only lo, down;
- a seccomp filter that refuses new namespaces (unshare, setns, clone with CLONE_NEW*
  flags; clone3, whose flags a filter cannot read, looks absent so that libc falls back
  to clone), mounts, ptrace, memory that no address space holds (memfd_create,
  memfd_secret, SysV shared memory and message queues: RLIMIT_AS would not count it)
  and a few kernel interfaces it has no use for;
- pid 1 of its pid namespace is the code itself: when it exits or is killed, the kernel
  kills every process left in the namespace, and in namespaces nested in it, before
  `run_python` returns. A process of one run cannot name (so cannot signal) another's.
  As any init, the code ignores signals it sends itself without a handler, and reaps
  no orphans;
- a wall-clock limit, RLIMIT_CPU, RLIMIT_AS, RLIMIT_NPROC, RLIMIT_FSIZE; output cut at a
  byte limit; death with its caller (PR_SET_PDEATHSIG);
- when started as root, an unprivileged user (`nobody`), since RLIMIT_NPROC does not bind
  uid 0, and `nobody` cannot touch root's files. Root makes the namespaces without a user
  namespace: in one, the code would either be root there, with power over its mounts, or
  need a helper outside to map `nobody` into it.

Why our own code rather than bubblewrap: it would make the same namespaces and mounts
with the same kernel calls, but it is one more system package on every machine and Ray
node that scores code; as root it maps the code to uid 0 outside its user namespace, so
we would drop to `nobody` before it anyway; and the filter beyond namespaces (ptrace,
keyrings, io_uring) would still be ours. The setup runs in a sandbox server
(`launcher.py`, rlray/sandbox/server.py): a fresh single-threaded interpreter that the
caller starts once, never a fork of the caller, which may be a Ray actor with threads. It
forks each run, which isolates itself and runs the source in that warm interpreter:
cheaper than starting an interpreter a run, which would import its modules again
(BENCHMARKS.md#code-tests-against-humanevals-official-harness).

Where namespaces are refused (a container without CAP_SYS_ADMIN, a kernel without user
namespaces, mount_setattr or pivot_root), or its own root cannot be built (an
interpreter under /tmp, where the new root is made), the child runs without them, and
the log says so: then the code reads every file its user may read (run directories
among them), can write to /tmp, /var/tmp, /dev/shm and anything its user may write,
reaches the network but for a socket guard that determined code can undo, can signal
other runs as the same user, and processes that leave its process group outlive it
(and can reach later runs of the same user). Without libseccomp.so.2 (also logged) code
can make namespaces of its own, nested in the run's and killed with it, and hold memory
in memfds and SysV shared memory beyond its limit.

Not covered anywhere: memory held in pipe and socket buffers escapes RLIMIT_AS (the
kernel bounds pipes per user); runs as `nobody` share that user's RLIMIT_NPROC count,
so one run's processes can make another's fork fail.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import grp
import itertools
import json
import logging
import math
import os
import pwd
import resource
import selectors
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rlray.sandbox.server import Child, SandboxServer

logger = logging.getLogger(__name__)

_SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"
# Isolated mode (no PYTHON* variables, no user site), no site-packages, no .pyc writes.
_PYTHON_FLAGS = ("-I", "-S", "-B")
_MAX_FILE_BYTES = 64 * 2**20  # RLIMIT_FSIZE: one run cannot fill the disk with one file
_NOBODY = 65534  # uid and gid of nobody/nogroup where the names are missing
_PRIVATE_TMP = "/tmp"  # where the private tmpfs is mounted, as the child sees it
_STOP_GRACE_S = 10.0
_ENVIRONMENT = {
    "PATH": _SYSTEM_PATH,
    "LANG": "C.UTF-8",
}  # a run's HOME is its workdir  # the launcher's wait for its namespace to empty once told to stop

# The child's program, a file of its own run by path (see its docstring).
_LAUNCHER = Path(__file__).with_name("launcher.py")


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run."""

    timeout_s: float = 5.0
    """Wall-clock limit; every process of the run is killed at the limit."""
    cpu_s: int = 5
    """CPU seconds per process (RLIMIT_CPU)."""
    memory_mb: int = 512
    """Address space per process (RLIMIT_AS)."""
    max_processes: int = 16
    """Processes and threads the run may have at once, its first one included."""
    max_output_bytes: int = 65536
    """Bytes kept of stdout and of stderr each; the rest is read and dropped."""
    tmp_mb: int = 64
    """Size of the run's private tmpfs (its cwd, /tmp, /var/tmp and /dev/shm together),
    whose files take memory outside RLIMIT_AS. Unused where namespaces are refused."""


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
    namespaces: bool
    """Whether the child gets its own namespaces and file system; False: a socket guard."""
    seccomp: bool
    """Whether the child's system calls are filtered."""


def run_python(
    source: str, limits: SandboxLimits = SandboxLimits(), stdin: bytes = b""
) -> SandboxResult:
    """Returns the exit status and output of `source` run as __main__ under `limits`, with
    `stdin` as its standard input."""
    isolation = _isolation()
    started = time.monotonic()
    with _workdir(isolation) as workdir, _start(isolation, limits, workdir) as child:
        try:
            _send_source(child, source)
            deadline = started + limits.timeout_s
            stdout, stderr, timed_out = _collect_output(child, deadline, limits, stdin)
        finally:
            returncode = _stop(child)
    return SandboxResult(
        returncode=None if timed_out else returncode,
        stdout=stdout.decode("utf-8", errors="replace"),
        stderr=stderr.decode("utf-8", errors="replace"),
        timed_out=timed_out,
        seconds=time.monotonic() - started,
    )


class SandboxSession:
    """A sandboxed child that runs `source` and keeps running: the caller writes lines to
    its stdin and reads the lines it writes to its stdout, each within a deadline; its
    stderr is read and dropped. The session ends `limits.timeout_s` after its start, and
    once a read or a write failed (the child may still answer a request that timed out,
    so nothing later could be told apart)."""

    def __init__(self, source: str, limits: SandboxLimits = SandboxLimits()):
        self._isolation = _isolation()
        self._end = time.monotonic() + limits.timeout_s
        self._max_line = limits.max_output_bytes
        self._stack = contextlib.ExitStack()
        workdir = self._stack.enter_context(_workdir(self._isolation))
        self._process = self._stack.enter_context(_start(self._isolation, limits, workdir))
        # Killed and reaped by the server in its own time: nothing here needs its status.
        self._stack.callback(self._process.stop)
        self._received = bytearray()
        self.open = True
        _send_source(self._process, source)

    def __enter__(self) -> SandboxSession:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        """Kills every process of the session."""
        self.open = False
        self._stack.close()

    def send(self, line: bytes, deadline: float) -> bool:
        """Writes `line` and a newline; returns whether all of it was written in time."""
        pending = memoryview(line + b"\n")
        with selectors.DefaultSelector() as selector:
            selector.register(self._process.stdin, selectors.EVENT_WRITE)
            while self.open and pending:
                if not selector.select(self._remaining(deadline)):
                    self.open = False
                    break
                try:
                    pending = pending[os.write(self._process.stdin.fileno(), pending[:65536]) :]
                except BlockingIOError:
                    continue
                except OSError:
                    self.open = False
        return self.open

    def receive(self, deadline: float) -> bytes | None:
        """Returns the child's next line, without its newline; None where it ended its
        output, the deadline came first, or the line is over the output limit."""
        stdout, stderr = self._process.stdout.fileno(), self._process.stderr.fileno()
        with selectors.DefaultSelector() as selector:
            selector.register(stdout, selectors.EVENT_READ)
            selector.register(stderr, selectors.EVENT_READ)
            while self.open and b"\n" not in self._received:
                if len(self._received) > self._max_line:
                    self.open = False
                    break
                ready = selector.select(self._remaining(deadline))
                if not ready:
                    self.open = False
                for key, _ in ready:
                    chunk = os.read(key.fd, 65536)
                    if key.fd == stderr:
                        if not chunk:
                            selector.unregister(stderr)
                    elif chunk:
                        self._received += chunk
                    else:
                        self.open = False
        if not self.open:
            return None
        line, _, rest = bytes(self._received).partition(b"\n")
        self._received = bytearray(rest)
        if len(line) > self._max_line:
            self.open = False
            return None
        return line

    def _remaining(self, deadline: float) -> float:
        return max(0.0, min(deadline, self._end) - time.monotonic())


@contextlib.contextmanager
def _workdir(isolation: _Isolation):
    """Yields the child's cwd: its private tmpfs, else a temporary directory of its own."""
    if isolation.namespaces:
        yield _PRIVATE_TMP  # made by the launcher, and gone with the run's namespaces
        return
    with tempfile.TemporaryDirectory(prefix="rlray-sandbox-") as workdir:
        if isolation.user is not None:
            os.chown(workdir, *isolation.user)
        yield workdir


@contextlib.contextmanager
def _start(isolation: _Isolation, limits: SandboxLimits, workdir: str) -> Iterator[Child]:
    """Yields a run started by this process's sandbox server, its pipes closed after."""
    pipes = [os.pipe() for _ in range(3)]  # stdin, stdout, stderr: (read end, write end)
    theirs = (pipes[0][0], pipes[1][1], pipes[2][1])
    ours = (pipes[0][1], pipes[1][0], pipes[2][0])
    try:
        pid, pidfd = _server(isolation).start(_run_config(isolation, limits, workdir), theirs)
    except BaseException:
        for fd in ours:
            os.close(fd)
        raise
    finally:
        for fd in theirs:
            os.close(fd)
    child = Child(_server(isolation), pid, pidfd, ours)
    try:
        yield child
    finally:
        child.close()


_SERVERS: dict[_Isolation, SandboxServer] = {}
_SERVERS_LOCK = threading.Lock()


def _server(isolation: _Isolation) -> SandboxServer:
    """Returns this process's sandbox server, started on first use and again if it ended
    (or this process is a fork of the one that started it)."""
    with _SERVERS_LOCK:
        server = _SERVERS.get(isolation)
        if server is None or not server.alive or server.pid != os.getpid():
            server = SandboxServer(
                _launcher_command(isolation), _server_config(isolation), _ENVIRONMENT
            )
            _SERVERS[isolation] = server
        return server


def _framed(source: str) -> bytes:
    """Returns `source` as the launcher reads it: its length in bytes on a line, then it."""
    encoded = source.encode("utf-8", errors="replace")
    return b"%d\n%b" % (len(encoded), encoded)


def _launcher_command(isolation: _Isolation) -> list[str]:
    return [isolation.interpreter, *_PYTHON_FLAGS, str(_LAUNCHER)]


def _server_config(isolation: _Isolation) -> dict:
    """Returns the launcher's config: how every run it makes is isolated."""
    return {
        "caller": os.getpid(),
        "namespaces": isolation.namespaces,
        "seccomp": isolation.seccomp,
        "user": isolation.user,
        "socket_guard": not isolation.namespaces,
    }


def _run_config(isolation: _Isolation, limits: SandboxLimits, workdir: str) -> dict:
    """Returns a run's limits and place as the launcher takes them."""
    return {
        "rlimits": _resource_limits(limits, _process_limit(isolation, limits)),
        "tmp_mb": limits.tmp_mb,
        "workdir": workdir,
    }


def _send_source(process: Child, source: str) -> None:
    # A blocking write cannot hang on untrusted code: the launcher reads the whole source
    # before it runs any of it. Source on stdin is in no file the code could read back.
    with contextlib.suppress(BrokenPipeError):
        process.stdin.write(_framed(source))
    os.set_blocking(process.stdin.fileno(), False)  # what follows, the code may not read


def _collect_output(
    process: Child, deadline: float, limits: SandboxLimits, stdin: bytes
) -> tuple[bytes, bytes, bool]:
    """Returns stdout, stderr (each cut at the limit) and whether the deadline passed first,
    having written `stdin` as far as the child read it, then closed it.

    Reads until the child has exited and every process sharing its output has closed it."""
    outputs = {process.stdout.fileno(): bytearray(), process.stderr.fileno(): bytearray()}
    pending = memoryview(stdin)
    timed_out = False
    try:
        with selectors.DefaultSelector() as selector:
            watched = [*outputs, process.pidfd]  # the pidfd: readable once the child exited
            for fd in watched:
                selector.register(fd, selectors.EVENT_READ)
            selector.register(process.stdin, selectors.EVENT_WRITE)
            while any(fd in selector.get_map() for fd in watched):
                remaining = deadline - time.monotonic()
                timed_out = remaining <= 0
                if timed_out:
                    break
                for key, _ in selector.select(remaining):
                    if key.fileobj is process.stdin:
                        pending = _write_ready(process.stdin, selector, pending)
                    else:
                        _read_ready(key.fd, selector, outputs, limits.max_output_bytes)
    finally:
        with contextlib.suppress(BrokenPipeError):
            process.stdin.close()
    stdout, stderr = outputs.values()
    return bytes(stdout), bytes(stderr), timed_out


def _write_ready(pipe, selector: selectors.BaseSelector, pending: memoryview) -> memoryview:
    """Writes what the pipe takes of `pending`; returns the rest. The pipe is closed (EOF
    for the code) once all is written, or dropped where the code closed its end."""
    try:
        pending = pending[os.write(pipe.fileno(), pending[:65536]) :] if pending else pending
    except (BrokenPipeError, BlockingIOError) as error:
        if isinstance(error, BlockingIOError):
            return pending
        pending = pending[:0]
    if not pending:
        selector.unregister(pipe)
        with contextlib.suppress(BrokenPipeError):
            pipe.close()
    return pending


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


def _stop(child: Child) -> int | None:
    """Kills every process of the run that is left; returns its exit status.

    The server kills it: with namespaces its watcher kills pid 1 of the run's namespace,
    and exits once the kernel has killed everything in it; without, its process group,
    whose id the server does not let go of (reap) before. A run that does not end within
    the grace time is killed outright."""
    child.stop()
    code = child.wait(_STOP_GRACE_S)
    if code is None:
        child.kill()
        code = child.wait(_STOP_GRACE_S)
    return code


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
    runs as the same user, are added so that the run gets its own max_processes. The
    watcher, outside the run's namespaces, counts too where it has the child's user."""
    uid = isolation.user[0] if isolation.user is not None else os.getuid()
    watcher = 1 if isolation.namespaces and uid == os.getuid() else 0
    return _tasks_of_user(uid) + limits.max_processes + watcher


_TASK_COUNT_TTL_S = 0.25  # runs started this close together share one count
_task_counts: dict[int, tuple[float, int]] = {}


def _tasks_of_user(uid: int) -> int:
    """Returns the tasks (threads) whose real uid is `uid`: a count of at most
    _TASK_COUNT_TTL_S ago (reading every /proc/<pid>/status costs a run's start again)."""
    counted_at, count = _task_counts.get(uid, (-math.inf, 0))
    if time.monotonic() - counted_at > _TASK_COUNT_TTL_S:
        count = _count_tasks_of_user(uid)
        _task_counts[uid] = (time.monotonic(), count)
    return count


def _count_tasks_of_user(uid: int) -> int:
    wanted = b"\nUid:\t%d\t" % uid
    count = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status", "rb") as file:
                status = file.read()
        except OSError:
            continue  # exited while listed
        if wanted in status:
            start = status.index(b"\nThreads:") + 9
            count += int(status[start : status.index(b"\n", start)])
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
    seccomp, then this interpreter over the system's (root's may lie where `nobody`
    reaches it only through the sandbox's own root)."""
    interpreters = [sys.executable]
    system_python = shutil.which("python3", path=_SYSTEM_PATH)
    if system_python is not None and system_python != sys.executable:
        interpreters.append(system_python)
    users = [_unprivileged_user(), None] if os.geteuid() == 0 else [None]
    filters = [True, False] if _seccomp_available() else [False]
    return [
        _Isolation(interpreter, user, namespaces, seccomp)
        for user, namespaces, seccomp, interpreter in itertools.product(
            users, [True, False], filters, interpreters
        )
    ]


def _seccomp_available() -> bool:
    try:
        ctypes.CDLL("libseccomp.so.2")
    except OSError:
        return False
    return True


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
    workdir = _PRIVATE_TMP if isolation.namespaces else "/"
    config = {**_server_config(isolation), **_run_config(isolation, SandboxLimits(), workdir)}
    try:
        probe = subprocess.run(
            [*_launcher_command(isolation), json.dumps(config)],
            input=_framed("pass"),
            capture_output=True,
            cwd="/",
            env=_ENVIRONMENT,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError) as error:
        logger.debug("sandbox cannot start as %s: %s", isolation, error)
        return False
    if probe.returncode != 0:
        reason = probe.stderr.decode(errors="replace").strip().splitlines()[-1:]
        logger.debug("sandbox cannot start as %s: %s", isolation, reason)
    return probe.returncode == 0


def _log_isolation(isolation: _Isolation) -> None:
    weaker = []
    if isolation.user is None:
        who = "root: RLIMIT_NPROC does not bind it" if os.geteuid() == 0 else "this user"
        # With namespaces its own root shows no file of that user's, and nothing writable.
        files = "" if isolation.namespaces else ", and can read and write that user's files"
        weaker.append(f"code runs as {who}{files}")
    if not isolation.namespaces:
        weaker.append(
            "no namespaces nor a root of its own: code reads every file its user may read "
            "(run directories among them), shares /tmp, /var/tmp and /dev/shm, a socket "
            "guard that code can undo blocks the network, runs can signal each other, and "
            "processes that leave the process group outlive the run"
        )
    if not isolation.seccomp:
        weaker.append(
            "no seccomp filter: code can make namespaces of its own, and hold memory in "
            "memfds and SysV shared memory beyond its limit"
        )
    if weaker:
        logger.warning("sandbox isolation is weaker here: %s", "; ".join(weaker))
    # root's interpreter may lie where `nobody` cannot read it (/root is private).
    logger.info(
        "sandbox runs %s as uid/gid %s, namespaces %s, seccomp %s",
        isolation.interpreter,
        isolation.user or "of this process",
        isolation.namespaces,
        isolation.seccomp,
    )
