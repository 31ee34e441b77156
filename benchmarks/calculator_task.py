"""The built-in multi-turn task (examples/calculator.yaml) run as users run it: held-out
greedy success before and after, tool calls per episode and their success rate over
the steps, wall time and peak memory.

python benchmarks/calculator_task.py                 # 12 steps, evaluation every 6
python benchmarks/calculator_task.py --steps 60 --eval-every 10
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--eval-every", type=int, default=6)
    args = parser.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="calculator-")) / "run"
    command = [
        *(sys.executable, str(REPO / "jobs" / "ppo.py")),
        *("--config", str(REPO / "examples" / "calculator.yaml")),
        *("--learner.steps", str(args.steps), "--learner.eval_every", str(args.eval_every)),
        *("--run-dir", str(run_dir)),
    ]
    started = time.monotonic()
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    wall = time.monotonic() - started
    if result.returncode != 0:
        sys.exit(f"the run failed:\n{result.stderr[-3000:]}")
    report(result.stdout, run_dir, wall)


def report(stdout: str, run_dir: Path, wall: float) -> None:
    evaluations = re.findall(r"^eval\s+step\s+(\d+)\s+held-out accuracy ([\d.]+)", stdout, re.M)
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s["step"] > 0]
    summary = json.loads((run_dir / "summary.json").read_text())
    print("held-out greedy success by step: " + ", ".join(f"{s}: {a}" for s, a in evaluations))
    calls = [s["tool_calls"] / s["episodes"] for s in steps]
    rates = [s["tool_call_success_rate"] for s in steps if s["tool_call_success_rate"] is not None]
    print(f"tool calls per episode: step 1 {calls[0]:.2f} -> step {len(calls)} {calls[-1]:.2f}")
    print(f"tool call success rate: step 1 {rates[0]:.2f} -> last {rates[-1]:.2f}")
    parity = max(s["logprob_parity_error"] for s in steps)
    print(f"largest logprob parity error (policy tokens): {parity:.2e}")
    training, memory = summary["wall_seconds"], summary["memory_peak_gib"]
    print(f"wall time {wall:.0f} s (training loop {training:.0f} s), peak memory {memory:.2f} GiB")


if __name__ == "__main__":
    main()
