"""The sandbox's own program: a server that forks one isolated child per run, each of
which runs the code's source in the interpreter it was forked from.

Run by `rlray.sandbox.run` as `python -I -S -B launcher.py '<json config>'`, a fresh
single-threaded interpreter (never a fork of the caller, which may be a Ray actor with
threads). It imports only the standard library: `-S` leaves site-packages out. With
`socket` in its config it serves runs: each request on that socket (a run's limits, and
its stdin, stdout and stderr as file descriptors) gets a forked child, answered with the
child's pid and a pidfd of it; the exit status of each child follows once it is reaped,
and `stop` requests kill a run. Without `socket` it makes one run itself (the isolation
probe). Forking a warm interpreter spares each run the start of one and its imports.
The server never holds a run's source or output (a child reads its source from its own
stdin), so a child finds nothing in memory of any other run.

A run's child, as root, stays root until the namespaces and mounts are made. With
namespaces it forks again: the child (the watcher) stays outside the new pid namespace
and exits as the code does; its child is pid 1 there, moves into a root of its own (see
`private_file_system`) and runs the code. The source comes framed on stdin (its length in
bytes on a line, then it), so that what follows on stdin is the program's own input.

The config's keys: caller (pid that must stay the server's parent), namespaces, seccomp,
socket_guard (bools), user ([uid, gid] or null), socket (a file descriptor, or absent);
a run's: rlimits ([resource, value] pairs), tmp_mb, workdir (also the code's home in
/etc/passwd), id.
"""

import atexit
import builtins
import contextlib
import ctypes
import gc
import json
import os
import pwd
import resource
import select
import signal
import socket
import sys
import traceback

LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
LIBC.pivot_root.argtypes = [ctypes.c_char_p] * 2
LIBC.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
LIBC.syscall.restype = ctypes.c_long
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP = 1, 38, 22
SECCOMP_MODE_FILTER = 2
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 0x40000
MNT_DETACH = 0x2
SYS_MOUNT_SETATTR, AT_FDCWD, AT_RECURSIVE = 442, -100, 0x8000  # 442 on every arch
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 0x1, 0x2
CLONE_NEWUSER = 0x10000000
# mount, cgroup, UTS, IPC, pid, network
CLONE_NEW_OTHERS = (0x20000, 0x2000000, 0x4000000, 0x8000000, 0x20000000, 0x40000000)
TMPFS_INODES = 16384  # files and directories; empty ones cost kernel memory but no size

# The new root is built on a tmpfs mounted here, in the old root, then made "/".
NEW_ROOT = "/tmp"
# What the code sees of the host, read-only: the system's programs and libraries (where
# one is a link, as /bin -> usr/bin on merged-/usr systems, the link), and the
# interpreter's prefix wherever that lies.
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
DEVICES = ("null", "zero", "full", "random", "urandom")
DEVICE_LINKS = {"fd": "/proc/self/fd", "stdin": "fd/0", "stdout": "fd/1", "stderr": "fd/2"}
# The loader's index of libraries, and the time zone; passwd and group are written.
HOST_FILES = ("/etc/ld.so.cache", "/etc/localtime")

# Imported once by the server, for every run: what programs and tests import most (as
# LiveCodeBench's harness imports them for every solution).
PRELOADED = (
    *("bisect", "collections", "copy", "datetime", "functools", "heapq", "itertools"),
    *("math", "operator", "random", "re", "statistics", "string", "typing"),
)

# Refused with EPERM (the code's own mount namespace is fixed).
REFUSED = (
    *("unshare", "setns", "pivot_root", "chroot"),  # new namespaces and roots
    *("mount", "umount2", "open_tree", "move_mount", "mount_setattr"),  # mounts
    *("fsopen", "fsconfig", "fsmount", "fspick"),
    *("ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd"),  # others' memory
    *("keyctl", "add_key", "request_key"),  # kernel keyrings: one per uid, shared by runs
    # memory that no address space holds, so beyond RLIMIT_AS (tmpfs files count in tmp_mb)
    *("memfd_create", "memfd_secret", "shmget", "msgget"),
    # interfaces that only widen the kernel's attack surface
    *("bpf", "perf_event_open", "userfaultfd"),
    *("io_uring_setup", "io_uring_enter", "io_uring_register"),
)
SCMP_ACT_ALLOW, SCMP_ACT_ERRNO, SCMP_CMP_MASKED_EQ = 0x7FFF0000, 0x50000, 7
EPERM, ENOSYS = 1, 38


