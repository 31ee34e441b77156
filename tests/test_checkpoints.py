"""The best evaluation of a run (checkpoints/best.json): higher wins, the first of
equals stays, a resumed run keeps only the steps it kept."""

from __future__ import annotations

import json

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
