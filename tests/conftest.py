"""One Ray cluster for the whole test session, started the way users start one.

`ray start --head --block` runs in the background for the session; tests that need Ray
join it with `ray.init(address=...)`, and the job-submission test submits to its
dashboard. Starting Ray once saves seconds per test on this 2-core machine. Under `make
test` each of the two pytest workers is a session of its own, with its own cluster.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from rlray.data.cache import cache_dir, file_lock

REPO = Path(__file__).resolve().parent.parent
AWS_TEST_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}

# Token authentication on, as `ray start` has it whenever ~/.ray/auth_token exists;
# every client of the session's cluster (this process, jobs, the CLI) sends the token.
# Set before anything imports ray, which reads it once.
os.environ["RAY_AUTH_MODE"] = "token"


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--device",
        default="cpu",
        help="torch device of the learner and math tests (cpu here; cuda on a GPU machine)",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Puts the files that hold `slow` tests (job runs, vLLM engines) first, each file's
    tests in their own order. `make test` runs two pytest workers, each taking a whole
    file at a time (pytest-xdist's loadfile, in this order): the long files start at
    once, and the short ones fill in beside them at the end instead of one long file
    running alone after everything else."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)


@pytest.fixture(scope="session")
def device(request) -> str:
    """The torch device the learner and math tests run on (pytest --device cuda)."""
    return request.config.getoption("--device")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class RayCluster:
    address: str
    dashboard_url: str
    metrics_url: str
    """The head node's Prometheus export of Ray's (and rlray's) metrics."""
    env: dict[str, str]


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory) -> RayCluster:
    """Starts `ray start --head` (logical CPUs beyond the 2 real ones so that several
    tests' actors never wait on each other) and stops it at the end of the session."""
    port, dashboard_port, metrics_port = free_port(), free_port(), free_port()
    bin_dir = str(Path(sys.executable).parent)
    # Jobs submitted to this cluster run `python` from the same virtualenv. Its nodes
    # hold (fake) AWS credentials, as cluster nodes with an instance role do, for the
    # S3 server the store tests start.
    env = {
        **os.environ,
        **AWS_TEST_CREDENTIALS,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        # Metrics reach the Prometheus export every 2 s instead of 10, so that a short
        # run's are all scraped before it ends (tests/test_job.py's GRPO run).
        "RAY_metrics_report_interval_ms": "2000",
    }
    # Under the lock: `make test`'s two workers each start a cluster, and on a fresh
    # machine both would otherwise write a token of their own, one after the other.
    with file_lock(cache_dir() / "tests-auth-token.lock"):
        subprocess.run(
            [f"{bin_dir}/ray", "get-auth-token", "--generate"],
            env=env,
            check=True,
            capture_output=True,
            timeout=60,
        )
    log = (tmp_path_factory.mktemp("ray") / "ray-start.log").open("w")
    process = subprocess.Popen(
        [
            f"{bin_dir}/ray",
            "start",
            "--head",
            "--block",
            "--port",
            str(port),
            "--num-cpus",
            "8",
            "--include-dashboard",
            "true",
            "--dashboard-host",
            "127.0.0.1",
            "--dashboard-port",
            str(dashboard_port),
            "--metrics-export-port",
            str(metrics_port),
            "--disable-usage-stats",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    address = f"127.0.0.1:{port}"
    cluster = RayCluster(
        address,
        f"http://127.0.0.1:{dashboard_port}",
        f"http://127.0.0.1:{metrics_port}/metrics",
        env,
    )
    try:
        _wait_until_up(cluster, process)
        yield cluster
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        process.terminate()  # `ray start --block` stops its processes on SIGTERM
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)


def _wait_until_up(cluster: RayCluster, process: subprocess.Popen) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"ray start exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"{cluster.dashboard_url}/api/version", timeout=2):
                return
        except urllib.error.HTTPError:
            return  # it answers (token authentication refuses anonymous requests)
        except OSError:
            time.sleep(1)
    raise RuntimeError("ray start --head did not bring up the dashboard within 120 s")


@pytest.fixture(scope="session")
def ray_session(ray_cluster):
    """This process joined to the session's cluster."""
    import ray

    if not ray.is_initialized():
        ray.init(address=ray_cluster.address, log_to_driver=False)
    return ray_cluster


@pytest.fixture(scope="session")
def rollout_host(ray_session):
    """The session's RolloutHost actor (tests/rollout_host.py): one process, vLLM
    imported once, for every test that needs a rollout actor on a model of its own."""
    from tests.rollout_host import started_host

    with started_host() as host:
        yield host


@pytest.fixture(scope="session")
def job_env(ray_cluster) -> dict[str, str]:
    """Environment for `python jobs/ppo.py` subprocesses that join the session's cluster."""
    return {**ray_cluster.env, "RAY_ADDRESS": ray_cluster.address}