class MountAttr(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("set", "clr", "prop", "userns")]


class ArgCmp(ctypes.Structure):  # libseccomp's struct scmp_arg_cmp
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("mask", ctypes.c_uint64),
        ("value", ctypes.c_uint64),
    ]


def check(result):
    if result < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
    return result


def main(config):
    if config.get("socket") is None:
        start(config, config)
    else:
        serve(config)


def serve(config):
    """Forks a child for each run requested on the config's socket, until it closes."""
    tie_to_parent(lambda: os.getppid() == config["caller"])
    server = socket.socket(fileno=config["socket"])
    if config["seccomp"]:
        system_call_filter(seccomp_library())  # made once for every run
    for name in PRELOADED:
        with contextlib.suppress(ImportError):
            __import__(name)
    gc.freeze()  # the collector leaves what every run shares alone: fewer pages copied
    reaped, wake = os.pipe()  # SIGCHLD wakes the loop through it
    for fd in (reaped, wake):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    runs = {}  # pid -> id of each run not yet reaped
    while True:
        ready = select.select([server, reaped], [], [])[0]
        if reaped in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(reaped, 4096)
            reap(server, runs, config["namespaces"])
        if server in ready:
            try:
                message, fds, _, _ = socket.recv_fds(server, 65536, 3)
            except OSError:
                message = b""
            if not message:
                os._exit(0)  # the caller is gone; PR_SET_PDEATHSIG ends the runs
            request = json.loads(message)
            if "stop" in request:
                stop(request["stop"], runs, config["namespaces"])
            else:
                fork_run(server, config, request, fds, [server.fileno(), reaped, wake], runs)


def fork_run(server, config, request, fds, closing, runs):
    pid = os.fork()
    if pid == 0:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in closing:  # the server's: no run may ask for runs, or read their news
            os.close(fd)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.setsid()  # a process group of its own, killed as one
        start({**config, "caller": os.getppid()}, request)
    for fd in fds:
        os.close(fd)
    runs[pid] = request["id"]
    pidfd = os.pidfd_open(pid)
    reply = json.dumps({"id": request["id"], "pid": pid}).encode()
    socket.send_fds(server, [reply], [pidfd])
    os.close(pidfd)


def reap(server, runs, namespaces):
    """Reports every run that has exited, having killed what is left of its process
    group first where there are no namespaces (its id cannot be reused before the
    reaping)."""
    while runs:
        found = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if found is None:
            return
        if not namespaces:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(found.si_pid, signal.SIGKILL)
        code = os.waitstatus_to_exitcode(os.waitpid(found.si_pid, 0)[1])
        if runs.pop(found.si_pid, None) is not None:
            socket.send_fds(
                server, [json.dumps({"exited": found.si_pid, "code": code}).encode()], []
            )


def stop(pid, runs, namespaces):
    """Kills a run not yet reaped: with namespaces its watcher, told to stop, kills pid 1
    of the run's namespace, and exits once the kernel has killed everything in it."""
    if pid in runs:
        with contextlib.suppress(ProcessLookupError):
            if namespaces:
                os.kill(pid, signal.SIGTERM)
            else:
                os.killpg(pid, signal.SIGKILL)


def start(config, run):
    """Isolates this process as the config says, with the run's limits, runs the source
    on stdin, and exits."""
    try:
        isolate(config, run)
        code = run_source(config["socket_guard"])
    except BaseException:
        traceback.print_exc()
        code = 1
    finish(code)


_SECCOMP = []


