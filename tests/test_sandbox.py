"""The sandbox's limits, each shown on a real child process (code_tests: test_code_rewards.py)."""

from __future__ import annotations

import ast
import contextlib
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from rlray.rewards.code import code_tests
from rlray.sandbox import run as sandbox
from rlray.sandbox.run import SandboxLimits, run_python

AS_ROOT = os.geteuid() == 0


def test_exit_status_and_output_are_captured():
    result = run_python("import sys\nprint('out')\nprint('err', file=sys.stderr)\nsys.exit(3)")
    assert (result.returncode, result.stdout, result.stderr) == (3, "out\n", "err\n")
    assert not result.timed_out


def test_output_is_cut_at_the_limit_without_stopping_the_code():
    result = run_python("print('x' * 10**7)\nprint('done')", SandboxLimits(max_output_bytes=100))
    assert result.returncode == 0
    assert result.stdout == "x" * 100


def test_each_run_starts_in_an_empty_directory_that_is_gone_afterwards():
    name = f"left-{secrets.token_hex(8)}.txt"
    look_and_write = f"import os\nprint(os.getcwd(), os.listdir())\nopen({name!r}, 'w').write('x')"
    runs = [run_python(look_and_write) for _ in range(2)]
    assert [run.returncode for run in runs] == [0, 0], runs[0].stderr
    (first_dir, first_files), (_, second_files) = (r.stdout.split() for r in runs)
    assert first_files == second_files == "[]"
    assert not os.path.exists(os.path.join(first_dir, name))


def test_environment_holds_no_variables_of_the_caller(monkeypatch):
    monkeypatch.setenv("RLRAY_TEST_SECRET", "hunter2")
    result = run_python("import os\nprint(sorted(os.environ))")
    assert result.stdout.strip() == "['HOME', 'LANG', 'PATH']"


@pytest.mark.skipif(not AS_ROOT, reason="the user switch happens only when started as root")
def test_code_started_as_root_runs_as_an_unprivileged_user():
    result = run_python("import os\nprint(os.getuid(), os.getgid(), os.getgroups())")
    uid, gid, groups = result.stdout.split(" ", 2)
    assert uid != "0" and gid != "0" and groups.strip() == "[]"


def test_infinite_loop_is_killed_at_the_timeout():
    result = run_python("while True: pass", SandboxLimits(timeout_s=1))
    assert result.timed_out and result.returncode is None
    assert result.seconds >= 1  # ran until the limit, not stopped by something else


def test_memory_bomb_fails_without_harm():
    limits = SandboxLimits(memory_mb=256)
    huge = run_python("x = bytearray(10**10)", limits)
    growing = run_python("x = []\nwhile True: x.append(bytearray(10**6))", limits)
    for result in (huge, growing):
        assert result.returncode not in (0, None)
        assert "MemoryError" in result.stderr
    assert run_python("print(len(bytearray(10**8)))", limits).stdout == "100000000\n"


COUNT_FORKS = """\
import os, time
forks = 0
try:
    while forks < 100:
        if os.fork() == 0:
            os.close(1), os.close(2), time.sleep(30)  # alive, without holding the output
        forks += 1
except OSError:
    pass
print(forks)
"""


def test_process_limit_stops_forks():
    result = run_python(COUNT_FORKS, SandboxLimits(max_processes=8))
    assert 1 <= int(result.stdout) < 8
    assert not result.timed_out


FORK_BOMBS = {
    "dies_at_the_limit": "import os\nwhile True: os.fork()",
    "spins_at_the_limit": "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass",
}


@pytest.mark.parametrize("bomb", FORK_BOMBS.values(), ids=FORK_BOMBS.keys())
def test_fork_bomb_is_contained_and_leaves_no_process(bomb):
    sandbox_uid = sandbox._unprivileged_user()[0] if AS_ROOT else os.getuid()
    before = _live_pids(lambda p: p.uids().real == sandbox_uid)
    source = f"{PRINT_RUN}\n{bomb}"
    result = run_python(source, SandboxLimits(timeout_s=2, max_processes=8))
    assert _none_left(_member_of(result.stdout))
    if AS_ROOT:  # every process as the sandbox's user is the run's
        assert _eventually(lambda: _live_pids(lambda p: p.uids().real == sandbox_uid) <= before)


