"""Where a run's checkpoints are, which policy version each holds, and whether each is
whole (no torch here: the driver reads these before any actor starts).

A checkpoint is published with a manifest in its state.json: every other file's size
and SHA-256, taken when it was saved. A checkpoint verifies when its state.json reads
and every file of the manifest is there with its size and checksum. Resume takes the
newest checkpoint that verifies, whatever checkpoints/latest says: a crash can leave a
truncated file, a disk can lose one, and a person can delete one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

LATEST = "latest"
BEST = "best.json"
STATE = "state.json"
_STEP_DIRECTORY = re.compile(r"^step-(\d+)$")


@dataclass
class CheckpointSearch:
    """The newest checkpoint of a run that verifies, and the newer ones that did not."""

    checkpoint: Path | None
    skipped: list[str] = field(default_factory=list)
    """One line per newer checkpoint passed over: its name and what is wrong, naming the file."""


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """Returns the run's newest checkpoint that verifies, or None; logs a warning for
    each newer one it passed over."""
    search = find_checkpoint(run_dir)
    for line in search.skipped:
        logger.warning("warning: skipped checkpoint %s", line)
    return search.checkpoint


def find_checkpoint(run_dir: str | Path) -> CheckpointSearch:
    """Returns the run's newest checkpoint that verifies (None if none does), with the
    reasons the newer ones were skipped."""
    search = CheckpointSearch(None)
    for candidate in _step_directories(Path(run_dir) / "checkpoints"):
        problem = checkpoint_problem(candidate)
        if problem is None:
            search.checkpoint = candidate
            return search
        search.skipped.append(f"{candidate.name}: {problem}")
    return search


def _step_directories(root: Path) -> list[Path]:
    """Returns checkpoints/step-N directories, newest first."""
    if not root.is_dir():
        return []
    found = [(int(m[1]), p) for p in root.iterdir() if (m := _STEP_DIRECTORY.match(p.name))]
    return [path for _, path in sorted(found, reverse=True) if path.is_dir()]


def checkpoint_problem(checkpoint: Path) -> str | None:
    """Returns what is wrong with a checkpoint directory, naming the file (None when it
    verifies): state.json must read, and each file of its manifest must be there with
    the size, then the checksum, it had when saved."""
    state_file = checkpoint / STATE
    try:
        state = json.loads(state_file.read_text())
        int(state["version"])
    except FileNotFoundError:
        return f"{state_file} is missing"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{state_file} does not read as a checkpoint's state ({type(err).__name__})"
    files = state.get("files")
    if files is None:
        # Saved before checkpoints carried a manifest: usable, but nothing to check.
        logger.warning("warning: %s holds no checksums; its files are not verified", state_file)
        return None
    for name, saved in files.items():
        path = checkpoint / name
        if not path.is_file():
            return f"{path} is missing"
        if (size := path.stat().st_size) != saved["bytes"]:
            return f"{path} has {size} bytes, {saved['bytes']} when saved (truncated?)"
    for name, saved in files.items():
        if file_sha256(checkpoint / name) != saved["sha256"]:
            return f"{checkpoint / name} does not match the checksum taken when it was saved"
    return None


def file_sha256(path: Path) -> str:
    with path.open("rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def file_manifest(directory: Path) -> dict[str, dict[str, Any]]:
    """Returns {relative path: {"bytes", "sha256"}} for every file under `directory`
    but its state.json."""
    return {
        str(path.relative_to(directory)): {
            "bytes": path.stat().st_size,
            "sha256": file_sha256(path),
        }
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path != directory / STATE
    }


def checkpoint_version(checkpoint: str | Path) -> int:
    """Returns the policy version saved in a checkpoint directory."""
    return int(json.loads((Path(checkpoint) / STATE).read_text())["version"])


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
    """Seals a fully written staging directory (`seal_checkpoint`) and publishes it
    (`publish_sealed`); returns its path."""
    seal_checkpoint(staging, state)
    return publish_sealed(staging)


def seal_checkpoint(staging: Path, state: dict[str, Any]) -> None:
    """Writes state.json, with the manifest of every file, into a fully written staging
    directory: whole from then on, whether or not it is published."""
    state = {**state, "files": file_manifest(staging)}
    (staging / STATE).write_text(json.dumps(state, indent=2))


def publish_sealed(staging: Path) -> Path:
    """Renames a sealed staging directory to checkpoints/step-NNNNNN and points
    checkpoints/latest at it (each step atomic, so a crash leaves the previous
    checkpoint the latest); returns its path."""
    root = staging.parent
    final = root / f"step-{checkpoint_version(staging):06d}"
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)
    (root / f"{LATEST}.tmp").write_text(final.name)
    (root / f"{LATEST}.tmp").rename(root / LATEST)
    return final


def resume_point(checkpoint: str | None) -> tuple[int, int]:
    """Returns (policy version, prompt cursor) of a checkpoint; (0, 0) without one."""
    if not checkpoint:
        return 0, 0
    state = json.loads((Path(checkpoint) / STATE).read_text())
    return int(state["version"]), int(state["prompt_cursor"])
