"""Where a run's checkpoints are and which policy version each holds (no torch here: the
driver reads these)."""

from __future__ import annotations

import json
from pathlib import Path

LATEST = "latest"


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
