"""The cluster commands as a user types them, run for real.

- The one-machine cluster lines of docs/cluster.md, taken from the page itself, run
  exactly as they stand, in order, in a fresh shell (clean environment, a fresh home
  directory) right after a job's own local Ray has run (started as a job starts it),
  which leaves ~/.ray/auth_token behind as `make run` does. Their job is the default
  job, so this test also checks that the default job (what `make run` runs) raises
  held-out accuracy by at least 20 points.
- `ray up cluster-local.yaml` against an sshd on loopback as the "remote" head: its
  setup and start commands as the file has them (the pip install aside: the head reuses
  this virtualenv), `ray dashboard`, `ray job submit`, `ray down`, with token
  authentication on (the head refuses a request without the token).

Both run in namespaces of their own (tests/isolated_host.py), so their `ray start` and
`ray stop` never meet the test session's cluster or anyone else's Ray.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rlray.config import LearnerConfig
from rlray.data.cache import cache_dir
from tests.isolated_host import FRESH_PATH, missing_tools, run_isolated
from tests.jobs_helper import REPO, SHORT_RUN

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="namespaces and sshd need root"),
]

VENV = Path(sys.executable).parent.parent
# One learner step; on the `ray up` head (as many CPUs as cores, 2 here) the actors
# reserve 2 CPUs instead of the default 2.5.
TINY_JOB = [*SHORT_RUN, "--learner.steps", "1"]
FITS_TWO_CPUS = ["--learner.cpus", "0.5", "--reward.cpus_per_worker", "0.5"]
SUCCEEDED = re.compile(r"Job 'raysubmit_\w+' succeeded")
# The default job's last words: its steps and held-out accuracy before and after.
DEFAULT_JOB_DONE = re.compile(
    rf"^done: {LearnerConfig().steps} steps, "
    r"held-out accuracy (?P<initial>[\d.]+) -> (?P<final>[\d.]+)",
    re.M,
)
SYSTEM_PACKAGES = {"sshd": "openssh-server", "rsync": "rsync", "ip": "iproute2"}
# Waits up to 60 s for something to listen on 127.0.0.1:PORT (argv[1]).
WAIT_FOR_PORT = (
    "import socket, sys, time\n"
    "for _ in range(60):\n"
    "    try: socket.create_connection(('127.0.0.1', int(sys.argv[1])), 1).close(); break\n"
    "    except OSError: time.sleep(1)"
)


def readme_local_cluster_lines() -> list[str]:
    """Returns the lines of docs/cluster.md's bash block that starts a one-node cluster."""
    blocks = re.findall(r"^```bash\n(.*?)^```", (REPO / "docs/cluster.md").read_text(), re.M | re.S)
    found = [b for b in blocks if re.search(r"^ray start --head", b, re.M)]
    assert len(found) == 1, f"docs/cluster.md has {len(found)} bash blocks with `ray start --head`"
    return found[0].splitlines()


def fresh_home(path: Path) -> Path:
    """Returns an empty home directory holding only rlray's model cache (which `make run`
    leaves there; linked, so that the embedded model is not built again)."""
    (path / ".cache").mkdir(parents=True)
    (path / ".cache" / "rlray").symlink_to(cache_dir())
    return path


def tail(text: str, lines: int = 80) -> str:
    return "\n".join(text.splitlines()[-lines:])


def test_readme_local_cluster_lines_work_in_a_fresh_shell_after_a_local_run(tmp_path):
    assert not missing_tools(), f"missing: {missing_tools()}"
    lines = readme_local_cluster_lines()
    assert any(line.startswith("ray job submit") for line in lines)
    assert any(line.startswith("ray stop") for line in lines)
    home = fresh_home(tmp_path / "home")
    (tmp_path / "readme-lines.sh").write_text("\n".join(lines) + "\n")
    # What a local run does with Ray (a whole run here cost the suite half a minute).
    start_ray = "from rlray.cluster.connection import connect; connect('', 1)"
    local_run = shlex.join([sys.executable, "-c", start_ray])
    script = f"""
cd {shlex.quote(str(REPO))}
{local_run} > {tmp_path}/local-run.log 2>&1 || {{ tail -40 {tmp_path}/local-run.log; exit 1; }}
test -s "$HOME/.ray/auth_token" || {{ echo "the local run left no ~/.ray/auth_token"; exit 1; }}
echo "--- docs/cluster.md's lines, in a fresh shell"
env -i HOME="$HOME" PATH={FRESH_PATH} bash -ex {tmp_path}/readme-lines.sh
"""
    env = {"HOME": str(home), "PATH": FRESH_PATH}
    result = run_isolated(script, tmp_path, env, timeout=900)
    assert result.returncode == 0, tail(result.stdout)
    assert SUCCEEDED.search(result.stdout), tail(result.stdout)
    done = DEFAULT_JOB_DONE.search(result.stdout)
    assert done, tail(result.stdout)
    assert float(done["final"]) - float(done["initial"]) >= 0.20, done[0]


# --- ray up cluster-local.yaml, with sshd on loopback as the head ------------------------