def seccomp_library():
    """Returns libseccomp, loaded on first use: while the host's libraries are in reach."""
    if not _SECCOMP:
        _SECCOMP.append(ctypes.CDLL("libseccomp.so.2"))
    return _SECCOMP[0]


def isolate(config, run):
    tie_to_parent(lambda: os.getppid() == config["caller"])
    for which, value in run["rlimits"]:
        resource.setrlimit(which, (value, value))
    # Made while the host's libraries are in reach (once, where runs are served).
    seccomp = system_call_filter(seccomp_library()) if config["seccomp"] else None
    os.environ["HOME"] = run["workdir"]
    if config["namespaces"]:
        watcher_gone = enter_namespaces()
        user = config["user"] or (os.getuid(), os.getgid())
        # The interpreter by its real path: a venv's link to it is not in the new root.
        sys.executable = os.path.realpath(sys.executable)
        private_file_system(run["tmp_mb"], user, run["workdir"])
    os.chdir(run["workdir"])
    if config["user"] is not None:
        drop_privileges(*config["user"])
    # A credential change clears the parent-death signal: set it again, and check that
    # the parent did not die before.
    if config["namespaces"]:
        tie_to_parent(lambda: still_open(watcher_gone))
        os.close(watcher_gone)
    else:
        tie_to_parent(lambda: os.getppid() == config["caller"])
    check(LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))  # no setuid program gives them back
    if seccomp:
        refuse_system_calls(seccomp)


def run_source(socket_guard):
    """Runs the source framed on stdin as __main__; returns its exit status."""
    header = b""
    while not header.endswith(b"\n") and len(header) < 32:
        header += os.read(0, 1) or b"\n"
    left, parts = int(header or 0), []
    while left > 0 and (part := os.read(0, min(left, 1 << 20))):
        parts.append(part)
        left -= len(part)
    if socket_guard:
        refuse_network()
    main_module = type(sys)("__main__")
    main_module.__builtins__ = builtins
    sys.modules["__main__"], sys.argv = main_module, [""]
    try:
        exec(compile(b"".join(parts), "<stdin>", "exec"), main_module.__dict__)
    except SystemExit as ended:
        if ended.code is None or isinstance(ended.code, int):
            return ended.code or 0
        print(ended.code, file=sys.stderr)
        return 1
    return 0


def finish(code):
    """Exits as the interpreter would at the end of a program: its threads joined, its
    exit functions run, its output flushed."""
    with contextlib.suppress(BaseException):
        if "threading" in sys.modules:
            sys.modules["threading"]._shutdown()
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    os._exit(code & 0xFF)


def refuse_network():
    """Without a network namespace: refuses connections and datagrams from Python code
    (code that is determined to can undo this)."""

    def refuse(*args, **kwargs):
        raise PermissionError("network access is disabled in this sandbox")

    for name in ("connect", "connect_ex", "sendto", "sendmsg"):
        setattr(socket.socket, name, refuse)
    socket.create_connection = refuse


def tie_to_parent(parent_alive):
    check(LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL))
    if not parent_alive():
        os._exit(1)


def still_open(pipe_end):
    try:
        return os.read(pipe_end, 1) != b""  # b"": every writer has closed it
    except BlockingIOError:
        return True


def enter_namespaces():
    """Returns, in pid 1 of the new namespaces, a non-blocking pipe end that reads EOF
    once the watcher is gone; in the watcher, never returns."""
    uid, gid = os.geteuid(), os.getegid()
    flags = sum(CLONE_NEW_OTHERS) | (CLONE_NEWUSER if uid != 0 else 0)
    check(LIBC.unshare(flags))
    if uid != 0:  # the user namespace's only ids are ours, and it has no root
        for name, text in (
            ("setgroups", "deny"),
            ("uid_map", f"{uid} {uid} 1"),
            ("gid_map", f"{gid} {gid} 1"),
        ):
            with open(f"/proc/self/{name}", "w") as file:
                file.write(text)
    watcher_gone, watcher_alive = os.pipe()
    first = os.fork()
    if first == 0:
        os.close(watcher_alive)
        os.set_blocking(watcher_gone, False)
        return watcher_gone
    os.close(watcher_gone)
    watch(first)