def test_process_that_leaves_the_process_group_is_killed_too(isolated):
    escape = f"{PRINT_RUN}\nimport os, time\nif os.fork() == 0:\n    os.setsid()\n"
    result = run_python(f"{escape}    time.sleep(1000)", SandboxLimits(timeout_s=1))
    assert _none_left(_member_of(result.stdout))


# Prints what names the run's processes: its pid namespace, or without namespaces its
# session (the run's first process leads it).
PRINT_RUN = "import os\nprint(os.readlink('/proc/self/ns/pid'), os.getsid(0), flush=True)"


def _member_of(printed: str):
    """Returns whether a process belongs to the run whose first line `printed` is."""
    pid_namespace, session = printed.split()[:2]
    if sandbox._isolation().namespaces:
        return lambda p: os.readlink(f"/proc/{p.pid}/ns/pid") == pid_namespace
    return lambda p: os.getsid(p.pid) == int(session)


def _none_left(belongs) -> bool:
    """Returns whether no live process `belongs`: at once with namespaces (the kernel has
    killed them before run_python returns), else within a moment."""
    if sandbox._isolation().namespaces:
        return not _live_pids(belongs)
    return _eventually(lambda: not _live_pids(belongs))


def _eventually(condition, within_s: float = 30.0) -> bool:
    """Returns whether `condition()` holds within `within_s`: a killed process may take a
    moment to die."""
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _live_pids(belongs) -> set[int]:
    """Returns the pids of processes, zombies excepted, for which `belongs(process)` holds.

    Zombies are dead: orphans wait for pid 1 to reap them, which not every init does."""
    pids = set()
    for process in psutil.process_iter():
        try:
            if process.status() != psutil.STATUS_ZOMBIE and belongs(process):
                pids.add(process.pid)
        except (psutil.Error, OSError):
            continue  # gone while looked at
    return pids


CONNECT = """\
import socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2)
    print("connected")
except OSError as error:
    print("refused:", error)
"""


def test_network_connection_is_refused():
    with socket.create_server(("127.0.0.1", 0)) as server:
        code = CONNECT.format(port=server.getsockname()[1])
        outside = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        inside = run_python(code)
    assert outside.stdout == "connected\n"
    assert inside.stdout.startswith("refused:"), inside.stdout


def test_socket_guard_refuses_connections_where_namespaces_are_refused(monkeypatch):
    # The interpreter is the first that starts without namespaces: root's may lie where
    # `nobody` can reach it only through the sandbox's own root.
    candidates = sandbox._candidates()  # best first
    without_namespace = next(c for c in candidates if not c.namespaces and sandbox._starts(c))
    monkeypatch.setattr(sandbox, "_isolation", lambda: without_namespace)
    with socket.create_server(("127.0.0.1", 0)) as server:
        inside = run_python(CONNECT.format(port=server.getsockname()[1]))
    assert inside.stdout == "refused: network access is disabled in this sandbox\n"


# Hostile code. Each test below failed before the run got namespaces, a private tmpfs
# and a seccomp filter: the code, as `nobody` in the host's pid and mount namespaces,
# wrote into shared directories, made namespaces, outlived the run and killed other runs.


@pytest.fixture
def isolated():
    """Skips where namespaces are refused: there, these attacks work (and are logged)."""
    if not sandbox._isolation().namespaces:
        pytest.skip("no namespaces on this machine: the sandbox logs what does not hold")


def test_root_gets_every_layer_of_isolation():
    if not AS_ROOT:
        pytest.skip("as another user, namespaces depend on the machine's settings")
    isolation = sandbox._isolation()
    assert isolation.user is not None and isolation.namespaces and isolation.seccomp


WRITE_AND_LIST = """\
import os
path = os.path.join({directory!r}, {name!r})
try:
    with open(path, "w") as file:
        file.write("left by a run")
    print("wrote", sorted(os.listdir({directory!r})))
except OSError as error:
    print("refused:", error)
"""


@pytest.mark.parametrize("directory", ["/tmp", "/var/tmp", "/dev/shm"])
def test_shared_temporary_directories_are_private_to_the_run(isolated, directory):
    name = f"rlray-sandbox-probe-{secrets.token_hex(8)}"
    with _removed_afterwards(os.path.join(directory, name)) as outside:
        first, second = (
            run_python(WRITE_AND_LIST.format(directory=directory, name=name)) for _ in range(2)
        )
        assert not os.path.exists(outside)
    assert first.stdout == second.stdout == f"wrote {[name]}\n", first.stderr


