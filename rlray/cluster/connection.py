"""Joining a run's Ray: a cluster's, or a single-node Ray the job starts for itself, and
the workarounds a job's own Ray needs (no unused head processes, its processes outside
the driver's process group, a watchdog that ends them with the driver, the actors'
output watched from the driver, the auth token a client must send); and how many CPUs a
run's actors ask of it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import ray
from ray._private.log_monitor import LogMonitor, is_proc_alive
from ray._raylet import GcsClient

from rlray.cluster import local_ray_watchdog
from rlray.config import Config
from rlray.core.interrupts import interrupts_held


def connect(address: str, num_cpus: int) -> None:
    """Joins the cluster in `address` or RAY_ADDRESS (set by `ray job submit`), else
    starts a new single-node Ray for this job, even if a `ray start` cluster runs here.

    The caller's SIGINT and SIGTERM handlers stay, and a signal that arrives while Ray
    starts reaches the caller's handler when ray.init returns. Held in Python, not
    blocked in the kernel: the processes a local Ray starts would inherit a blocked
    SIGTERM and ignore the one Ray's shutdown sends them, each then killed only after a
    wait (added to every run's end)."""
    if ray.is_initialized():
        return
    # The driver's core worker would print a native stack dump on SIGTERM, which stops a
    # run as Ctrl-C does (its actors' workers keep their crash reports).
    ray._private.ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
    target = address or os.environ.get("RAY_ADDRESS", "")
    with interrupts_held(), _without_rays_sigterm_handlers():
        _init(target, num_cpus)


@contextlib.contextmanager
def _without_rays_sigterm_handlers() -> Iterator[None]:
    """Keeps ray.init from installing its SIGTERM handlers (the driver's: exit at once;
    a local head node's: stop its processes, then exit), which would replace the hold
    of interrupts_held. Their SystemExit cannot be relied on to stop ray.init anyway: a
    SIGTERM that arrives while ray.init starts a process runs the handler inside the
    fork's hooks, where Python ignores exceptions, and the signal was lost (the job then
    ran to its end). The local Ray's processes are still stopped at exit (Ray's atexit
    hook) and by local_ray_watchdog.py."""
    utils = ray._private.utils
    original = utils.set_sigterm_handler
    utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        utils.set_sigterm_handler = original


def _init(target: str, num_cpus: int) -> None:
    if target:
        _send_auth_token_if_any()
        ray.init(address=target)
        return
    # Before ray.init: a signal that stops the job while Ray starts leaves nothing either.
    _end_local_ray_with_this_process()
    with _without_unused_head_processes(), _in_a_process_group_of_their_own():
        ray.init(
            address="local",
            num_cpus=num_cpus,
            include_dashboard=False,
            logging_level=logging.WARNING,  # not "Started a local Ray instance"
        )
    _watch_actor_output_in_this_process()


@contextlib.contextmanager
def _without_unused_head_processes() -> Iterator[None]:
    """Starts a job's own Ray without three head processes: the autoscaler's monitor
    (one node, nothing to scale) and, the dashboard being off, the API server, which then
    loads only Ray's usage-stats module, it never uses (memory held all run, and time at
    its start and stop); the log monitor, which brings
    the actors' output to the console, runs in this process instead
    (_watch_actor_output_in_this_process). ray.init has no parameter for any of them (Ray
    2.60 keeps them in its Node class), so they are skipped for this one call. The
    metrics export (the dashboard agent) stays."""
    node = ray._private.node.Node
    saved = node.start_monitor, node.start_api_server, node.start_log_monitor
    node.start_monitor = lambda self: None
    node.start_api_server = lambda self, **_: None
    node.start_log_monitor = lambda self: None
    try:
        yield
    finally:
        node.start_monitor, node.start_api_server, node.start_log_monitor = saved


@contextlib.contextmanager
def _in_a_process_group_of_their_own() -> Iterator[None]:
    """Starts the job's own Ray (its GCS, its raylet and, below the raylet, every actor's
    worker) outside the driver's process group. `timeout` and `kill -- -PGID` signal a
    whole group: a SIGTERM that reached the raylet too stopped it
    while the driver was still sending the episodes in flight to the store, and the
    driver's core worker then exits the process (status 1, those episodes lost) at its
    first call to the raylet. Out of the group, the SIGTERM reaches only the driver, which
    stops as on Ctrl-C and then ends its Ray (and local_ray_watchdog.py, should the
    driver be killed outright). Ray's processes block SIGINT already: a terminal's
    Ctrl-C is the driver's alone either way. ray.init has no parameter for this (Ray 2.60
    starts each process through one Popen subclass), so that class is swapped for this
    one call."""
    services = ray._private.services
    original = services.ConsolePopen

    class OwnGroupPopen(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, process_group=0, **kwargs)

    services.ConsolePopen = OwnGroupPopen
    try:
        yield
    finally:
        services.ConsolePopen = original


def _watch_actor_output_in_this_process() -> None:
    """Runs Ray's log monitor, which sends new lines of the actors' log files to the
    driver's console, in a thread of the driver: a process of its own would hold its own
    memory for a loop that reads files, and the driver has every module it needs loaded
    already. It stops with the local Ray."""
    node = ray._private.worker.global_worker.node
    gcs = GcsClient(address=node.gcs_address)
    logs = node.get_logs_dir_path()
    address = node.gcs_address
    monitor = LogMonitor(node.node_ip_address, logs, gcs, is_proc_alive, gcs_address=address)

    def watch() -> None:
        with contextlib.suppress(Exception):  # the local Ray is gone: nothing to send
            monitor.run()

    threading.Thread(target=watch, name="ray-log-monitor", daemon=True).start()


def _end_local_ray_with_this_process() -> None:
    """Starts local_ray_watchdog.py over the processes this process starts (the local
    Ray's), so that none of them outlives it (see there)."""
    read_end, _ = os.pipe()  # the write end stays open, unshared, while this process lives
    subprocess.Popen(
        [sys.executable, local_ray_watchdog.__file__, str(read_end), str(os.getpid())],
        pass_fds=(read_end,),
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    os.close(read_end)


def _send_auth_token_if_any() -> None:
    # `ray start` turns token authentication on when ~/.ray/auth_token exists, but a
    # client joining with ray.init(address=...) sends the token only in token mode
    # (Ray 2.60): without this, joining fails with "InvalidAuthToken". This is what
    # `ray start` itself calls; it also refreshes Ray's cached config.
    from ray._private.authentication.authentication_token_setup import (
        maybe_enable_token_auth_if_token_available,
    )

    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def required_cpus(config: Config) -> float:
    """Returns the logical CPUs the run's actors reserve."""
    return (
        config.rollout.num_workers * config.rollout.cpus_per_worker
        + config.reward.num_workers * config.reward.cpus_per_worker
        + config.learner.num_workers * config.learner.cpus
    )
