"""report.png is drawn from metrics.jsonl: the right size, not blank, and no crash on gaps,
a one-step run or a resumed run's repeated steps."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from rlray.observe.report import (
    _title,
    held_out_series,
    policy_curves,
    read_metrics,
    rolling_mean,
    series,
    write_report,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def step_record(step: int) -> dict:
    record = {
        "step": step,
        "policy_version": step,
        "episodes": 64,
        "reward_mean": 0.3 + 0.01 * step,
        "kl": 0.001 * step,
        # Sometimes missing, as on steps without a fresh rollout measurement.
        "rollout_tokens_per_s": None if step % 4 == 0 else 1500.0 + step,
        "learner_tokens_per_s": 900.0,
        "explained_variance": None,
        "logprob_parity_error": None,
        "reward_components": {"exact_match": 0.5},
        "reward_failures": {"exact_match": 0},
    }
    if step % 10 == 0:
        record["eval_accuracy"] = 0.345 + 0.01 * step
    return record


def write_run(run_dir: Path, steps: int) -> None:
    records = [{"step": 0, "policy_version": 0, "eval_accuracy": 0.345}]
    records += [step_record(step) for step in range(1, steps + 1)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def assert_readable_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_MAGIC
    pixels = imread(path)
    assert pixels.shape == (800, 1200, 4)  # 12 x 8 inches at 100 dpi, RGBA
    assert pixels[..., :3].var() > 0  # something was drawn


def test_report_of_a_run_is_a_1200x800_png(tmp_path):
    write_run(tmp_path, steps=30)
    (tmp_path / "summary.json").write_text(
        json.dumps({"initial_eval_accuracy": 0.345, "final_eval_accuracy": 0.645})
    )
    path = write_report(tmp_path)
    assert path == tmp_path / "report.png"
    assert_readable_png(path)


def test_report_of_a_one_step_run_without_summary(tmp_path):
    write_run(tmp_path, steps=1)
    assert_readable_png(write_report(tmp_path))


def test_report_with_no_learner_steps_yet(tmp_path):
    write_run(tmp_path, steps=0)
    assert_readable_png(write_report(tmp_path))


def test_series_skips_none_and_nan(tmp_path):
    records = [{"step": 1, "kl": 0.5}, {"step": 2, "kl": None}, {"step": 3, "kl": math.nan}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    steps, kl = series(read_metrics(tmp_path), "kl")
    assert steps.tolist() == [1.0] and kl.tolist() == [0.5]


def test_resumed_run_repeated_steps_keep_the_later_line(tmp_path):
    records = [{"step": 1, "kl": 0.1}, {"step": 2, "kl": 0.2}, {"step": 2, "kl": 0.3}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert series(read_metrics(tmp_path), "kl")[1].tolist() == [0.1, 0.3]


def test_rolling_mean_averages_the_trailing_window():
    means = rolling_mean(np.array([1.0, 3.0, 5.0, 7.0]), window=2)
    assert means.tolist() == pytest.approx([1.0, 2.0, 4.0, 6.0])


def test_the_policy_panel_shows_the_kl_or_else_what_every_run_logs():
    with_kl = {1: {"kl": 0.5, "entropy": 0.9}, 2: {"kl": 0.4, "entropy": 0.8}}
    title, _, curves = policy_curves(with_kl)
    assert title == "KL to the reference model" and curves["KL"][1].tolist() == [0.5, 0.4]
    # The default job holds no reference (kl_coef 0): its KL is null on every step.
    without = {
        1: {"kl": None, "entropy": 0.9, "rollout_logprob_diff_mean": 1e-6},
        2: {"kl": None, "entropy": 0.7, "rollout_logprob_diff_mean": 2e-6},
    }
    title, ylabel, curves = policy_curves(without)
    assert (title, ylabel) == ("Policy entropy and rollout gap", "nats per token")
    assert curves["entropy"][1].tolist() == [0.9, 0.7]
    assert curves["|vLLM - learner| logprob"][1].tolist() == [1e-6, 2e-6]


def test_held_out_panel_shows_the_eval_metric_where_there_is_no_exact_match(tmp_path):
    # A chat model on a task library: no exact match, the eval rewards' metrics instead.
    records = [
        {"step": 0, "eval_accuracy": None, "eval": {"reward/greedy_accuracy": 0.25, "x/mean": 1}},
        {"step": 1, "reward_mean": 0.1},
        {"step": 2, "eval_accuracy": None, "eval": {"reward/greedy_accuracy": 0.5, "x/mean": 1}},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    name, steps, values = held_out_series(read_metrics(tmp_path))
    assert (name, steps.tolist(), values.tolist()) == (
        "reward/greedy_accuracy",
        [0, 2],
        [0.25, 0.5],
    )
    (tmp_path / "summary.json").write_text(json.dumps({"initial_eval_accuracy": None}))
    title = _title(tmp_path, read_metrics(tmp_path))
    assert title.endswith("held-out reward/greedy_accuracy 0.250 -> 0.500")
    assert_readable_png(write_report(tmp_path))
    # With exact match, exact match.
    write_run(tmp_path, steps=20)
    assert held_out_series(read_metrics(tmp_path))[0] == "accuracy"
