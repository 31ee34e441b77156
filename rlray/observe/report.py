"""The end-of-run report: report.png, four panels drawn from metrics.jsonl and summary.json.

Reward, held-out accuracy, how the policy moves (KL to the reference, else entropy and
the rollout/learner logprob gap) and throughput against the learner step, one look to
tell whether a run learned. Drawn with matplotlib's Agg canvas on a bare `Figure` (no pyplot),
so it needs no display and leaves any other plotting in the process alone.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

MARKER_MAX_POINTS = 60
"""Up to this many points a curve gets markers: a run of one step is then still a dot."""

LABELLED_EVALS_MAX = 12
"""Up to this many evaluations each is labelled with its accuracy; beyond, first and last."""


def read_metrics(run_dir: Path) -> dict[int, dict[str, Any]]:
    """Returns metrics.jsonl's records by step, in step order.

    A resumed run appends the steps after its checkpoint again; the later line wins.
    """
    by_step: dict[int, dict[str, Any]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            by_step.setdefault(int(record["step"]), {}).update(record)
    return dict(sorted(by_step.items()))


def series(records: dict[int, dict[str, Any]], field: str) -> tuple[np.ndarray, np.ndarray]:
    """Returns (steps, values) of the steps where `field` is a finite number."""
    points = [(step, r.get(field)) for step, r in records.items() if _finite(r.get(field))]
    steps = np.array([step for step, _ in points], dtype=float)
    return steps, np.array([value for _, value in points], dtype=float)


def held_out_series(records: dict[int, dict[str, Any]]) -> tuple[str, np.ndarray, np.ndarray]:
    """Returns (name, steps, values) of the held-out measure: exact-match accuracy where
    the run has it (text prompts with answers), else its first evaluation metric (e.g.
    reward/greedy_accuracy: chat replies, scored by the eval rewards)."""
    steps, values = series(records, "eval_accuracy")
    if len(values):
        return "accuracy", steps, values
    first = next((r["eval"] for r in records.values() if r.get("eval")), {})
    if not first:
        return "accuracy", steps, values
    name = next(iter(first))
    flat = {step: {name: (r.get("eval") or {}).get(name)} for step, r in records.items()}
    return name, *series(flat, name)


def _finite(value: Any) -> bool:
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    return is_number and math.isfinite(value)


def rolling_mean(values: np.ndarray, window: int) -> np.ndarray:
    """Returns the mean of each value and the up to `window - 1` values before it."""
    sums = np.cumsum(np.concatenate([[0.0], values]))
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(ends - window, 0)
    return (sums[ends] - sums[starts]) / (ends - starts)


def write_report(run_dir: Path) -> Path:
    """Returns the path of the report.png it writes into `run_dir`."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    figure = Figure(figsize=(12, 8), dpi=100, layout="constrained")
    # One x axis for all four: a jump in KL lines up with the reward at the same step.
    (reward, accuracy), (policy, throughput) = figure.subplots(2, 2, sharex=True)
    _plot_reward(reward, records)
    _plot_accuracy(accuracy, records)
    _plot_policy(policy, records)
    _plot_throughput(throughput, records)
    figure.suptitle(_title(run_dir, records), fontsize=14)
    path = run_dir / "report.png"
    figure.savefig(path)
    return path