@pytest.fixture
def session_directories():
    """Yields world-writable directories like Ray's session directory (/tmp/ray is
    drwxrwxrwx): the real one where present, a stand-in in /tmp, and one outside every
    temporary directory (so its own file system's)."""
    outside = "/run" if AS_ROOT else os.path.expanduser("~")
    stand_ins = [tempfile.mkdtemp(prefix="rlray-ray-"), tempfile.mkdtemp(dir=outside)]
    for directory in stand_ins:
        os.chmod(directory, 0o777)
    try:
        yield [*stand_ins, *(["/tmp/ray"] if os.path.isdir("/tmp/ray") else [])]
    finally:
        for directory in stand_ins:
            shutil.rmtree(directory)


def test_world_writable_directories_such_as_rays_session_are_not_writable(
    isolated, session_directories
):
    name = f"rlray-sandbox-probe-{secrets.token_hex(8)}"
    for directory in session_directories:
        with _removed_afterwards(os.path.join(directory, name)) as outside:
            result = run_python(WRITE_AND_LIST.format(directory=directory, name=name))
            assert not os.path.exists(outside), directory
        assert result.stdout.startswith("refused:"), result.stdout + result.stderr


FILL_SHARED_MEMORY = """\
written = 0
try:
    for index in range(96):
        with open(f"/dev/shm/{prefix}-{{index}}", "wb") as file:
            file.write(bytes(2**20))
        written += 1
except OSError:
    pass
print(written)
"""


def test_shared_memory_is_held_to_the_runs_tmpfs_size(isolated):
    prefix = f"rlray-sandbox-probe-{secrets.token_hex(8)}"
    try:
        result = run_python(FILL_SHARED_MEMORY.format(prefix=prefix))
        assert not list(Path("/dev/shm").glob(f"{prefix}-*"))
    finally:
        for path in Path("/dev/shm").glob(f"{prefix}-*"):
            path.unlink()
    assert 0 < int(result.stdout) <= SandboxLimits().tmp_mb  # MiB files, of 96 MiB


# What the code's file system may show at its top: the interpreter's and the system's
# libraries, and the run's own /dev, /proc and temporary directories.
SYSTEM_ROOTS = {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "sbin"}
SYSTEM_ROOTS |= {"tmp", "usr", "var"}
LOOK_AROUND = """\
import os
seen = {{}}
for path in {paths!r}:
    try:
        seen[path] = os.listdir(path)
    except PermissionError:
        seen[path] = "unlistable"
    except FileNotFoundError:
        pass
print(sorted(os.listdir("/")))
print(seen)
"""


def test_code_sees_only_the_interpreter_and_system_libraries(isolated):
    interpreter = Path(os.path.realpath(sandbox._isolation().interpreter))
    private = ["/work", "/root", "/home", "/mnt", "/opt", "/run", os.getcwd()]
    result = run_python(LOOK_AROUND.format(paths=private))
    top, seen = result.stdout.splitlines()
    assert set(ast.literal_eval(top)) <= SYSTEM_ROOTS | {interpreter.parts[1]}, result.stderr
    # Directories on the way to the interpreter (/root/.pyenv/...) can be passed through,
    # never listed; the others are not there.
    on_the_way = {path: "unlistable" for path in private if Path(path) in interpreter.parents}
    assert ast.literal_eval(seen) == on_the_way


READ_FILE = """\
try:
    print(open({path!r}).read())
except OSError as error:
    print("refused:", type(error).__name__)
"""


@pytest.mark.parametrize("where", ["callers_cwd", "host_tmp"])
def test_run_directories_and_host_files_cannot_be_read(isolated, where):
    # A run directory as jobs write it, world-readable, so that only the sandbox's file
    # system (not the file's mode) keeps the code out.
    parent = os.getcwd() if where == "callers_cwd" else "/tmp"
    run_dir = tempfile.mkdtemp(prefix="rlray-sandbox-probe-", dir=parent)
    try:
        os.chmod(run_dir, 0o755)
        config = Path(run_dir, "config.yaml")
        config.write_text(f"token: {secrets.token_hex(8)}\n")
        config.chmod(0o644)
        result = run_python(READ_FILE.format(path=str(config)))
    finally:
        shutil.rmtree(run_dir)
    assert result.stdout == "refused: FileNotFoundError\n", result.stdout + result.stderr


