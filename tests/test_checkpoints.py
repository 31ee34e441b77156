"""A run's checkpoints: resume takes the newest one that verifies (sizes and checksums
taken at save time) and names what is wrong with the newer ones; the best evaluation
(checkpoints/best.json): higher wins, the first of equals stays, a resumed run keeps
only the steps it kept."""

from __future__ import annotations

import json

import pytest

from rlray.core.checkpoints import (
    LATEST,
    STATE,
    CheckpointSearch,
    checkpoint_problem,
    find_checkpoint,
    latest_checkpoint,
    publish_checkpoint,
    staging_directory,
)
from rlray.driver.evaluation import BestCheckpoint


def test_best_is_the_highest_value_and_the_first_of_equals(tmp_path):
    best = BestCheckpoint(tmp_path, "reward/pass@2", before_step=1)
    history = [(0, 0.25, None), (2, 0.5, "ck-2"), (4, 0.5, "ck-4"), (6, 0.375, "ck-6")]
    kept = []
    for step, value, checkpoint in history:
        if best.improves({"reward/pass@2": value, "reward/mean": 1.0}):
            best.record(step, value, 0.1, checkpoint, "base-model")
            kept.append(step)
    assert kept == [0, 2]
    written = json.loads((tmp_path / "checkpoints" / "best.json").read_text())
    assert written == {
        "metric": "reward/pass@2",
        "step": 2,
        "value": 0.5,
        "stderr": 0.1,
        "checkpoint": "ck-2",
        "model": "base-model",
    }
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))


def test_a_resumed_run_keeps_the_best_of_the_steps_it_kept(tmp_path):
    first = BestCheckpoint(tmp_path, "reward/mean", before_step=1)
    first.record(4, 0.75, 0.1, "ck-4", "base")
    # resumed from step 5: step 4's best stands, and 0.5 does not beat it
    resumed = BestCheckpoint(tmp_path, "reward/mean", before_step=6)
    assert resumed.best["step"] == 4 and not resumed.improves({"reward/mean": 0.5})
    # resumed from step 3: step 4 is done again, its record is dropped
    earlier = BestCheckpoint(tmp_path, "reward/mean", before_step=4)
    assert earlier.best is None and earlier.improves({"reward/mean": 0.0})
    # another metric starts afresh
    assert BestCheckpoint(tmp_path, "reward/pass@1", before_step=6).best is None


def test_no_metric_keeps_no_best(tmp_path):
    best = BestCheckpoint(tmp_path, "", before_step=1)
    assert not best.improves({"reward/mean": 1.0})


def saved_checkpoint(run_dir, version: int):
    """Returns a checkpoint published as the learner publishes one: a policy's weights,
    trainer state and an optimizer shard written into staging, then state.json."""
    staging = staging_directory(run_dir, version)
    (staging / "policy").mkdir()
    (staging / "policy" / "model.safetensors").write_bytes(bytes(range(256)) * (version + 1))
    (staging / "trainer_state.pt").write_bytes(b"rng state %d" % version)
    (staging / "optimizer").mkdir()
    (staging / "optimizer" / "__0_0.distcp").write_bytes(b"adam" * 100)
    return publish_checkpoint(staging, {"version": version, "prompt_cursor": 8 * version})


def test_resume_takes_the_newest_checkpoint_that_verifies_and_names_the_bad_files(tmp_path):
    for version in (1, 2, 3, 4):
        saved_checkpoint(tmp_path, version)
    root = tmp_path / "checkpoints"
    assert find_checkpoint(tmp_path) == CheckpointSearch(root / "step-000004", [])
    weights = root / "step-000004" / "policy" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    (root / "step-000003" / "trainer_state.pt").unlink()
    (root / "step-000002" / STATE).unlink()
    search = find_checkpoint(tmp_path)
    assert search.checkpoint == root / "step-000001"
    assert search.skipped == [
        f"step-000004: {weights} has 100 bytes, 1280 when saved (truncated?)",
        f"step-000003: {root / 'step-000003' / 'trainer_state.pt'} is missing",
        f"step-000002: {root / 'step-000002' / STATE} is missing",
    ]
    assert latest_checkpoint(tmp_path) == root / "step-000001"
    assert (root / LATEST).read_text() == "step-000004"  # the pointer alone is not trusted


def test_a_changed_byte_of_the_same_size_fails_the_checksum(tmp_path):
    checkpoint = saved_checkpoint(tmp_path, 1)
    shard = checkpoint / "optimizer" / "__0_0.distcp"
    shard.write_bytes(b"adaM" + shard.read_bytes()[4:])
    assert checkpoint_problem(checkpoint) == (
        f"{shard} does not match the checksum taken when it was saved"
    )
    assert checkpoint_problem(saved_checkpoint(tmp_path, 2)) is None
    (checkpoint / STATE).write_text('{"version": ')
    assert checkpoint_problem(checkpoint) == (
        f"{checkpoint / STATE} does not read as a checkpoint's state (JSONDecodeError)"
    )


def test_resume_is_refused_before_any_actor_when_no_checkpoint_verifies(tmp_path):
    from rlray.config import ConfigError
    from rlray.driver.plan import resume_checkpoint

    with pytest.raises(ConfigError, match=r"^--resume: no complete checkpoint under \S+$"):
        resume_checkpoint(tmp_path)
    weights = saved_checkpoint(tmp_path, 1) / "policy" / "model.safetensors"
    weights.unlink()
    with pytest.raises(ConfigError) as raised:
        resume_checkpoint(tmp_path)
    assert str(raised.value) == (
        f"--resume: no complete checkpoint under {tmp_path}/checkpoints: "
        f"step-000001: {weights} is missing"
    )