def _plot_reward(axes: Axes, records: dict[int, dict[str, Any]]) -> None:
    steps, rewards = series(records, "reward_mean")
    _line(axes, steps, rewards, "per step", alpha=0.5)
    if len(rewards) > 1:
        window = max(2, min(20, len(rewards) // 5))
        _line(axes, steps, rolling_mean(rewards, window), f"rolling mean ({window} steps)")
    _decorate(axes, "Reward (mean over the batch)", "reward", has_data=len(rewards) > 0)


def _plot_accuracy(axes: Axes, records: dict[int, dict[str, Any]]) -> None:
    name, steps, accuracy = held_out_series(records)
    # Markers always: evaluations are a few points, each of which counts.
    axes.plot(steps, accuracy, marker="o", markersize=6)
    labelled = range(len(accuracy)) if len(accuracy) <= LABELLED_EVALS_MAX else [0, -1]
    for i in labelled:
        axes.annotate(
            f"{accuracy[i]:.3f}",
            (steps[i], accuracy[i]),
            textcoords="offset points",
            xytext=(0, 7),
            ha="center",
        )
    axes.set_ylim(0, 1.08)  # the whole range, and room for the label of a 1.0
    title = "Held-out accuracy" if name == "accuracy" else f"Held-out {name}"
    _decorate(axes, title, name, has_data=len(accuracy) > 0, legend=False)


Curves = dict[str, tuple[np.ndarray, np.ndarray]]


def policy_curves(records: dict[int, dict[str, Any]]) -> tuple[str, str, Curves]:
    """Returns (title, y label, {label: (steps, values)}) of the panel on how the policy
    moves: its KL to the reference where the run holds one (algorithm.kl_coef > 0); else
    its entropy, and the mean gap between vLLM's logprobs and the learner's (staleness
    and the rollout correction's work), which every run logs."""
    steps, kl = series(records, "kl")
    if len(kl):
        return "KL to the reference model", "KL", {"KL": (steps, kl)}
    curves = {
        "entropy": series(records, "entropy"),
        "|vLLM - learner| logprob": series(records, "rollout_logprob_diff_mean"),
    }
    return "Policy entropy and rollout gap", "nats per token", curves


def _plot_policy(axes: Axes, records: dict[int, dict[str, Any]]) -> None:
    title, ylabel, curves = policy_curves(records)
    drawn = {label: curve for label, curve in curves.items() if len(curve[1])}
    for label, (steps, values) in drawn.items():
        _line(axes, steps, values, label)
    _decorate(axes, title, ylabel, has_data=bool(drawn), legend=len(curves) > 1)


def _plot_throughput(axes: Axes, records: dict[int, dict[str, Any]]) -> None:
    drawn = []
    for field, label in [
        ("rollout_tokens_per_s", "rollout (generation)"),
        ("learner_tokens_per_s", "learner (update)"),
    ]:
        steps, rate = series(records, field)
        if len(rate):
            _line(axes, steps, rate, label)
            drawn.append(rate.max())
    # From zero, so that a drop reads as its true share; headroom above for the legend.
    axes.set_ylim(0, max(drawn, default=0.0) * 1.25 or 1.0)
    _decorate(axes, "Throughput", "tokens / s", has_data=bool(drawn))


def _line(axes: Axes, steps: np.ndarray, values: np.ndarray, label: str, **style: Any) -> None:
    marker = "o" if len(values) <= MARKER_MAX_POINTS else None
    axes.plot(steps, values, label=label, marker=marker, markersize=3, **style)


def _decorate(axes: Axes, title: str, ylabel: str, has_data: bool, legend: bool = True) -> None:
    axes.set_title(title)
    if axes.get_subplotspec().is_last_row():  # the top row shares the bottom row's x axis
        axes.set_xlabel("learner step")
    axes.set_ylabel(ylabel)
    axes.grid(True, alpha=0.3)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    if not has_data:
        axes.text(0.5, 0.5, "no data", transform=axes.transAxes, ha="center", color="gray")
    elif legend:
        axes.legend(loc="best")


def _title(run_dir: Path, records: dict[int, dict[str, Any]]) -> str:
    """Returns the run id and the held-out accuracy at start and end."""
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    run_id = Path(summary.get("run_dir") or run_dir).name
    name, _, evals = held_out_series(records)
    initial = summary.get("initial_eval_accuracy") if name == "accuracy" else None
    final = summary.get("final_eval_accuracy") if name == "accuracy" else None
    initial = initial if _finite(initial) else (evals[0] if len(evals) else None)
    final = final if _finite(final) else (evals[-1] if len(evals) else None)
    if not (_finite(initial) and _finite(final)):
        return run_id
    return f"{run_id}    held-out {name} {initial:.3f} -> {final:.3f}"
