"""Evaluation math against values worked out by hand and its invariances: pass@k equals
the brute-force average over k-subsets, pass@1 is the pass rate, pass@k grows with k; a
model compared with itself differs by 0, swapping the baseline flips the signs, and the
paired standard error is that of the per-prompt differences."""

import itertools
import json
import math
import statistics
from pathlib import Path

import pytest

from rlray.core import evaluation as ev
from rlray.core.evaluation import EvalSample, EvalSummary, Metric
from rlray.driver.evaluation import BestCheckpoint
from rlray.observe import comparison as cmp

# ---------------------------------------------------------------- pass@k and mean@k


def test_pass_at_k_matches_hand_computed_values():
    # n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10 = 0.7
    assert ev.pass_at_k(5, 2, 2) == pytest.approx(0.7)
    # n=5, c=2, k=1: 1 - C(3,1)/C(5,1) = 1 - 3/5 = 0.4, the pass rate c/n
    assert ev.pass_at_k(5, 2, 1) == pytest.approx(0.4)
    # n=4, c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5
    assert ev.pass_at_k(4, 1, 2) == pytest.approx(0.5)
    # n=5, c=4, k=2: only 1 failure, so every pair holds a pass
    assert ev.pass_at_k(5, 4, 2) == 1.0
    assert ev.pass_at_k(5, 0, 3) == 0.0


def test_pass_at_k_is_stable_where_binomials_are_huge():
    # c=1: C(n-1, k)/C(n, k) = (n - k)/n, so k = n/2 gives 0.5; C(2000, 1000) ~ 1e600
    # overflows a float, the product form does not.
    assert ev.pass_at_k(2000, 1, 1000) == pytest.approx(0.5)
    assert ev.pass_at_k(2000, 1000, 1000) == pytest.approx(1.0)


def test_pass_at_k_equals_brute_force_average_over_all_k_subsets():
    for n in range(1, 7):
        for c in range(n + 1):
            passed = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(passed, k))
                brute = sum(any(s) for s in subsets) / len(subsets)
                assert ev.pass_at_k(n, c, k) == pytest.approx(brute), (n, c, k)
                exact = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert ev.pass_at_k(n, c, k) == pytest.approx(exact), (n, c, k)


def test_pass_at_1_is_the_mean_of_binary_scores():
    scores = [[1.0, 0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 0.0, 0.0]]
    # (3/5 + 1/5) / 2 = 0.4
    assert ev.mean_pass_at_k(scores, 1) == pytest.approx(0.4)
    assert ev.mean_pass_at_k(scores, 1) == pytest.approx(statistics.fmean(itertools.chain(*scores)))


def test_pass_at_k_grows_with_k_and_pass_at_n_is_one_if_any_passed():
    n = 8
    for c in range(n + 1):
        values = [ev.pass_at_k(n, c, k) for k in range(1, n + 1)]
        assert values == sorted(values), c
        assert values[-1] == (1.0 if c > 0 else 0.0)


def test_mean_pass_at_k_averages_prompts_and_counts_passes_by_threshold():
    # prompt 1: n=4, c=2, k=2 -> 1 - C(2,2)/C(4,2) = 1 - 1/6 = 5/6; prompt 2: c=0 -> 0
    assert ev.mean_pass_at_k([[1, 0, 0, 1], [0, 0, 0, 0]], 2) == pytest.approx(5 / 12)
    # a pass is a score >= the threshold: 0.9 and 1.0 pass at 0.9, nothing passes at 1.5
    assert ev.count_passes([0.5, 0.9, 1.0], pass_threshold=0.9) == 2
    assert ev.count_passes([0.5, 0.9, 1.0]) == 1
    assert ev.mean_pass_at_k([[0.5, 0.9, 1.0]], 1, pass_threshold=1.5) == 0.0