NATIVE_MODULES = """\
import bz2, ctypes, decimal, hashlib, locale, lzma, multiprocessing, sqlite3, ssl, zlib
import subprocess, sys
callback = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)(lambda x: x + 1)
shell = subprocess.run(["sh", "-c", "echo sh"], capture_output=True, text=True).stdout
print(callback(1), sqlite3.connect(":memory:").execute("select 3").fetchone()[0], shell.strip())
"""


def test_standard_library_modules_with_native_code_still_work():
    result = run_python(NATIVE_MODULES)
    assert result.stdout == "2 3 sh\n", result.stderr


@pytest.fixture
def filtered():
    """Skips where the child's system calls are not filtered (no libseccomp.so.2)."""
    if not sandbox._isolation().seccomp:
        pytest.skip("no seccomp filter on this machine: the sandbox logs what does not hold")


# Holds 1.5 GiB in memory that is in no process's address space once written.
HOLD_MEMORY = {
    "memfd": """\
import os
held = []
for _ in range(48):  # files of 32 MiB: each under RLIMIT_FSIZE
    held.append(os.memfd_create("hold"))
    os.write(held[-1], bytes(32 * 2**20))
print("held", sum(os.fstat(fd).st_size for fd in held) >> 20)
""",
    "sysv_shared_memory": """\
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
held = 0
for _ in range(4):
    segment = libc.shmget(0, 384 * 2**20, 0o600 | 0o1000)  # IPC_PRIVATE, IPC_CREAT
    address = libc.shmat(segment, None, 0)
    if segment < 0 or address in (None, 2**64 - 1):
        break
    ctypes.memset(address, 1, 384 * 2**20)
    libc.shmdt(ctypes.c_void_p(address))
    held += 384
print("held", held)
""",
}


@pytest.mark.parametrize("source", HOLD_MEMORY.values(), ids=HOLD_MEMORY.keys())
def test_memory_outside_the_address_space_is_refused(isolated, filtered, source):
    result = run_python(source, SandboxLimits(memory_mb=512, timeout_s=20))
    assert "held 1536" not in result.stdout, result.stdout + result.stderr


def test_a_sandbox_that_cannot_hide_the_file_system_says_so(monkeypatch, caplog):
    monkeypatch.setattr(sandbox, "_starts", lambda isolation: not isolation.namespaces)
    with caplog.at_level(logging.WARNING, logger="rlray.sandbox.run"):
        isolation = sandbox._probe_isolation.__wrapped__()
    assert not isolation.namespaces
    assert "code reads every file its user may read" in caplog.text


MAKE_NAMESPACES = """\
import ctypes, os, signal
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
NEWUSER, NEWNET = 0x10000000, 0x40000000
clone_args = (ctypes.c_uint64 * 8)(NEWUSER | NEWNET, 0, 0, 0, signal.SIGCHLD, 0, 0, 0)
parent = os.getpid()
result = {call}
if os.getpid() != parent:  # the child of clone or clone3
    os._exit(0)
print("made" if result >= 0 else os.strerror(ctypes.get_errno()))
"""
NAMESPACE_CALLS = {
    "unshare_user": "libc.unshare(NEWUSER)",
    "unshare_user_and_network": "libc.unshare(NEWUSER | NEWNET)",
    "clone_user": "libc.syscall(56, NEWUSER | signal.SIGCHLD, 0, 0, 0, 0)",
    "clone3_user_and_network": "libc.syscall(435, clone_args, ctypes.sizeof(clone_args))",
}


@pytest.mark.parametrize("name", NAMESPACE_CALLS)
def test_code_cannot_make_namespaces_of_its_own(isolated, name):
    result = run_python(MAKE_NAMESPACES.format(call=NAMESPACE_CALLS[name]))
    # clone3 looks absent, so that libc falls back to clone, whose flags the filter reads.
    refusal = "Function not implemented" if name.startswith("clone3") else "Operation not permitted"
    assert result.stdout == f"{refusal}\n", result.stderr


THREADS_AND_CHILDREN = """\
import subprocess, sys, threading
results = []
threads = [threading.Thread(target=results.append, args=(i,)) for i in range(4)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
child = subprocess.run([sys.executable, "-c", "print('child')"], capture_output=True)
print(sorted(results), child.stdout.decode().strip())
"""


