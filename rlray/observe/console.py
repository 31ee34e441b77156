"""What reaches the console: rlray's own lines; the engines' chatter goes to a log file.

vLLM, torch and their libraries write to the process's stdout and stderr from Python
(warnings, progress bars) and from C++ (NUMA binding, kernel choices). Ray shows an
actor's stdout and stderr on the driver's console, so every run printed them. An engine
actor sends its file descriptors 1 and 2 to a log file in the run directory instead;
rlray's loggers keep writing to the stderr the actor started with, which Ray still shows.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path


def send_engine_output_to(log_file: str | Path | None) -> None:
    """Points this process's stdout and stderr at `log_file` (appended; made with its
    directory), keeping rlray's log records on the original stderr. Does nothing
    without a file, or where it cannot be made (a node that does not see the run
    directory): the output then stays on the console."""
    if log_file is None:
        return
    path = Path(log_file)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    except OSError:
        return
    console = os.fdopen(os.dup(2), "w", buffering=1)
    handler = logging.StreamHandler(console)
    handler.setFormatter(logging.Formatter("%(message)s"))
    rlray_logger = logging.getLogger("rlray")
    rlray_logger.addHandler(handler)
    rlray_logger.propagate = False  # the root logger's handlers write to fd 2: the file
    rlray_logger.setLevel(logging.WARNING)
    for descriptor in (1, 2):
        os.dup2(target, descriptor)
    os.close(target)