def test_mean_at_k_equals_brute_force_average_over_k_subsets():
    # prompt 1, pairs of [0, 1, 0.5]: 0.5, 0.25, 0.75 -> 0.5 (= mean of all three);
    # prompt 2: 1 -> mean@2 = (0.5 + 1) / 2 = 0.75
    scores = [[0.0, 1.0, 0.5], [1.0, 1.0, 1.0]]
    assert ev.mean_at_k(scores, 2) == pytest.approx(0.75)
    for k in (1, 2, 3):
        brute = statistics.fmean(
            statistics.fmean(statistics.fmean(s) for s in itertools.combinations(p, k))
            for p in scores
        )
        assert ev.mean_at_k(scores, k) == pytest.approx(brute)


@pytest.mark.parametrize(
    ("n", "c", "k", "message"),
    [
        (3, 1, 4, "k=4, n=3"),
        (3, 4, 1, "c=4, n=3"),
        (3, -1, 1, "c=-1, n=3"),
        (3, 1, 0, "k=0, n=3"),
        (0, 0, 1, "n=0"),
    ],
)
def test_pass_at_k_rejects_impossible_counts_naming_them(n, c, k, message):
    with pytest.raises(ValueError, match=message):
        ev.pass_at_k(n, c, k)


def test_mean_estimators_reject_k_beyond_samples_and_empty_prompts():
    with pytest.raises(ValueError, match="k=3, n=2"):
        ev.mean_at_k([[1.0, 0.0]], 3)
    with pytest.raises(ValueError, match="k=3, n=2"):
        ev.mean_pass_at_k([[1.0, 0.0, 1.0], [1.0, 0.0]], 3)
    with pytest.raises(ValueError, match="at least one prompt"):
        ev.mean_at_k([], 1)
    with pytest.raises(ValueError, match="at least one score"):
        ev.mean_pass_at_k([[1.0], []], 1)


# ---------------------------------------------------------------- one model's summary


def samples_of(rewards: dict[str, list[float]], greedy: dict[str, float] | None = None):
    """Returns EvalSamples with only a total reward: sampled ones, then greedy ones."""
    out = [EvalSample(p, r) for p, scores in rewards.items() for r in scores]
    return out + [EvalSample(p, r, greedy=True) for p, r in (greedy or {}).items()]


def two_component_samples() -> list[EvalSample]:
    # reward = correct + 0.5 * format
    # prompt a: correct [1, 0, 0, 1], format [1, 1, 0, 1] -> reward [1.5, 0.5, 0, 1.5];
    #           greedy correct 1, format 1 -> reward 1.5
    # prompt b: correct [0, 0, 0, 0], format [1, 1, 1, 1] -> reward [0.5] * 4;
    #           greedy correct 0, format 1 -> reward 0.5
    rows = [
        ("a", 1, 1, False),
        ("a", 0, 1, False),
        ("a", 0, 0, False),
        ("a", 1, 1, False),
        ("a", 1, 1, True),
        *[("b", 0, 1, False)] * 4,
        ("b", 0, 1, True),
    ]
    return [
        EvalSample(p, c + 0.5 * f, {"correct": float(c), "format": float(f)}, greedy=g)
        for p, c, f, g in rows
    ]


