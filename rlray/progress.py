"""Console progress: one short line per learner step (and one per evaluation)."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from rlray.rollout import EvalResult


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


class Progress:
    """Prints step, reward, held-out accuracy, episodes/s and the time left."""

    def __init__(self, total_steps: int, first_step: int, out: TextIO = sys.stdout):
        self.total_steps = total_steps
        self.first_step = first_step
        self.out = out
        self.started = time.perf_counter()
        self.episodes = 0
        self.accuracy: float | None = None

    def evaluated(self, step: int, result: EvalResult) -> None:
        self.accuracy = result.accuracy
        example = "; ".join(f"{p}{c!r} (want {a})" for p, c, a in result.examples)
        print(
            f"eval  step {step:>4}  held-out accuracy {result.accuracy:.3f}  e.g. {example}",
            file=self.out,
            flush=True,
        )

    def stepped(self, record: dict[str, Any]) -> None:
        step = record["step"]
        self.episodes += record["episodes"]
        elapsed = time.perf_counter() - self.started
        done = step - self.first_step + 1
        eta = elapsed / done * (self.total_steps - step)
        accuracy = "  -  " if self.accuracy is None else f"{self.accuracy:.3f}"
        print(
            f"step {step:>4}/{self.total_steps}  reward {record['reward_mean']:.3f}  "
            f"acc {accuracy}  kl {record['kl']:+.4f}  "
            f"eps/s {self.episodes / elapsed:5.1f}  eta {_duration(eta)}",
            file=self.out,
            flush=True,
        )
