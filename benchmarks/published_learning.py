"""How much the published model learns: SmolLM2-135M-Instruct on its example job
(examples/smollm2-arithmetic.yaml, a reasoning-gym task scored by the task's own scorer),
every weight trained and with LoRA, over seeds; held-out accuracy against training time.

    python benchmarks/published_learning.py                         # 3 seeds, both variants
    python benchmarks/published_learning.py --variants full --seeds 0 --budget-s 600
    python benchmarks/published_learning.py --plot docs/smollm2-learning.png

Each run is `python jobs/ppo.py --config examples/smollm2-arithmetic.yaml` with the
variant's arguments and a seed, run one after another, so that runs never share cores.
Its clock is training time: held-out evaluations are timed and subtracted, as in
benchmarks/vs_trl.py, whose `published` mode reads the same full-training runs (the same
--out and learning rate). Held-out accuracy is the share of the 200 held-out questions
whose greedy reply the task's scorer gives 1. Prints, per variant, the accuracy at the
start, at each sixth of the budget and the best within it, and the rise by the budget
(mean and range over seeds); --plot draws the curves.

Runs whose result exists under --out are read, not re-run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from plots import accuracy_curves
from vs_trl import PUBLISHED_JOB, REPO, Outcome, run_rlray, spread

VARIANTS = {
    # name: (learning rate, more job arguments)
    "full": (1e-5, []),
    "lora": (1e-4, ["--model.lora.rank", "16", "--model.lora.alpha", "32"]),
}


def run(variant: str, seed: int, args: argparse.Namespace) -> Outcome:
    """Runs (or reads) one variant on one seed."""
    lr, extra = VARIANTS[variant]
    job = ["--config", str(PUBLISHED_JOB), "--seed", str(seed), "--learner.lr", str(lr)]
    job += ["--learner.steps", str(args.steps), *extra]
    # The full variant's runs are vs_trl.py published's rlray runs of this learning rate.
    name = f"rlray-lr{lr:g}-seed{seed}" if variant == "full" else f"rlray-{variant}-seed{seed}"
    started = f"{variant}, seed {seed}: {args.out / name}"
    print(started, flush=True)
    return run_rlray(job, args.out / name, learning=True)


def table(runs: dict[str, list[Outcome]], budget: float) -> str:
    times = [round(budget * share) for share in (1 / 6, 1 / 3, 1 / 2, 2 / 3, 5 / 6, 1)]
    header = ["variant", "start", *[f"{t // 60} min" for t in times], "best", "rise"]
    lines = [f"| {' | '.join(header)} |", "|" + "---|" * len(header)]
    for variant, outcomes in runs.items():
        start = [o.evals[0]["accuracy"] for o in outcomes]
        at = [[o.accuracy_at(t) for o in outcomes] for t in times]
        best = [max(e["accuracy"] for e in o.evals if e["seconds"] <= budget) for o in outcomes]
        rise = [b - a for a, b in zip(start, at[-1], strict=True)]
        cells = [spread(start, 3), *[spread(a, 3) for a in at], spread(best, 3), spread(rise, 3)]
        lines.append(f"| {variant} | {' | '.join(cells)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench-published")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--budget-s", type=float, default=1800.0, help="training seconds")
    parser.add_argument("--steps", type=int, default=45, help="learner steps a run takes")
    parser.add_argument("--plot", type=Path, help="draw the learning curves here (PNG)")
    args = parser.parse_args()
    runs = {v: [run(v, seed, args) for seed in args.seeds] for v in args.variants}
    for variant, outcomes in runs.items():
        ran = min(o.seconds for o in outcomes)
        if ran < args.budget_s:
            print(f"(the shortest {variant} run trained {ran:.0f} s, under the budget)")
    seeds = " ".join(map(str, args.seeds))
    print(f"\nHeld-out accuracy, seeds {seeds}, mean (min-max):\n")
    print(table(runs, args.budget_s))
    if args.plot:
        curves = {variant: [o.evals for o in outcomes] for variant, outcomes in runs.items()}
        title = "SmolLM2-135M-Instruct on basic_arithmetic, 2 CPU cores, a line a seed"
        ylabel = "held-out accuracy (the task's scorer)"
        accuracy_curves(curves, args.plot, title, ylabel, args.budget_s, minutes=True)


if __name__ == "__main__":
    sys.exit(main())