def test_summary_matches_hand_computed_metrics():
    summary = ev.summarize("base", two_component_samples(), ks=(1, 2))
    assert summary.prompt_ids == ("a", "b")
    assert summary.samples_per_prompt == 4
    assert list(summary.metrics) == [
        f"{score}/{kind}"
        for score in ("reward", "correct", "format")
        for kind in ("mean", "pass@1", "pass@2", "greedy_accuracy")
    ]
    # With 2 prompts, stderr = stdev([x, y]) / sqrt(2) = |x - y| / 2.
    expected = {
        # per prompt a, b                        mean    stderr
        "reward/mean": ((0.875, 0.5), 0.6875, 0.1875),  # a: 3.5 / 4
        "reward/pass@1": ((0.5, 0.0), 0.25, 0.25),  # a: two of 4 are >= 1.0
        "reward/pass@2": ((5 / 6, 0.0), 5 / 12, 5 / 12),  # a: 1 - C(2,2)/C(4,2)
        "reward/greedy_accuracy": ((1.0, 0.0), 0.5, 0.5),  # 1.5 passes, 0.5 does not
        "correct/mean": ((0.5, 0.0), 0.25, 0.25),
        "correct/pass@2": ((5 / 6, 0.0), 5 / 12, 5 / 12),
        "format/mean": ((0.75, 1.0), 0.875, 0.125),
        "format/pass@2": ((1.0, 1.0), 1.0, 0.0),  # a: one failure, every pair passes
        "format/greedy_accuracy": ((1.0, 1.0), 1.0, 0.0),
    }
    for name, (per_prompt, mean, stderr) in expected.items():
        metric = summary.metrics[name]
        assert metric.per_prompt == pytest.approx(per_prompt), name
        assert metric.value == pytest.approx(mean), name
        assert metric.stderr == pytest.approx(stderr), name


def test_summary_pass_threshold_decides_what_passes():
    # reward >= 0.5 passes: a passes 3 of 4 (pass@1 0.75), b all (1.0) -> 0.875
    summary = ev.summarize("base", two_component_samples(), ks=(1,), pass_threshold=0.5)
    assert summary.metrics["reward/pass@1"].value == pytest.approx(0.875)
    assert summary.metrics["reward/greedy_accuracy"].value == 1.0
    assert summary.pass_threshold == 0.5


def test_summary_without_greedy_completions_has_no_greedy_metric():
    summary = ev.summarize("base", samples_of({"a": [1.0, 0.0], "b": [0.0, 0.0]}))
    assert list(summary.metrics) == ["reward/mean", "reward/pass@1"]


def test_greedy_only_summary_is_greedy_accuracy_alone():
    # today's held-out evaluation: one greedy completion per prompt, exact match 1 or 0
    summary = ev.summarize("base", samples_of({}, greedy={"a": 1.0, "b": 0.0, "c": 1.0}), ks=())
    assert summary.samples_per_prompt == 0
    assert list(summary.metrics) == ["reward/greedy_accuracy"]
    assert summary.metrics["reward/greedy_accuracy"].value == pytest.approx(2 / 3)


@pytest.mark.parametrize(
    ("samples", "ks", "message"),
    [
        (samples_of({"a": [1.0, 0.0], "b": [1.0, 0.0]}), (3,), "k=3 with n=2"),
        (samples_of({"a": [1.0, 0.0], "b": [1.0]}), (1,), "prompt 'b' has 1 sampled"),
        (samples_of({"a": [1.0, 0.0]}), (1,), "at least 2 prompts, got 1"),
        (samples_of({"a": [1.0], "b": [1.0]}, greedy={"a": 1.0}), (1,), "one, or none"),
        (samples_of({"a": [1.0], "b": [math.nan]}), (1,), "prompt 'b': reward is nan"),
        (
            [EvalSample("a", 1.0, {"c": 1.0}), EvalSample("b", 1.0, {"c": None})],
            (1,),
            "prompt 'b': c is None",
        ),
        (
            [EvalSample("a", 1.0, {"c": 1.0}), EvalSample("b", 1.0, {"d": 1.0})],
            (1,),
            r"prompt 'b': components \['d'\], expected \['c'\]",
        ),
        ([EvalSample(p, 1.0, {"reward": 1.0}) for p in "ab"], (1,), "may not be named 'reward'"),
    ],
)
def test_summary_rejects_bad_samples_naming_the_problem(samples, ks, message):
    with pytest.raises(ValueError, match=message):
        ev.summarize("base", samples, ks=ks)


# ---------------------------------------------------------------- comparing models


def test_model_compared_with_itself_differs_by_zero_with_zero_stderr():
    samples = two_component_samples()
    comparison = cmp.compare([ev.summarize(m, samples, ks=(1, 2)) for m in ("base", "copy")])
    for row in comparison.metrics:
        assert row.differences == (0.0, 0.0)
        assert row.difference_stderrs == (0.0, 0.0)
        assert row.values[0] == row.values[1]


