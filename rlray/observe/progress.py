"""Console progress: a live status line on a terminal, periodic plain lines otherwise.

On a TTY one line is rewritten in place at every learner step (step, reward, held-out
accuracy, episodes/s, time left); evaluations print a line of their own. Redirected to
a file or a log collector (`ray job logs`), a plain line is printed every `every_s`
seconds and at the first and last step, so logs stay short and readable.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from rlray.core.stats import EvalResult
from rlray.core.waiting import duration


class Progress:
    """Reports learner steps and evaluations as they happen."""

    def __init__(
        self, total_steps: int, first_step: int, out: TextIO = sys.stdout, every_s: float = 10.0
    ):
        self.total_steps = total_steps
        self.first_step = first_step
        self.out = out
        self.every_s = every_s
        self.live = out.isatty()
        self.started = time.perf_counter()
        self.last_printed = -float("inf")
        self.episodes = 0
        self.accuracy: float | None = None
        self._open_line = False

    def evaluated(
        self, step: int, result: EvalResult, metric: tuple[str, float, float] | None = None
    ) -> None:
        """Prints an evaluation: exact-match accuracy (if the rows have answers), the
        chosen metric as (name, value, standard error) if given, and a few examples."""
        parts = [f"eval  step {step:>4}"]
        if result.accuracy is not None:
            parts.append(f"held-out accuracy {result.accuracy:.3f}")
        if metric is not None:
            name, value, stderr = metric
            parts.append(f"{name} {value:.3f} ± {stderr:.3f}")
        accuracy = result.accuracy if result.accuracy is not None else metric and metric[1]
        self.accuracy = accuracy
        example = "; ".join(
            f"{p}{c!r}" + (f" (want {a})" if a else "") for p, c, a in result.examples
        )
        self._print_line("  ".join([*parts, f"e.g. {example}"]))

    def stepped(self, record: dict[str, Any]) -> None:
        step = record["step"]
        self.episodes += record["episodes"]
        line = self._status(step, record)
        now = time.perf_counter()
        if self.live:
            print(f"\r{line}\033[K", end="", file=self.out, flush=True)
            self._open_line = True
        elif step in (self.first_step, self.total_steps) or now - self.last_printed >= self.every_s:
            print(line, file=self.out, flush=True)
            self.last_printed = now
        if self.live and step == self.total_steps:
            self.close()

    def _status(self, step: int, record: dict[str, Any]) -> str:
        elapsed = time.perf_counter() - self.started
        done = step - self.first_step + 1
        eta = elapsed / done * (self.total_steps - step)
        accuracy = "  -  " if self.accuracy is None else f"{self.accuracy:.3f}"
        kl = "" if record.get("kl") is None else f"kl {record['kl']:+.4f}  "
        return (
            f"step {step:>4}/{self.total_steps}  reward {record['reward_mean']:.3f}  "
            f"acc {accuracy}  {kl}"
            f"eps/s {self.episodes / elapsed:5.1f}  eta {duration(eta)}"
        )

    def _print_line(self, line: str) -> None:
        if self._open_line:  # keep the live status line; put this one under it
            print(file=self.out)
            self._open_line = False
        print(line, file=self.out, flush=True)

    def close(self) -> None:
        """Ends the live status line (a no-op when not on a terminal)."""
        if self._open_line:
            print(file=self.out, flush=True)
            self._open_line = False
