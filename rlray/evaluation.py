"""Held-out evaluation as pure functions: pass@k, mean@k, a model's summary, a paired
comparison of models on the same prompts, and the best checkpoint by a metric.

Nothing here generates or scores: it takes per-completion scores (the weighted total
reward and each component's score, as a RewardWorker sets them on an Episode) and plain
numbers, so every figure is tested against hand-computed values (tests/test_evaluation.py).

The prompt is the unit that is sampled. The completions of one prompt are correlated
(an easy prompt is easy for all of them), so every mean is first taken per prompt and
every standard error is over prompts; a per-completion standard error would be too small.

A completion passes when its score is at least `pass_threshold` (default 1.0: a
verifiable reward gives 1.0 for a right answer). The same threshold applies to every
component and to the total; with a non-binary reward pick the score that counts as solved.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from rlray.episode import Episode

PASS_THRESHOLD = 1.0
"""Default score at or above which a completion counts as a pass."""

REWARD = "reward"
"""The name the weighted total reward goes by in metric names (e.g. reward/pass@4)."""

K = TypeVar("K")

# ---------------------------------------------------------------- per-prompt estimators


def pass_at_k(n: int, c: int, k: int) -> float:
    """Returns the unbiased estimate of pass@k for one prompt with `c` passing completions
    out of `n`: the chance that k of them, drawn without replacement, hold a pass.

    pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n-c+1}^{n} (1 - k / i), the
    product form avoiding huge binomials. (Chen et al. 2021, Evaluating Large Language
    Models Trained on Code, https://arxiv.org/abs/2107.03374, sec. 2.1 and fig. 3.)
    """
    if n < 1:
        raise ValueError(f"pass@k needs n >= 1 completions, got n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n passing completions, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:  # every k-subset holds a pass
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def mean_pass_at_k(
    scores: Sequence[Sequence[float]], k: int, pass_threshold: float = PASS_THRESHOLD
) -> float:
    """Returns pass@k averaged over prompts; `scores[p]` are prompt p's sampled scores."""
    return statistics.fmean(
        pass_at_k(len(s), count_passes(s, pass_threshold), k) for s in _nonempty(scores)
    )


def mean_at_k(scores: Sequence[Sequence[float]], k: int) -> float:
    """Returns mean@k: the mean score of k completions of a prompt, averaged over prompts.

    With n >= k completions the unbiased estimate (the average over all k-subsets) is
    by linearity the mean of all n, so mean@k does not depend on k; k is checked
    (k <= n for every prompt) so that it says how many completions stand behind it.
    """
    for s in _nonempty(scores):
        if not 1 <= k <= len(s):
            raise ValueError(f"mean@k needs 1 <= k <= n, got k={k}, n={len(s)}")
    return statistics.fmean(statistics.fmean(s) for s in scores)


def count_passes(scores: Sequence[float], pass_threshold: float = PASS_THRESHOLD) -> int:
    """Returns how many scores are at least `pass_threshold`."""
    return sum(score >= pass_threshold for score in scores)


def standard_error(values: Sequence[float]) -> float:
    """Returns the standard error of the mean of `values`: sample std (n - 1) / sqrt(n)."""
    if len(values) < 2:
        raise ValueError(f"a standard error needs at least 2 values, got {len(values)}")
    return statistics.stdev(values) / math.sqrt(len(values))


def _nonempty(scores: Sequence[Sequence[float]]) -> Sequence[Sequence[float]]:
    if not scores or any(len(s) == 0 for s in scores):
        raise ValueError("need at least one prompt, each with at least one score")
    return scores


# ---------------------------------------------------------------- one model's summary


@dataclass(frozen=True)
class EvalSample:
    """One scored completion of a held-out prompt."""

    prompt_id: str | int
    """Which prompt it answers; the same id names the same prompt in every model's eval."""
    reward: float | None
    """The weighted total reward (Episode.reward); None where a reward failed on it."""
    components: Mapping[str, float | None] = field(default_factory=dict)
    """Each reward component's score by name (Episode.reward_components; None where it
    failed); every sample names the same components."""
    greedy: bool = False
    """True for the prompt's one greedy (temperature 0) completion, False for a sample."""


@dataclass
class EvalEpisodes:
    """The held-out episodes of one evaluation, generated by a rollout worker for a
    reward worker to score (rlray.rollout.RolloutWorker.eval_episodes)."""

    greedy: list[Episode]
    """One greedy (temperature 0) episode per prompt."""
    sampled: list[Episode]
    """eval.samples sampled episodes per prompt."""


@dataclass(frozen=True)
class Metric:
    """One metric of one model: its mean over prompts and the per-prompt values behind it."""

    value: float
    """Mean over prompts of the per-prompt values."""
    stderr: float
    """Standard error of `value` over prompts (sample std / sqrt(prompts))."""
    per_prompt: tuple[float, ...]
    """The value for each prompt, in the order of EvalSummary.prompt_ids; paired
    comparisons take differences of these."""
    higher_is_better: bool = True
    """Which way is better, for choosing the best checkpoint (True for every reward)."""


@dataclass(frozen=True)
class EvalSummary:
    """A model's (or checkpoint's) evaluation on held-out prompts.

    Metrics, for each score name s (REWARD for the weighted total, then each component):
    `s/mean` the mean score of the sampled completions (= mean@k for every k <= n),
    `s/pass@k` for each k asked, and `s/greedy_accuracy` the fraction of prompts whose
    greedy completion passes, when greedy completions were given.
    """

    model: str
    """The model or checkpoint evaluated, as the comparison names it."""
    prompt_ids: tuple[str | int, ...]
    """The prompts, in order of first appearance."""
    samples_per_prompt: int
    """Sampled (non-greedy) completions per prompt: n of pass@k."""
    pass_threshold: float
    """Score at or above which a completion passed."""
    metrics: dict[str, Metric]
    """Metrics by name (see the class docstring)."""


def summarize(
    model: str,
    samples: Sequence[EvalSample],
    ks: Sequence[int] = (1,),
    pass_threshold: float = PASS_THRESHOLD,
) -> EvalSummary:
    """Returns the summary of one model's scored completions (see EvalSummary).

    Every prompt needs the same number n of sampled completions (n >= every k) and
    either one greedy completion or none, like every other prompt; at least 2 prompts
    (for a standard error). A greedy-only evaluation (n = 0) passes ks=() and gets only
    the greedy metrics. Raises ValueError naming what is off.
    """
    prompts = _by_prompt(samples)
    names = _score_names(samples)
    n = _samples_per_prompt(prompts, ks)
    greedy = _greedy_given(prompts)
    metrics: dict[str, Metric] = {}
    for name in names:
        scores = [[_score(s, name) for s in sampled] for sampled, _ in prompts.values()]
        if n:
            metrics[f"{name}/mean"] = _metric([statistics.fmean(x) for x in scores])
        for k in ks:
            passes = [pass_at_k(n, count_passes(x, pass_threshold), k) for x in scores]
            metrics[f"{name}/pass@{k}"] = _metric(passes)
        if greedy:
            solved = [float(_score(g[0], name) >= pass_threshold) for _, g in prompts.values()]
            metrics[f"{name}/greedy_accuracy"] = _metric(solved)
    return EvalSummary(model, tuple(prompts), n, pass_threshold, metrics)


def metric_names(components: Sequence[str], samples: int, ks: Sequence[int]) -> list[str]:
    """Returns the names summarize gives its metrics, in its order, for these reward
    components, `samples` sampled completions per prompt besides the greedy one, and the
    k of pass@k (unused without samples): what a config may name before any evaluation."""
    names = []
    for name in [REWARD, *components]:
        if samples:
            names += [f"{name}/mean", *(f"{name}/pass@{k}" for k in ks)]
        names.append(f"{name}/greedy_accuracy")
    return names


def fully_scored(samples: Sequence[EvalSample]) -> tuple[list[EvalSample], list[str | int]]:
    """Returns (the samples of prompts whose every completion has a total reward and every
    component's score, the ids of the other prompts).

    A completion a reward failed on has no score. Counting it as 0 would bias the
    evaluation and leaving it out would compare prompts on different completions, so its
    prompt is left out and named: a comparison of models leaves out the same prompts."""
    failed = {
        s.prompt_id
        for s in samples
        if not all(_finite(v) for v in (s.reward, *s.components.values()))
    }
    kept = [s for s in samples if s.prompt_id not in failed]
    return kept, [p for p in dict.fromkeys(s.prompt_id for s in samples) if p in failed]


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def _metric(per_prompt: list[float]) -> Metric:
    return Metric(statistics.fmean(per_prompt), standard_error(per_prompt), tuple(per_prompt))


def _score(sample: EvalSample, name: str) -> float:
    return sample.reward if name == REWARD else sample.components[name]


def _by_prompt(
    samples: Sequence[EvalSample],
) -> dict[str | int, tuple[list[EvalSample], list[EvalSample]]]:
    """Returns (sampled, greedy) completions by prompt id, in order of first appearance."""
    prompts: dict[str | int, tuple[list[EvalSample], list[EvalSample]]] = {}
    for s in samples:
        sampled, greedy = prompts.setdefault(s.prompt_id, ([], []))
        (greedy if s.greedy else sampled).append(s)
    if len(prompts) < 2:
        raise ValueError(f"an evaluation needs at least 2 prompts, got {len(prompts)}")
    return prompts


def _score_names(samples: Sequence[EvalSample]) -> list[str]:
    components = list(samples[0].components)
    if REWARD in components:
        raise ValueError(f"a reward component may not be named {REWARD!r}: the total is")
    for s in samples:
        if list(s.components) != components:
            raise ValueError(
                f"prompt {s.prompt_id!r}: components {sorted(s.components)}, "
                f"expected {sorted(components)} as in the first sample"
            )
        for name, score in [(REWARD, s.reward), *s.components.items()]:
            if score is None or not math.isfinite(score):
                raise ValueError(
                    f"prompt {s.prompt_id!r}: {name} is {score}; an evaluation needs every "
                    "completion scored (a failure counted as 0 or left out would bias it)"
                )
    return [REWARD, *components]


def _samples_per_prompt(prompts: Mapping, ks: Sequence[int]) -> int:
    counts = {prompt_id: len(sampled) for prompt_id, (sampled, _) in prompts.items()}
    n = next(iter(counts.values()))
    for prompt_id, count in counts.items():
        if count != n:
            raise ValueError(
                f"prompt {prompt_id!r} has {count} sampled completions, "
                f"the first prompt has {n}: every prompt needs the same number"
            )
    for k in ks:
        if not 1 <= k <= n:
            raise ValueError(f"pass@k needs 1 <= k <= n, got k={k} with n={n} samples per prompt")
    return n


def _greedy_given(prompts: Mapping) -> bool:
    counts = {prompt_id: len(greedy) for prompt_id, (_, greedy) in prompts.items()}
    if set(counts.values()) not in ({0}, {1}):
        raise ValueError(
            f"greedy completions per prompt {counts}: every prompt needs one, or none does"
        )
    return next(iter(counts.values())) == 1


# ---------------------------------------------------------------- comparing models


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
        name: Metric(m.value, m.stderr, tuple(m.per_prompt[i] for i in order), m.higher_is_better)
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


# ---------------------------------------------------------------- the best checkpoint


def best_checkpoint(evaluations: Mapping[K, EvalSummary], metric: str) -> K:
    """Returns the key (e.g. the learner step) of the evaluation best by `metric`,
    higher or lower as the metric's higher_is_better says; the first of equals."""
    if not evaluations:
        raise ValueError(f"no evaluations to choose the best {metric!r} from")
    for key, summary in evaluations.items():
        if metric not in summary.metrics:
            raise ValueError(
                f"evaluation {key!r} has no metric {metric!r}; it has {sorted(summary.metrics)}"
            )
    first = next(iter(evaluations.values())).metrics[metric]
    sign = 1.0 if first.higher_is_better else -1.0
    return max(evaluations, key=lambda key: sign * evaluations[key].metrics[metric].value)