def three_prompts(base: bool) -> list[EvalSample]:
    # base:    a [0, 0], b [1, 0], c [1, 1] -> per-prompt means 0, 0.5, 1
    # trained: a [1, 0], b [1, 1], c [1, 1] -> per-prompt means 0.5, 1, 1
    if base:
        return samples_of({"a": [0.0, 0.0], "b": [1.0, 0.0], "c": [1.0, 1.0]})
    return samples_of({"a": [1.0, 0.0], "b": [1.0, 1.0], "c": [1.0, 1.0]})


def test_paired_stderr_matches_hand_computation():
    base = ev.summarize("base", three_prompts(base=True))
    trained = ev.summarize("trained", three_prompts(base=False))
    row = cmp.compare([base, trained]).metrics[0]
    assert row.name == "reward/mean"
    # differences d = [0.5, 0.5, 0], mean 1/3; deviations 1/6, 1/6, -1/3;
    # var = (1/36 + 1/36 + 4/36) / 2 = 1/12; se = sqrt(1/12) / sqrt(3) = 1/6
    assert row.differences == pytest.approx((0.0, 1 / 3))
    assert row.difference_stderrs == pytest.approx((0.0, 1 / 6))
    # base [0, 0.5, 1]: var 0.25, se 0.5/sqrt(3); trained [0.5, 1, 1]: var 1/12, se 1/6
    assert row.values == pytest.approx((0.5, 5 / 6))
    assert row.stderrs == pytest.approx((0.5 / math.sqrt(3), 1 / 6))
    # unpaired would be sqrt(1/12 + 1/36) = 0.333: pairing removes the prompts' difficulty
    assert row.difference_stderrs[1] < math.hypot(*row.stderrs)


def test_swapping_the_baseline_flips_the_signs():
    base = ev.summarize("base", three_prompts(base=True))
    trained = ev.summarize("trained", three_prompts(base=False))
    forward = cmp.compare([base, trained])
    backward = cmp.compare([trained, base])
    for f, b in zip(forward.metrics, backward.metrics, strict=True):
        assert b.differences[1] == pytest.approx(-f.differences[1])
        assert b.difference_stderrs[1] == pytest.approx(f.difference_stderrs[1])


def test_comparison_pairs_prompts_by_id_not_by_order():
    samples = two_component_samples()
    summary = ev.summarize("base", samples, ks=(1, 2))
    shuffled = ev.summarize("shuffled", list(reversed(samples)), ks=(1, 2))
    assert shuffled.prompt_ids == ("b", "a")
    for row in cmp.compare([summary, shuffled]).metrics:
        assert row.differences == (0.0, 0.0)
        assert row.difference_stderrs == (0.0, 0.0)


def tiny_comparison() -> cmp.Comparison:
    # base: a 0, b 1 -> 0.5 ± stdev([0, 1])/sqrt(2) = 0.5; trained: a 1, b 1 -> 1 ± 0;
    # differences [1, 0] -> +0.5 ± 0.5
    base = ev.summarize("base", samples_of({"a": [0.0], "b": [1.0]}))
    trained = ev.summarize("trained", samples_of({"a": [1.0], "b": [1.0]}))
    return cmp.compare([base, trained])


def test_markdown_table_exact_text():
    assert cmp.comparison_markdown(tiny_comparison()) == (
        "Mean ± standard error over 2 prompts; "
        "Δ is the difference to base, ± its standard error paired over prompts.\n"
        "\n"
        "| metric | base | trained | Δ trained |\n"
        "|---|---:|---:|---:|\n"
        "| reward/mean | 0.500 ± 0.500 | 1.000 ± 0.000 | +0.500 ± 0.500 |\n"
        "| reward/pass@1 | 0.500 ± 0.500 | 1.000 ± 0.000 | +0.500 ± 0.500 |\n"
    )


