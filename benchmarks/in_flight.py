"""Weight syncs that wait for every running request against in-flight weight updates, on
the long-tail task (examples/countdown.yaml), over seeds, one run after another.

    python benchmarks/in_flight.py                          # every mode, seeds 0 1 2, 30 steps
    python benchmarks/in_flight.py --seeds 0 --steps 20 --modes drain recompute
    python benchmarks/in_flight.py --extra --learner.episodes_per_step 64   # more job args

Every run is the real job (`jobs/ppo.py --config examples/countdown.yaml`): completions
of 3 to 297 tokens, max_staleness 1. Only rollout.in_flight_updates (and its KV-cache
mode) changes, and in `padded` learner.micro_batch_tokens (0: micro-batches of 64
episodes instead of the example's 512 padded tokens). Prints, per mode: seconds of
training (evaluations timed and left out) to held-out accuracy thresholds, final
accuracy, episodes/s, the share of training time the learner waited for episodes, the
episodes generated across a sync, the mean staleness, the learner's seconds a step,
its tokens/s and the share of its tokens that were padding. Runs whose summary.json
exists under --out are read, not re-run.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from algorithms import run_seed, spread, table

REPO = Path(__file__).resolve().parent.parent
MODES = {
    # micro-batches of learner.micro_batch_size episodes, as before the example's budget
    "padded": ["--rollout.in_flight_updates", "false", "--learner.micro_batch_tokens", "0"],
    "drain": ["--rollout.in_flight_updates", "false"],
    "recompute": ["--rollout.in_flight_updates", "true"],
    "keep": ["--rollout.in_flight_updates", "true", "--rollout.in_flight_kv_cache", "keep"],
}
THRESHOLDS = (0.3, 0.35, 0.4)


def run(mode: str, seed: int, steps: int, out: Path, extra: list[str]) -> Path:
    """Runs one job unless its summary exists; returns its run directory."""
    example = ["--config", str(REPO / "examples" / "countdown.yaml")]
    return run_seed(mode, [*example, *extra, *MODES[mode]], seed, steps, out)


def figures(run_dir: Path) -> dict:
    """Returns a run's evaluations on a clock of training time (evaluations left out) and
    its throughput figures."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals, paused = [], 0.0
    for record in records:
        paused += record.get("phase_seconds", {}).get("evaluation", 0.0)
        if record.get("eval_accuracy") is not None:
            seconds = record["elapsed_seconds"] - paused
            evals.append((seconds, record["eval_accuracy"]))
    steps = [r for r in records if r["step"] >= 1]
    total = sum(r["phase_seconds"]["total"] - r["phase_seconds"]["evaluation"] for r in steps)
    return {
        "evals": evals,
        "seconds": evals[-1][0],
        "episodes_per_s": sum(r["episodes"] for r in steps) / total,
        "waiting": sum(r["phase_seconds"]["generation"] for r in steps) / total,
        "across": sum(r["episodes_updated_in_flight"] for r in steps),
        "staleness": statistics.mean(r["staleness_mean"] for r in steps),
        "learner_seconds": statistics.mean(r["learner_seconds"] for r in steps),
        "learner_tokens_per_s": statistics.mean(r["learner_tokens_per_s"] for r in steps),
        "padding": sum(r["learner_padding_tokens"] for r in steps)
        / sum(r["learner_tokens_computed"] for r in steps),
    }


def time_to(evals: list[tuple[float, float]], accuracy: float) -> float | None:
    return next((s for s, a in evals if a >= accuracy), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench-in-flight")
    parser.add_argument(
        "--extra", nargs=argparse.REMAINDER, default=[], help="more jobs/ppo.py arguments (last)"
    )
    args = parser.parse_args()
    print(f"{len(args.modes)} modes x {len(args.seeds)} seeds, {args.steps} steps each")
    results = {
        mode: [figures(run(mode, seed, args.steps, args.out, args.extra)) for seed in args.seeds]
        for mode in args.modes
    }
    reach = {
        mode: [spread([time_to(r["evals"], a) for r in runs], digits=0) for a in THRESHOLDS]
        + [spread([r["evals"][-1][1] for r in runs]), spread([r["seconds"] for r in runs], 0)]
        for mode, runs in results.items()
    }
    columns = [f"to {a}" for a in THRESHOLDS] + ["final", "seconds"]
    print(table("Seconds of training to held-out accuracy, final accuracy:", columns, reach))
    flow = {
        mode: [
            spread([r["episodes_per_s"] for r in runs], digits=1),
            spread([r["waiting"] for r in runs], digits=2),
            spread([r["across"] for r in runs], digits=0),
            spread([r["staleness"] for r in runs], digits=2),
        ]
        for mode, runs in results.items()
    }
    columns = ["episodes/s", "learner waiting (share)", "across a sync", "staleness"]
    print(table("Throughput:", columns, flow))
    learner = {
        mode: [
            spread([r["learner_seconds"] for r in runs], digits=2),
            spread([r["learner_tokens_per_s"] for r in runs], digits=0),
            spread([r["padding"] for r in runs], digits=3),
        ]
        for mode, runs in results.items()
    }
    print(table("The learner:", ["seconds a step", "tokens/s", "padding (share)"], learner))
    start = {mode: runs[0]["evals"][0][1] for mode, runs in results.items()}
    print(f"\nheld-out accuracy at step 0: {start}")


if __name__ == "__main__":
    main()