def test_threads_and_child_processes_still_work_under_the_filter():
    result = run_python(THREADS_AND_CHILDREN)
    assert result.stdout == "[0, 1, 2, 3] child\n", result.stderr


# Becomes a process that sleeps for a minute with "rlray-sandbox-probe-<token>" on its
# command line (split here, so that a command line holding this source does not match).
EXEC_SLEEPER = (
    "os.execv(sys.executable, "
    "[sys.executable, '-c', 'import time; time.sleep(60)', 'rlray-sandbox-probe-' + {token!r}])"
)
# Makes new user, pid and network namespaces if it can, then leaves a process in them,
# in a session of its own, and a grandchild; waits until both run the sleeper (their
# exec closes the pipe), then exits or hangs.
LEAVE_PROCESSES = f"""\
import ctypes, os, sys, time
ctypes.CDLL(None).unshare(0x10000000 | 0x20000000 | 0x40000000)
exec_done, exec_pending = os.pipe()
if os.fork() == 0:
    os.setsid()
    os.fork()
    {EXEC_SLEEPER}
os.close(exec_pending)
os.read(exec_done, 1)
time.sleep({{linger}})
"""


@pytest.mark.parametrize("linger", [0, 60], ids=["code_exits", "code_times_out"])
def test_processes_left_in_namespaces_of_their_own_die_with_the_run(isolated, linger):
    token = secrets.token_hex(8)
    with _killed_afterwards(token) as left:
        result = run_python(
            LEAVE_PROCESSES.format(token=token, linger=linger), SandboxLimits(timeout_s=2)
        )
        assert not left()
    assert result.timed_out == bool(linger), result.stderr


def test_run_dies_with_its_caller(isolated):
    token = secrets.token_hex(8)
    sleeper = "import os, sys\n" + EXEC_SLEEPER.format(token=token)
    caller_code = (
        f"from rlray.sandbox.run import run_python, SandboxLimits\n"
        f"run_python({sleeper!r}, SandboxLimits(timeout_s=60))"
    )
    with _killed_afterwards(token) as left:
        caller = subprocess.Popen([sys.executable, "-c", caller_code])
        try:
            assert _eventually(left)
        finally:
            caller.kill()
            caller.wait()
        assert _eventually(lambda: not left())


KILL_EVERY_PROCESS = """\
import os, signal, time
end = time.monotonic() + {seconds}
while time.monotonic() < end:
    pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    for pid in [-1, *pids]:
        if pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
"""
SLOW_SQUARE = "```python\nimport time\ntime.sleep(1)\ndef square(x):\n    return x * x\n```"


def test_one_run_cannot_kill_another(isolated):
    # kill(-1) as the runs' shared user once reached every run: only namespaces keep this
    # test from killing every process of this user.
    attack = KILL_EVERY_PROCESS.format(seconds=4)
    with ThreadPoolExecutor(max_workers=1) as pool:
        attacker = pool.submit(run_python, attack, SandboxLimits(timeout_s=10))
        time.sleep(0.5)  # the attacker is running
        score = code_tests(["p"], [SLOW_SQUARE], tests=[["assert square(3) == 9"]], timeout_s=10)
        assert not attacker.done()
    assert score == [1.0]
    assert attacker.result().returncode == 0


@contextlib.contextmanager
def _removed_afterwards(path: str):
    """Yields `path`, and removes what a run might have left there."""
    try:
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@contextlib.contextmanager
def _killed_afterwards(token: str):
    """Yields a function that returns the live pids of EXEC_SLEEPER's sleepers for `token`,
    and kills them at the end (what a failed test left)."""
    marker = f"rlray-sandbox-probe-{token}"

    def left() -> set[int]:
        return _live_pids(lambda p: marker in p.cmdline())

    try:
        yield left
    finally:
        for pid in left():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_the_launcher_is_a_file_that_imports_only_the_standard_library():
    # It runs as `python -I -S -B launcher.py`: without site-packages, so neither rlray
    # nor any installed package may be imported there.
    nodes = list(ast.walk(ast.parse(sandbox._LAUNCHER.read_text())))
    imported = {a.name for n in nodes if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in nodes if isinstance(n, ast.ImportFrom) and n.module}
    imported = {name.split(".")[0] for name in imported}
    assert imported and imported <= set(sys.stdlib_module_names)