@pytest.fixture(scope="module")
def system_packages() -> None:
    """Installs openssh-server and rsync (Debian) when missing; `ray up` needs ssh to
    the head and rsync for its file mounts."""
    missing = [package for tool, package in SYSTEM_PACKAGES.items() if not _which(tool)]
    if not missing:
        return
    install = [
        "apt-get",
        "install",
        "-y",
        "--no-install-recommends",
        "-o",
        "DPkg::Lock::Timeout=300",
        *missing,
    ]
    # RUNLEVEL=1: the package's scripts do not start a system-wide sshd.
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive", "RUNLEVEL": "1"}
    if subprocess.run(install, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=600)
        result = subprocess.run(install, env=env, capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, f"apt-get install {missing}: {result.stderr[-2000:]}"


def _which(tool: str) -> str | None:
    return shutil.which(tool) or shutil.which(tool, path="/usr/sbin:/sbin")


def ray_up_config(name: str, key: Path) -> dict:
    """Returns cluster-local.yaml with this machine's loopback as the head and no
    workers, root with `key` as the ssh user, and the head's ~/venv linked to this
    virtualenv instead of pip installing into a new one (its other setup commands run
    as they stand: with ~/venv present they install nothing)."""
    config = yaml.safe_load((REPO / "cluster-local.yaml").read_text())
    config["cluster_name"] = name
    config["provider"].update(head_ip="127.0.0.1", worker_ips=[])
    config["auth"] = {"ssh_user": "root", "ssh_private_key": str(key)}
    setup = [c for c in config["setup_commands"] if "pip install" not in c]
    assert len(setup) == len(config["setup_commands"]) - 1
    config["setup_commands"] = [f"ln -sfn {VENV} ~/venv", *setup]
    return config


def ssh_head(tmp_path: Path) -> tuple[Path, Path, Path]:
    """Returns (sshd config, client key, passwd file) for an sshd on 127.0.0.1:22 that
    lets root in with the client key only. The passwd file gives root a fresh home, so
    that the head's setup (~/venv, ~/.bashrc, ~/rlray) stays in tmp_path."""
    remote_home = fresh_home(tmp_path / "head-home")
    (remote_home / ".ssh").mkdir(mode=0o700)
    for name in ("host_key", "client_key"):
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / name)],
            check=True,
        )
    authorized = remote_home / ".ssh" / "authorized_keys"
    shutil.copy(tmp_path / "client_key.pub", authorized)
    authorized.chmod(0o600)
    sshd_config = tmp_path / "sshd_config"
    sshd_config.write_text(
        f"""ListenAddress 127.0.0.1
Port 22
HostKey {tmp_path}/host_key
PidFile {tmp_path}/sshd.pid
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
AuthorizedKeysFile .ssh/authorized_keys
"""
    )
    passwd = tmp_path / "passwd"
    passwd.write_text(
        re.sub(
            r"^(root:[^:]*:0:0:[^:]*:)[^:]*:",
            rf"\g<1>{remote_home}:",
            Path("/etc/passwd").read_text(),
            flags=re.M,
        )
    )
    return sshd_config, tmp_path / "client_key", passwd


def remove_ssh_control_dir(cluster_name: str) -> None:
    """Removes the directory of ssh control sockets that `ray up` made for the cluster
    (/tmp/ray_ssh_<user hash>/<cluster hash>, outside the namespaces' private dirs)."""
    user, name = (hashlib.sha256(s.encode()).hexdigest()[:10] for s in ("root", cluster_name))
    parent = Path(f"/tmp/ray_ssh_{user}")
    shutil.rmtree(parent / name, ignore_errors=True)
    with contextlib.suppress(OSError):
        parent.rmdir()  # only if no other cluster's sockets are there


def test_ray_up_cluster_local_yaml_runs_a_job_on_a_loopback_head(system_packages, tmp_path):
    name = f"rlray-up-test-{os.getpid()}-{time.monotonic_ns()}"
    sshd_config, key, passwd = ssh_head(tmp_path)
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(ray_up_config(name, key), sort_keys=False))
    job = shlex.join(["python", "jobs/ppo.py", *TINY_JOB, *FITS_TWO_CPUS])
    script = f"""
mkdir -p /run/sshd  # sshd's privilege separation directory
{shutil.which("sshd", path="/usr/sbin:/sbin")} -D -e -f {sshd_config} 2> {tmp_path}/sshd.log &
cd {shlex.quote(str(REPO))}
. .venv/bin/activate
set -x
ray get-auth-token --generate > /dev/null  # a fresh home has no token
export RAY_AUTH_MODE=token
ray up -y {cluster}
# The head's dashboard holds 8265 on this shared loopback: forward another port.
ray dashboard --port 8266 {cluster} > {tmp_path}/dashboard.log 2>&1 &
python -c {shlex.quote(WAIT_FOR_PORT)} 8266
if env -u RAY_AUTH_MODE ray job list --address http://127.0.0.1:8266 > {tmp_path}/no-token.log 2>&1
then echo "the head took a request without the token"; exit 1
fi
grep "AuthenticationError" {tmp_path}/no-token.log
ray job submit --address http://127.0.0.1:8266 --working-dir . -- {job}
ray down -y {cluster}
! pgrep -f raylet || {{ echo "ray down left a raylet"; exit 1; }}
"""
    env = {"HOME": str(fresh_home(tmp_path / "home")), "PATH": FRESH_PATH}
    env["TMPDIR"] = str(tmp_path)  # ray up's cached provider config
    try:
        result = run_isolated(script, tmp_path, env, timeout=900, binds={passwd: "/etc/passwd"})
    finally:
        remove_ssh_control_dir(name)
    assert result.returncode == 0, tail(result.stdout, 120)
    assert SUCCEEDED.search(result.stdout), tail(result.stdout)
    assert "done: 1 steps" in result.stdout, tail(result.stdout)
