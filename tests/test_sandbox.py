"""The sandbox's limits, each shown on a real child process, and the code_tests reward."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import time

import psutil
import pytest

from rlray import sandbox
from rlray.rewards.code import code_tests, extract_code
from rlray.sandbox import SandboxLimits, run_python

AS_ROOT = os.geteuid() == 0


def test_exit_status_and_output_are_captured():
    result = run_python("import sys\nprint('out')\nprint('err', file=sys.stderr)\nsys.exit(3)")
    assert (result.returncode, result.stdout, result.stderr) == (3, "out\n", "err\n")
    assert not result.timed_out


def test_output_is_cut_at_the_limit_without_stopping_the_code():
    result = run_python("print('x' * 10**7)\nprint('done')", SandboxLimits(max_output_bytes=100))
    assert result.returncode == 0
    assert result.stdout == "x" * 100


def test_each_run_gets_a_fresh_directory_that_is_deleted():
    look_and_write = "import os\nprint(os.getcwd(), os.listdir())\nopen('left.txt', 'w').write('x')"
    runs = [run_python(look_and_write) for _ in range(2)]
    assert [run.returncode for run in runs] == [0, 0], runs[0].stderr
    (first_dir, first_files), (second_dir, second_files) = (r.stdout.split() for r in runs)
    assert first_dir != second_dir and first_files == second_files == "[]"
    assert not os.path.exists(first_dir) and not os.path.exists(second_dir)


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
    source = f"import os\nprint(os.getpid(), flush=True)\n{bomb}"
    result = run_python(source, SandboxLimits(timeout_s=2, max_processes=8))
    session = int(result.stdout.split()[0])  # the first process leads the run's session
    assert _eventually(lambda: not _live_pids(lambda p: os.getsid(p.pid) == session))
    if AS_ROOT:  # every process as the sandbox's user is the run's
        assert _eventually(lambda: _live_pids(lambda p: p.uids().real == sandbox_uid) <= before)


def test_process_that_leaves_the_process_group_is_killed_too():
    if not sandbox._isolation().unshare_flags:
        pytest.skip(reason="found by its network namespace, and there is none here")
    escape = (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    print(os.getpid(), flush=True)\n"
    )
    result = run_python(f"{escape}    time.sleep(1000)", SandboxLimits(timeout_s=1))
    escaped = int(result.stdout.split()[0])
    assert _eventually(lambda: not _live_pids(lambda p: p.pid == escaped))


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
        except (psutil.Error, ProcessLookupError):
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
    without_namespace = dataclasses.replace(sandbox._isolation(), unshare_flags=0)
    monkeypatch.setattr(sandbox, "_isolation", lambda: without_namespace)
    with socket.create_server(("127.0.0.1", 0)) as server:
        inside = run_python(CONNECT.format(port=server.getsockname()[1]))
    assert inside.stdout == "refused: network access is disabled in this sandbox\n"


SQUARE = "```python\ndef square(x):\n    return x * x\n```"


def test_code_tests_gives_full_credit_when_every_test_passes():
    tests = [["assert square(3) == 9", "assert square(-2) == 4"]]
    assert code_tests(["p"], [SQUARE], tests=tests) == [1.0]


def test_code_tests_gives_partial_credit_per_test():
    tests = [["assert square(3) == 9", "assert square(2) == 4", "assert square(2) == 5"]]
    assert code_tests(["p"], [SQUARE], tests=tests) == [pytest.approx(2 / 3)]


def test_string_of_tests_holds_one_test_per_line():
    tests = ["assert square(3) == 9\n\n  assert square(1) == 2  \n"]
    assert code_tests(["p"], [SQUARE], tests=tests) == [0.5]


def test_syntax_error_scores_zero():
    assert code_tests(["p"], ["def square(x) return x"], tests=[["assert square(1)"]]) == [0.0]


def test_episode_without_tests_scores_none():
    assert code_tests(["p"] * 3, [SQUARE] * 3, tests=[None, [], " \n"]) == [None] * 3
    assert code_tests(["p"], [SQUARE]) == [None]


def test_tests_after_the_code_hangs_count_as_failed():
    tests = [["assert square(2) == 4", "while True: pass", "assert square(3) == 9"]]
    assert code_tests(["p"], [SQUARE], tests=tests, timeout_s=1) == [pytest.approx(1 / 3)]


FORGERIES = {
    "prints_result_lines": "import os\nfor i in range(3):\n    print(f'x {i} pass')\n"
    "    os.write(1, f'{i} pass\\n'.encode())\nos._exit(0)",
    "replaces_exec": "import builtins\nbuiltins.exec = lambda *args, **kwargs: None",
    "exits_before_the_tests": "import os\nos._exit(0)",
}


@pytest.mark.parametrize("solution", FORGERIES.values(), ids=FORGERIES.keys())
def test_solution_that_forges_results_gets_no_credit(solution):
    tests = [["assert square(3) == 9", "assert 1 == 2", "assert square(1) == 1"]]
    assert code_tests(["p"], [solution], tests=tests) == [0.0]


def test_code_is_taken_from_the_last_fenced_block():
    completion = (
        f"First try:\n```python\ndef square(x):\n    return x\n```\nBetter:\n{SQUARE}\nDone."
    )
    assert extract_code(completion) == "def square(x):\n    return x * x\n"
    assert extract_code("def f(): pass") == "def f(): pass"
    assert extract_code("```\nx = 1\n```") == "x = 1\n"
    assert extract_code("```python\nx = 1\n") == "x = 1\n"  # cut at the token limit
    assert extract_code("```python\nx = 1\n```\n```bash\nls\n```") == "x = 1\n"
    assert extract_code("1. Code:\n   ```py\n   y = 2\n   ```") == "y = 2\n"
    assert code_tests(["p"], [completion], tests=[["assert square(3) == 9"]]) == [1.0]


def test_non_ascii_code_and_tests_work():
    completion = "```python\ndef greet(name):\n    return f'¡Hola, {name}! 😀'\n```"
    tests = [["assert greet('Zoë') == '¡Hola, Zoë! 😀'", "assert greet('名') == '¡Hola, 名! 😀'"]]
    assert code_tests(["p"], [completion], tests=tests) == [1.0]


def test_batch_scores_each_episode_against_its_own_tests():
    wrong = "def square(x):\n    return x + x"
    tests = [["assert square(3) == 9"]] * 2 + [None]
    assert code_tests(["p"] * 3, [SQUARE, wrong, SQUARE], tests=tests) == [1.0, 0.0, None]