def test_markdown_has_a_value_and_a_difference_column_per_compared_model():
    base = ev.summarize("base", three_prompts(base=True))
    trained = ev.summarize("trained", three_prompts(base=False))
    worse = ev.summarize("worse", samples_of({"a": [0.0] * 2, "b": [0.0] * 2, "c": [0.0] * 2}))
    lines = cmp.comparison_markdown(cmp.compare([base, trained, worse])).splitlines()
    assert lines[2] == "| metric | base | trained | Δ trained | worse | Δ worse |"
    # worse - base: d = [0, -0.5, -1], mean -0.5, var 0.25, se 0.5/sqrt(3) = 0.289
    assert lines[4] == (
        "| reward/mean | 0.500 ± 0.289 | 0.833 ± 0.167 | +0.333 ± 0.167 "
        "| 0.000 ± 0.000 | -0.500 ± 0.289 |"
    )


def test_json_holds_every_value_and_difference():
    document = json.loads(cmp.comparison_json(tiny_comparison()))
    assert document["baseline"] == "base"
    assert document["models"] == ["base", "trained"]
    assert document["prompts"] == 2
    assert list(document["metrics"]) == ["reward/mean", "reward/pass@1"]
    assert document["metrics"]["reward/mean"] == {
        "base": {"value": 0.5, "stderr": 0.5, "difference": 0.0, "difference_stderr": 0.0},
        "trained": {"value": 1.0, "stderr": 0.0, "difference": 0.5, "difference_stderr": 0.5},
    }


def test_write_comparison_writes_json_and_markdown(tmp_path):
    comparison = tiny_comparison()
    json_path, markdown_path = cmp.write_comparison(comparison, tmp_path / "eval")
    assert json_path == tmp_path / "eval" / "comparison.json"
    assert json_path.read_text(encoding="utf-8") == cmp.comparison_json(comparison)
    assert markdown_path.read_text(encoding="utf-8") == cmp.comparison_markdown(comparison)


def test_compare_rejects_models_that_cannot_be_paired():
    base = ev.summarize("base", samples_of({"a": [1.0], "b": [0.0]}))
    other_prompts = ev.summarize("other", samples_of({"a": [1.0], "c": [0.0]}))
    with pytest.raises(ValueError, match="not scored on the same prompts; 2 are in one only"):
        cmp.compare([base, other_prompts])
    with pytest.raises(ValueError, match="2 summaries are named 'base'"):
        cmp.compare([base, base])
    more_ks = ev.summarize("more", samples_of({"a": [1.0, 0.0], "b": [0.0, 0.0]}), ks=(1, 2))
    with pytest.raises(ValueError, match="'more' has metrics"):
        cmp.compare([base, more_ks])
    with pytest.raises(ValueError, match="no summaries"):
        cmp.compare([])


# ---------------------------------------------------------------- the best checkpoint


def summary_with(name: str, value: float) -> EvalSummary:
    metric = Metric(value, 0.0, (value, value))
    return EvalSummary("model", ("a", "b"), 1, 1.0, {name: metric})


def best_step(run_dir: Path, evaluations: dict[int, EvalSummary], metric: str) -> int | None:
    """Returns the step a run's BestCheckpoint keeps after these evaluations, in order."""
    best = BestCheckpoint(run_dir, metric, before_step=0)
    for step, summary in evaluations.items():
        values = {name: m.value for name, m in summary.metrics.items()}
        if best.improves(values):
            best.record(step, values[metric], 0.0, None, "base")
    return best.best and best.best["step"]


def test_best_checkpoint_is_the_highest(tmp_path):
    steps = {0: 0.2, 100: 0.7, 200: 0.5}
    higher = {step: summary_with("reward/pass@1", v) for step, v in steps.items()}
    assert best_step(tmp_path, higher, "reward/pass@1") == 100


