"""Comparisons of evaluated models (jobs/eval.py): values, differences and their paired
standard errors, as JSON and Markdown.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rlray.core.evaluation import EvalSummary, Metric, standard_error


@dataclass(frozen=True)
class ComparedMetric:
    """One metric across models; tuples hold one entry per model, baseline first."""

    name: str
    """The metric, as in EvalSummary.metrics."""
    values: tuple[float, ...]
    """Each model's mean over prompts."""
    stderrs: tuple[float, ...]
    """Each model's standard error over prompts."""
    differences: tuple[float, ...]
    """Each model's value minus the baseline's (0 for the baseline)."""
    difference_stderrs: tuple[float, ...]
    """Paired standard error of each difference: of the per-prompt differences."""


@dataclass(frozen=True)
class Comparison:
    """Several models evaluated on the same prompts, the first as the baseline."""

    models: tuple[str, ...]
    """The models, baseline first."""
    prompts: int
    """How many prompts every model was scored on."""
    metrics: tuple[ComparedMetric, ...]
    """Every metric, in the baseline summary's order."""


def compare(summaries: Sequence[EvalSummary]) -> Comparison:
    """Returns the comparison of `summaries` with the first (the baseline).

    The comparison is paired: every model scored the same held-out prompts, so a
    difference's standard error is that of the per-prompt differences,
    std_p(m_p - b_p) / sqrt(prompts). It is smaller than the unpaired
    sqrt(se_m^2 + se_b^2) because how hard a prompt is cancels out. Raises ValueError
    if the models' prompts, metrics or names differ.
    """
    if not summaries:
        raise ValueError("nothing to compare: no summaries")
    names = [s.model for s in summaries]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"{names.count(name)} summaries are named {name!r}; name each once")
    baseline = summaries[0]
    aligned = [_aligned_to(baseline, s) for s in summaries]
    rows = []
    for name in baseline.metrics:
        metrics = [model_metrics[name] for model_metrics in aligned]
        base = metrics[0].per_prompt
        deltas = [[m - b for m, b in zip(x.per_prompt, base, strict=True)] for x in metrics]
        rows.append(
            ComparedMetric(
                name,
                tuple(x.value for x in metrics),
                tuple(x.stderr for x in metrics),
                tuple(statistics.fmean(d) for d in deltas),
                tuple(standard_error(d) for d in deltas),
            )
        )
    return Comparison(tuple(s.model for s in summaries), len(baseline.prompt_ids), tuple(rows))


def _aligned_to(baseline: EvalSummary, summary: EvalSummary) -> dict[str, Metric]:
    """Returns `summary`'s metrics with per-prompt values in the baseline's prompt order."""
    missing = set(baseline.prompt_ids) ^ set(summary.prompt_ids)
    if missing:
        shown = sorted(map(repr, missing))[:5]
        raise ValueError(
            f"{summary.model!r} and {baseline.model!r} were not scored on the same prompts; "
            f"{len(missing)} are in one only, e.g. {', '.join(shown)}"
        )
    if list(summary.metrics) != list(baseline.metrics):
        raise ValueError(
            f"{summary.model!r} has metrics {list(summary.metrics)}, "
            f"{baseline.model!r} has {list(baseline.metrics)}"
        )
    position = {prompt_id: i for i, prompt_id in enumerate(summary.prompt_ids)}
    order = [position[prompt_id] for prompt_id in baseline.prompt_ids]
    return {
        name: Metric(m.value, m.stderr, tuple(m.per_prompt[i] for i in order))
        for name, m in summary.metrics.items()
    }


def comparison_json(comparison: Comparison) -> str:
    """Returns the comparison as JSON text: for each metric, each model's value, stderr,
    difference to the baseline and its paired stderr."""
    metrics = {
        row.name: {
            model: {
                "value": row.values[i],
                "stderr": row.stderrs[i],
                "difference": row.differences[i],
                "difference_stderr": row.difference_stderrs[i],
            }
            for i, model in enumerate(comparison.models)
        }
        for row in comparison.metrics
    }
    document = {
        "baseline": comparison.models[0],
        "models": list(comparison.models),
        "prompts": comparison.prompts,
        "metrics": metrics,
    }
    return json.dumps(document, indent=2) + "\n"


def comparison_markdown(comparison: Comparison) -> str:
    """Returns the comparison as a Markdown table: each model's value ± stderr and, for
    every model after the baseline, its difference Δ ± paired stderr."""
    base, *others = comparison.models
    header = ["metric", base]
    for model in others:
        header += [model, f"Δ {model}"]
    lines = [
        f"Mean ± standard error over {comparison.prompts} prompts; "
        f"Δ is the difference to {base}, ± its standard error paired over prompts.",
        "",
        "| " + " | ".join(header) + " |",
        "|---" + "|---:" * (len(header) - 1) + "|",
    ]
    for row in comparison.metrics:
        cells = [row.name, f"{row.values[0]:.3f} ± {row.stderrs[0]:.3f}"]
        for i in range(1, len(comparison.models)):
            cells.append(f"{row.values[i]:.3f} ± {row.stderrs[i]:.3f}")
            cells.append(f"{row.differences[i]:+.3f} ± {row.difference_stderrs[i]:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_comparison(comparison: Comparison, directory: str | Path) -> tuple[Path, Path]:
    """Writes comparison.json and comparison.md into `directory` (made if missing);
    returns their paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    json_path, markdown_path = directory / "comparison.json", directory / "comparison.md"
    json_path.write_text(comparison_json(comparison), encoding="utf-8")
    markdown_path.write_text(comparison_markdown(comparison), encoding="utf-8")
    return json_path, markdown_path