def watch(first):
    """Exits as `first` does, after the kernel has killed every other process in its pid
    namespace. SIGTERM (the caller's stop) kills `first`."""
    first_fd = os.pidfd_open(first)  # names `first` even once reaped, unlike its pid

    def stop(*_):
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(first_fd, signal.SIGKILL)

    signal.signal(signal.SIGTERM, stop)
    code = os.waitstatus_to_exitcode(os.waitpid(first, 0)[1])
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code if code >= 0 else 128 - code)


def mount(source, target, fstype, flags, data=None):
    check(LIBC.mount(_encode(source), _encode(target), _encode(fstype), flags, _encode(data)))


def _encode(text):
    return None if text is None else text.encode()


def private_file_system(tmp_mb, user, home):
    """Moves this process into a new root that shows the host's system libraries and this
    interpreter only, read-only, with a fresh /proc and one private tmpfs at /tmp,
    /var/tmp and /dev/shm."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below reaches the host
    build_root(visible_directories(sys.executable), user, home)
    enter_root()
    set_attributes("/", MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID)  # every mount, recursively
    private_tmp(tmp_mb)


def visible_directories(program):
    """Returns the host directories the code sees, none inside another: the system's and
    the interpreter's (this process runs the same one as the code)."""
    wanted = [*SYSTEM_PATHS, sys.base_prefix, sys.base_exec_prefix, os.path.dirname(program)]
    chosen = []
    found = {os.path.realpath(p) for p in wanted if os.path.isdir(p)} - {"/"}  # "/": all
    for path in sorted(found, key=len):
        if not any(path == other or path.startswith(other + "/") for other in chosen):
            chosen.append(path)
    return chosen


def build_root(directories, user, home):
    mount("tmpfs", NEW_ROOT, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=1024,mode=0755")
    for path in directories:
        make_passage(NEW_ROOT + path)
        mount(path, NEW_ROOT + path, None, MS_BIND | MS_REC)
    for path in SYSTEM_PATHS:
        if os.path.islink(path):
            os.symlink(os.readlink(path), NEW_ROOT + path)
    for path in ("/etc", "/dev", "/proc", "/tmp", "/var/tmp"):
        os.makedirs(NEW_ROOT + path)
    for path in (*(f"/dev/{name}" for name in DEVICES), *HOST_FILES):
        if os.path.exists(path):
            bind_file(path)
    for name, target in DEVICE_LINKS.items():
        os.symlink(target, f"{NEW_ROOT}/dev/{name}")
    os.mkdir(f"{NEW_ROOT}/dev/shm")
    write_user_files(*user, home)
    # A fresh /proc lists only this run's processes; a container may refuse it. Mounted
    # while the host's /proc is in view: a user namespace may not mount one otherwise.
    with contextlib.suppress(OSError):
        mount("proc", f"{NEW_ROOT}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY)


def make_passage(path):
    """Makes `path` and the directories on the way to it, which can be passed through but
    not listed: on the way to an interpreter in /root/.pyenv, say, /root shows nothing."""
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        make_passage(parent)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o711)


def bind_file(path):
    with open(NEW_ROOT + path, "x"):
        pass
    mount(path, NEW_ROOT + path, None, MS_BIND)


def write_user_files(uid, gid, home):
    """Writes /etc/passwd and /etc/group that name root and the code's user only."""
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        name = "sandbox"
    users = {0: ("root", 0, "/root"), uid: (name, gid, home)}
    with open(f"{NEW_ROOT}/etc/passwd", "w") as file:
        for number, (login, group, directory) in users.items():
            file.write(f"{login}:x:{number}:{group}::{directory}:/usr/sbin/nologin\n")
    with open(f"{NEW_ROOT}/etc/group", "w") as file:
        file.write("".join(f"{login}:x:{group}:\n" for login, group, _ in users.values()))


def enter_root():
    """Makes the new root "/" and detaches the old one: no host path is left in reach."""
    os.chdir(NEW_ROOT)
    check(LIBC.pivot_root(b".", b"."))  # the old root now lies stacked on the new
    check(LIBC.umount2(b".", MNT_DETACH))
    os.chdir("/")


def set_attributes(path, flags):
    attr = MountAttr(set=flags)
    check(
        LIBC.syscall(
            SYS_MOUNT_SETATTR,
            ctypes.c_long(AT_FDCWD),
            path.encode(),
            ctypes.c_long(AT_RECURSIVE),
            ctypes.byref(attr),
            ctypes.c_long(ctypes.sizeof(attr)),
        )
    )


def private_tmp(tmp_mb):
    """Mounts one private tmpfs at /tmp, /var/tmp and /dev/shm, so that the run has one
    size limit for all three."""
    mount(
        "tmpfs",
        "/tmp",
        "tmpfs",
        MS_NOSUID | MS_NODEV,
        f"size={tmp_mb}m,nr_inodes={TMPFS_INODES},mode=0755",
    )
    # Directories of the tmpfs are bound over the others, /tmp's own last: it hides the
    # rest of the tmpfs.
    for name, target in (("var-tmp", "/var/tmp"), ("shm", "/dev/shm"), ("tmp", "/tmp")):
        os.mkdir(f"/tmp/{name}")
        os.chmod(f"/tmp/{name}", 0o1777)
        mount(f"/tmp/{name}", target, None, MS_BIND)


def drop_privileges(uid, gid):
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)


