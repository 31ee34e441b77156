"""Where a run's checkpoints are and which policy version each holds (no torch here: the
driver reads these)."""

from __future__ import annotations

import json
import shutil
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
    staging = Path(run_dir) / "checkpoints" / f".staging-{version:06d}"
    if create:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    return staging


def publish_checkpoint(staging: Path, state: dict[str, Any]) -> Path:
    """Writes state.json into a fully written staging directory, renames it to
    checkpoints/step-NNNNNN and points checkpoints/latest at it (each step atomic, so a
    crash leaves the previous checkpoint the latest); returns its path."""
    root = staging.parent
    final = root / f"step-{state['version']:06d}"
    (staging / "state.json").write_text(json.dumps(state, indent=2))
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)
    (root / f"{LATEST}.tmp").write_text(final.name)
    (root / f"{LATEST}.tmp").rename(root / LATEST)
    return final
