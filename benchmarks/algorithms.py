"""Held-out accuracy of each advantage estimator and policy loss on the default task,
against training wall time and against episodes, over several seeds.

    python benchmarks/algorithms.py                       # every variant, seeds 0 1 2
    python benchmarks/algorithms.py --variants grpo rloo --seeds 0 --steps 60
    python benchmarks/algorithms.py --extra --model.dtype bfloat16   # passed to every run

Each run is the real default job (`jobs/ppo.py`, its own local Ray, vLLM rollouts),
one after another so that runs never share the cores; only the algorithm settings and
the seed change. Runs whose summary.json exists under --out are read, not re-run.
Prints a Markdown table per measure: mean (min-max) over seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# name: the settings that make the variant (everything else is the default job's). The
# group estimators run without a reference model (kl_coef 0, as DAPO and Dr. GRPO do;
# grpo refuses a KL penalty in the reward); gae runs with and without its KL penalty.
NO_KL = ["--algorithm.kl_coef", "0"]
VARIANTS: dict[str, list[str]] = {
    "gae": ["--algorithm.advantage", "gae", "--algorithm.kl_coef", "0.05"],
    "gae_kl0": ["--algorithm.advantage", "gae", *NO_KL],
    "grpo": ["--algorithm.advantage", "grpo", *NO_KL],
    "dr_grpo": [
        "--algorithm.advantage",
        "dr_grpo",
        "--algorithm.loss_aggregation",
        "seq_mean_token_sum_norm",
        *NO_KL,
    ],
    "rloo": ["--algorithm.advantage", "rloo", *NO_KL],
    "reinforce_pp": ["--algorithm.advantage", "reinforce_pp", *NO_KL],
    "reinforce_pp_baseline": ["--algorithm.advantage", "reinforce_pp_baseline", *NO_KL],
    "grpo+gspo": [
        "--algorithm.advantage",
        "grpo",
        "--algorithm.policy_loss",
        "gspo",
        "--algorithm.loss_aggregation",
        "seq_mean_token_mean",
        *NO_KL,
    ],
    "grpo+cispo": ["--algorithm.advantage", "grpo", "--algorithm.policy_loss", "cispo", *NO_KL],
}
WALL_TIMES = (20, 40, 60, 80)
EPISODE_COUNTS = (0, 2560, 6400, 12800, 19200, 25600)
THRESHOLDS = (0.5, 0.6, 0.65)


def run(variant: str, seed: int, steps: int, extra: list[str], out: Path) -> Path:
    """Runs one job unless its summary exists; returns its run directory."""
    return run_seed(variant, [*VARIANTS[variant], *extra], seed, steps, out)


def run_seed(name: str, args: list[str], seed: int, steps: int, out: Path) -> Path:
    """Runs `jobs/ppo.py ARGS` with the seed and steps into out/NAME-seedSEED unless its
    summary exists there; returns that run directory."""
    run_dir = out / f"{name}-seed{seed}"
    if (run_dir / "summary.json").is_file():
        return run_dir
    args = [*args, "--seed", str(seed), "--learner.steps", str(steps)]
    command = [sys.executable, str(REPO / "jobs" / "ppo.py"), *args, "--run-dir", str(run_dir)]
    started = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=7200)
    if result.returncode != 0:
        raise SystemExit(f"{name} seed {seed} failed:\n{result.stderr[-3000:]}")
    print(f"  {name} seed {seed}: {time.perf_counter() - started:.0f} s", flush=True)
    return run_dir


def evaluations(run_dir: Path) -> list[dict]:
    """Returns the run's evaluations: step, episodes so far, elapsed seconds, accuracy."""
    episodes, points = 0, []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        episodes += record.get("episodes", 0)
        if record.get("eval_accuracy") is not None:
            points.append(
                {
                    "step": record["step"],
                    "episodes": episodes,
                    "seconds": record["elapsed_seconds"],
                    "accuracy": record["eval_accuracy"],
                }
            )
    return points


def accuracy_at(points: list[dict], key: str, limit: float) -> float | None:
    """Returns the last evaluation's accuracy with `key` (seconds, episodes) <= limit."""
    seen = [p["accuracy"] for p in points if p[key] <= limit]
    return seen[-1] if seen else None


def time_to(points: list[dict], accuracy: float) -> float | None:
    """Returns the seconds of the first evaluation at or above `accuracy`."""
    return next((p["seconds"] for p in points if p["accuracy"] >= accuracy), None)


def spread(values: list[float | None], digits: int = 3) -> str:
    """Returns 'mean (min-max)' of the values, '-' where a run never got there."""
    if any(v is None for v in values):
        reached = [v for v in values if v is not None]
        return f"{len(reached)}/{len(values)} reached" if reached else "-"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    low, high = min(values), max(values)
    return f"{statistics.mean(values):.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


def table(title: str, columns: list[str], rows: dict[str, list[str]]) -> str:
    lines = [f"\n{title}\n", "| variant | " + " | ".join(columns) + " |"]
    lines.append("|---" * (len(columns) + 1) + "|")
    lines += [f"| {name} | " + " | ".join(cells) + " |" for name, cells in rows.items()]
    return "\n".join(lines)


def report(results: dict[str, list[list[dict]]]) -> str:
    """Returns the Markdown tables of accuracy by wall time, by episodes, and time to
    thresholds."""
    by_time = {
        name: [spread([accuracy_at(p, "seconds", t) for p in runs]) for t in WALL_TIMES]
        for name, runs in results.items()
    }
    by_episodes = {
        name: [spread([accuracy_at(p, "episodes", e) for p in runs]) for e in EPISODE_COUNTS]
        for name, runs in results.items()
    }
    reach = {
        name: [spread([time_to(p, a) for p in runs], digits=0) for a in THRESHOLDS]
        + [spread([p[-1]["accuracy"] for p in runs]), spread([p[-1]["seconds"] for p in runs], 0)]
        for name, runs in results.items()
    }
    return "\n".join(
        [
            table(
                "Held-out accuracy at training wall time (s):",
                [f"{t} s" for t in WALL_TIMES],
                by_time,
            ),
            table(
                "Held-out accuracy after episodes:",
                [str(e) for e in EPISODE_COUNTS],
                by_episodes,
            ),
            table(
                "Seconds to held-out accuracy, final accuracy and training seconds:",
                [f"to {a}" for a in THRESHOLDS] + ["final", "seconds"],
                reach,
            ),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=150, help="learner steps per run")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench-algorithms")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="job arguments")
    args = parser.parse_args()
    print(f"{len(args.variants)} variants x {len(args.seeds)} seeds, {args.steps} steps each")
    results = {
        name: [evaluations(run(name, s, args.steps, args.extra, args.out)) for s in args.seeds]
        for name in args.variants
    }
    print(report(results))


if __name__ == "__main__":
    main()