def system_call_filter(seccomp):
    """Returns the seccomp BPF program that refuses REFUSED and new namespaces, made once
    with libseccomp: a run loads it ready-made."""
    if _FILTER:
        return _FILTER[0]
    seccomp.seccomp_init.restype = ctypes.c_void_p
    seccomp.seccomp_init.argtypes = [ctypes.c_uint32]
    seccomp.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    seccomp.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.c_void_p,
    ]
    seccomp.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    seccomp.seccomp_release.argtypes = [ctypes.c_void_p]
    context = seccomp.seccomp_init(SCMP_ACT_ALLOW)  # other architectures' calls: killed

    def refuse(name, errno, *conditions):
        number = seccomp.seccomp_syscall_resolve_name(name.encode())
        if number == -1:
            return  # unknown to this libseccomp: older than the call
        array = (ArgCmp * len(conditions))(*conditions)
        result = seccomp.seccomp_rule_add_array(
            context, SCMP_ACT_ERRNO | errno, number, len(conditions), array
        )
        if result < 0:
            raise OSError(-result, f"seccomp rule for {name}: {os.strerror(-result)}")

    for name in REFUSED:
        refuse(name, EPERM)
    for flag in (CLONE_NEWUSER, *CLONE_NEW_OTHERS):  # clone's flags are its first argument
        refuse("clone", EPERM, ArgCmp(0, SCMP_CMP_MASKED_EQ, flag, flag))
    refuse("clone3", ENOSYS)
    read_end, write_end = os.pipe()
    result = seccomp.seccomp_export_bpf(context, write_end)
    os.close(write_end)
    program = b"".join(iter(lambda: os.read(read_end, 65536), b""))
    os.close(read_end)
    seccomp.seccomp_release(context)
    if result < 0 or not program:
        raise OSError(-result, f"seccomp_export_bpf: {os.strerror(-result)}")
    _FILTER.append(program)
    return program


_FILTER = []


class SockFprog(ctypes.Structure):  # the kernel's struct sock_fprog
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def refuse_system_calls(program):
    """Loads the BPF program (system_call_filter) as this process's seccomp filter."""
    instructions = ctypes.create_string_buffer(program, len(program))
    fprog = SockFprog(len(program) // 8, ctypes.cast(instructions, ctypes.c_void_p))
    check(LIBC.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
