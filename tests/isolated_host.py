"""Shell scripts run as on a machine of their own, for the tests of the cluster commands.

`run_isolated` runs a bash script as root in new PID, network and mount namespaces
(util-linux `unshare`):

- it sees only its own processes, so `ray stop` (which stops every Ray process it can
  see) stops only the Rays the script started, never the test session's cluster or
  another user's;
- its network is a loopback of its own, so Ray's default ports (6379, 8265) and sshd's
  port 22 are free there;
- Ray's default temp dir /tmp/ray is a private directory under the test's work dir;
- when the script ends or times out, everything it started dies with it
  (`unshare --kill-child`: the namespace's first process is killed, and the kernel kills
  the rest of the namespace).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

# A login shell's PATH on Debian, for "a fresh shell".
FRESH_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def missing_tools() -> list[str]:
    """Returns the tools run_isolated needs that this machine lacks."""
    return [tool for tool in ("unshare", "ip", "mount") if shutil.which(tool) is None]


def run_isolated(
    script: str,
    work_dir: Path,
    env: dict[str, str],
    timeout: float,
    binds: dict[Path, str] | None = None,
) -> subprocess.CompletedProcess:
    """Returns the finished `bash -e` run of `script` in fresh namespaces (stdout and
    stderr together in .stdout); `binds` maps host paths onto paths inside it."""
    if os.geteuid() != 0:
        raise PermissionError("run_isolated needs root (unshare, mount)")
    private_tmp_ray = work_dir / "tmp-ray"
    private_tmp_ray.mkdir(parents=True, exist_ok=True)
    Path("/tmp/ray").mkdir(exist_ok=True)  # the mount point; Ray creates it anyway
    mounts = {private_tmp_ray: "/tmp/ray", **(binds or {})}
    prelude = ["set -e", "ip link set lo up"]
    prelude += [f"mount --bind '{source}' '{target}'" for source, target in mounts.items()]
    script_file = work_dir / "isolated.sh"
    script_file.write_text("\n".join([*prelude, script]) + "\n")
    return subprocess.run(
        [
            "unshare",
            "--pid",
            "--fork",
            "--kill-child",
            "--mount-proc",
            "--net",
            "--mount",
            "bash",
            str(script_file),
        ],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        timeout=timeout,
    )
