"""The sandboxed child's first program: isolates itself, then execs the code's command.

Run by `rlray.sandbox.run` as `python -I -S -B launcher.py '<json config>'`, in a fresh
single-threaded interpreter (never between fork and exec in the caller, which may be a
Ray actor with threads). It imports only the standard library: `-S` leaves
site-packages out. As root it stays root until the namespaces and mounts are made. With
namespaces it forks: this process (the watcher) stays outside the new pid namespace and
exits as the code does; its child is pid 1 there, sets up the file system and execs the
code.

The config's keys: caller (pid that must stay its parent), rlimits ([resource, value]
pairs), namespaces, seccomp (bools), user ([uid, gid] or null), tmp_mb, workdir, and
command (argv to exec).
"""

import contextlib
import ctypes
import json
import os
import resource
import signal
import sys

LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
LIBC.syscall.restype = ctypes.c_long
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 0x40000
SYS_MOUNT_SETATTR, AT_FDCWD, AT_RECURSIVE = 442, -100, 0x8000  # 442 on every arch
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 0x1, 0x2
CLONE_NEWUSER = 0x10000000
# mount, cgroup, UTS, IPC, pid, network
CLONE_NEW_OTHERS = (0x20000, 0x2000000, 0x4000000, 0x8000000, 0x20000000, 0x40000000)
TMPFS_INODES = 16384  # files and directories; empty ones cost kernel memory but no size

# Refused with EPERM (the code's own mount namespace is fixed).
REFUSED = (
    *("unshare", "setns", "pivot_root", "chroot"),  # new namespaces and roots
    *("mount", "umount2", "open_tree", "move_mount", "mount_setattr"),  # mounts
    *("fsopen", "fsconfig", "fsmount", "fspick"),
    *("ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd"),  # others' memory
    *("keyctl", "add_key", "request_key"),  # kernel keyrings: one per uid, shared by runs
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
    tie_to_parent(lambda: os.getppid() == config["caller"])
    for which, value in config["rlimits"]:
        resource.setrlimit(which, (value, value))
    if config["namespaces"]:
        watcher_gone = enter_namespaces()
        private_file_system(config["tmp_mb"])
        os.chdir(config["workdir"])
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
    if config["seccomp"]:
        refuse_system_calls()
    os.execv(config["command"][0], config["command"])


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


def private_file_system(tmp_mb):
    """Makes every mount read-only and mounts one private tmpfs at /tmp, /var/tmp and
    /dev/shm, so that the run has one size limit for all three."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below reaches the host
    attr = MountAttr(set=MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID)
    check(
        LIBC.syscall(
            SYS_MOUNT_SETATTR,
            ctypes.c_long(AT_FDCWD),
            b"/",
            ctypes.c_long(AT_RECURSIVE),
            ctypes.byref(attr),
            ctypes.c_long(ctypes.sizeof(attr)),
        )
    )
    # A fresh /proc lists only this run's processes; a container may refuse it.
    with contextlib.suppress(OSError):
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY)
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
        if os.path.isdir(target):
            mount(f"/tmp/{name}", target, None, MS_BIND)


def drop_privileges(uid, gid):
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)


def refuse_system_calls():
    seccomp = ctypes.CDLL("libseccomp.so.2")
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
    seccomp.seccomp_load.argtypes = [ctypes.c_void_p]
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
    result = seccomp.seccomp_load(context)
    if result < 0:
        raise OSError(-result, f"seccomp_load: {os.strerror(-result)}")


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
