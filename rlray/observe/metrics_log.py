"""metrics.jsonl: one JSON line per learner step."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rlray.core.files import writing
from rlray.observe.tracking import Trackers


class MetricsLog:
    """metrics.jsonl, one JSON line per learner step, appended (a resumed run continues
    it); every line also goes to the trackers (TensorBoard, wandb) if given."""

    def __init__(self, run_dir: Path, trackers: Trackers | None = None):
        self.path = run_dir / "metrics.jsonl"
        self.trackers = trackers

    def write(self, record: dict[str, Any]) -> None:
        with writing(self.path), self.path.open("a") as out:
            out.write(json.dumps(_finite(record), allow_nan=False) + "\n")
        if self.trackers is not None:
            self.trackers.log(record)

    def keep_before(self, step: int) -> None:
        """Drops the lines of `step` and later: a resumed run logs them again, so that
        no step appears twice."""
        kept = [json.dumps(r) + "\n" for r in self.read() if r["step"] < step]
        if self.path.exists():
            self.path.write_text("".join(kept))

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


def _finite(value: Any) -> Any:
    """Returns `value` with every NaN or infinity made null: JSON has neither, and a
    reader of metrics.jsonl (jq, pandas) refuses the line that holds one."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value
