"""Where a run's checkpoints are and which policy version each holds (no torch here: the
driver reads these)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

LATEST = "latest"
BEST = "best.json"


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """Returns the run's most recent complete checkpoint, or None."""
    pointer = Path(run_dir) / "checkpoints" / LATEST
    if not pointer.is_file():
        return None
    path = pointer.parent / pointer.read_text().strip()
    return path if (path / "state.json").is_file() else None


def checkpoint_version(checkpoint: str | Path) -> int:
    """Returns the policy version saved in a checkpoint directory."""
    return int(json.loads((Path(checkpoint) / "state.json").read_text())["version"])


def staging_directory(run_dir: str | Path, version: int, create: bool = True) -> Path:
    """Returns the directory a checkpoint of `version` is written into before
    `publish_checkpoint` makes it the run's latest; emptied and made if `create` (one
    writer does that for a learner group)."""
    import shutil

    staging = Path(run_dir) / "checkpoints" / f".staging-{version:06d}"
    if create:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    return staging


def publish_checkpoint(staging: Path, state: dict[str, Any]) -> Path:
    """Writes state.json into a fully written staging directory, renames it to
    checkpoints/step-NNNNNN and points checkpoints/latest at it (each step atomic, so a
    crash leaves the previous checkpoint the latest); returns its path."""
    import shutil

    root = staging.parent
    final = root / f"step-{state['version']:06d}"
    (staging / "state.json").write_text(json.dumps(state, indent=2))
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)
    (root / f"{LATEST}.tmp").write_text(final.name)
    (root / f"{LATEST}.tmp").rename(root / LATEST)
    return final


class BestCheckpoint:
    """The run's best evaluation by one metric, in checkpoints/best.json: its step, the
    metric's value and standard error, and the checkpoint of that step (None for step 0,
    the base model, whose path `model` names).

    Higher is better (every metric is a reward's); of equal values the first is kept, as
    rlray.evaluation.best_checkpoint chooses. A resumed run continues the record of the
    steps it kept."""

    def __init__(self, run_dir: str | Path, metric: str, before_step: int):
        self.metric = metric
        self.path = Path(run_dir) / "checkpoints" / BEST
        self.best: dict[str, Any] | None = None
        if metric and self.path.is_file():
            kept = json.loads(self.path.read_text())
            if kept.get("metric") == metric and kept["step"] < before_step:
                self.best = kept

    def improves(self, metrics: dict[str, Any]) -> bool:
        """Returns True if an evaluation's metrics (name: value) beat the best so far."""
        if not self.metric:
            return False
        return self.best is None or metrics[self.metric] > self.best["value"]

    def record(
        self, step: int, value: float, stderr: float, checkpoint: str | None, model: str
    ) -> None:
        """Makes this evaluation the best and writes best.json (atomically)."""
        self.best = {
            "metric": self.metric,
            "step": step,
            "value": value,
            "stderr": stderr,
            "checkpoint": checkpoint,
            "model": model,
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        staging = self.path.with_suffix(".tmp")
        staging.write_text(json.dumps(self.best, indent=2))
        staging.rename(self.path)
