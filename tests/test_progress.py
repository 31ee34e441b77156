"""Progress: a live line on a terminal, periodic plain lines in logs."""

from __future__ import annotations

import io

from rlray.core.stats import EvalResult
from rlray.observe.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def record(step: int) -> dict:
    return {"step": step, "episodes": 32, "reward_mean": 0.5, "kl": 0.01}


def test_logs_get_the_first_and_last_step_and_periodic_lines():
    out = io.StringIO()
    progress = Progress(total_steps=5, first_step=1, out=out, every_s=3600)
    progress.evaluated(0, EvalResult(0.25, 0, [("1+1=", "2", "2")]))
    for step in range(1, 6):
        progress.stepped(record(step))
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("eval  step    0  held-out accuracy 0.250  e.g. 1+1='2' (want 2)")
    assert [line.split()[1] for line in lines[1:]] == ["1/5", "5/5"]
    assert "\r" not in out.getvalue()
    every = io.StringIO()
    progress = Progress(total_steps=3, first_step=1, out=every, every_s=0)
    for step in range(1, 4):
        progress.stepped(record(step))
    assert len(every.getvalue().splitlines()) == 3


def test_a_terminal_gets_one_live_line_and_evaluations_below_it():
    out = Terminal()
    progress = Progress(total_steps=3, first_step=1, out=out)
    progress.stepped(record(1))
    progress.stepped(record(2))
    progress.evaluated(2, EvalResult(0.5, 2, []))
    progress.stepped(record(3))
    text = out.getvalue()
    assert text.count("\r") == 3  # the status line rewritten in place at every step
    assert "held-out accuracy 0.500" in text
    assert text.endswith("\n")  # the last step closes the live line
    assert "acc 0.500" in text.rsplit("\r", 1)[1]


def test_an_evaluation_without_answers_shows_its_metric_with_its_standard_error():
    out = io.StringIO()
    progress = Progress(total_steps=2, first_step=1, out=out, every_s=3600)
    progress.evaluated(0, EvalResult(None, 0, []), ("reward/pass@4", 0.625, 0.0625))
    progress.stepped(record(1))
    first, second = out.getvalue().splitlines()
    assert first.startswith("eval  step    0  reward/pass@4 0.625 ± 0.062  e.g.")
    assert "held-out accuracy" not in first
    assert "acc 0.625" in second