def test_best_checkpoint_takes_the_first_of_equals(tmp_path):
    evaluations = {step: summary_with("reward/mean", 0.5) for step in (0, 100, 200)}
    assert best_step(tmp_path, evaluations, "reward/mean") == 0


def test_best_checkpoint_of_real_summaries(tmp_path):
    evaluations = {
        0: ev.summarize("step 0", three_prompts(base=True)),
        100: ev.summarize("step 100", three_prompts(base=False)),
    }
    assert best_step(tmp_path, evaluations, "reward/pass@1") == 100


def test_best_checkpoint_passes_over_evaluations_without_its_metric(tmp_path):
    # The config's checks name an unknown metric before any actor starts; at run time an
    # evaluation lacks it only where its reward failed on every completion.
    assert best_step(tmp_path, {0: summary_with("reward/mean", 0.5)}, "reward/pass@8") is None
    assert best_step(tmp_path, {}, "reward/mean") is None


# ---------------------------------------------------------------- names and failed scores


def test_metric_names_are_the_names_a_summary_has():
    samples = [
        EvalSample(p, float(p == 0), {"exact_match": float(p == 0), "len": 0.5}, greedy=g)
        for p in (0, 1)
        for g in (True, False, False, False)
    ]
    summary = ev.summarize("m", samples, ks=(1, 3))
    names = ev.metric_names(["exact_match", "len"], samples=3, ks=(1, 3))
    assert names == list(summary.metrics)
    assert names[:4] == ["reward/mean", "reward/pass@1", "reward/pass@3", "reward/greedy_accuracy"]
    greedy_only = ev.summarize("m", [s for s in samples if s.greedy], ks=())
    assert ev.metric_names(["exact_match", "len"], samples=0, ks=(1,)) == list(greedy_only.metrics)


def test_fully_scored_leaves_out_every_completion_of_a_prompt_a_reward_failed_on():
    samples = [
        EvalSample(0, 1.0, {"a": 1.0}),
        EvalSample(0, 0.0, {"a": 0.0}, greedy=True),
        EvalSample(1, 1.0, {"a": None}),  # component failed
        EvalSample(1, 1.0, {"a": 1.0}, greedy=True),
        EvalSample(2, None, {"a": 1.0}),  # total dropped
        EvalSample(3, 1.0, {"a": math.nan}, greedy=True),
        EvalSample(4, 0.5, {"a": 0.5}),
    ]
    kept, left_out = ev.fully_scored(samples)
    assert left_out == [1, 2, 3]
    assert [s.prompt_id for s in kept] == [0, 0, 4]
    assert ev.fully_scored(kept) == (kept, [])


def test_a_reward_failing_on_every_held_out_completion_costs_its_metrics_not_the_run(caplog):
    from rlray.config import EvalConfig
    from rlray.core.stats import EvalResult
    from rlray.driver.evaluation import summarize_evaluation

    result = EvalResult(0.5, 0, [])
    samples = [
        EvalSample(p, float(p % 2), {"broken": None, "exact": float(p % 2)}, greedy=True)
        for p in range(4)
    ]
    with caplog.at_level("WARNING"):
        evaluation = summarize_evaluation("step 0", result, samples, EvalConfig())
    assert evaluation.rewards_failed == ["broken"] and evaluation.prompts_left_out == 0
    assert {n: m.value for n, m in evaluation.summary.metrics.items()} == {
        "reward/greedy_accuracy": 0.5,
        "exact/greedy_accuracy": 0.5,
    }
    assert "reward broken failed on every held-out completion" in caplog.text
    # Every reward failed everywhere: exact match stands alone, and the run goes on.
    nothing = [EvalSample(p, None, {"broken": None}, greedy=True) for p in range(4)]
    evaluation = summarize_evaluation("step 0", result, nothing, EvalConfig())
    assert evaluation.summary.metrics == {} and evaluation.record()["eval_accuracy"] == 0.5
    best = BestCheckpoint("unused", "reward/greedy_accuracy", before_step=1)
    assert not best.improves({})
