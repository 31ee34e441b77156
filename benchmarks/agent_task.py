"""The built-in agent task, learned through the agent endpoint: held-out success of the
example agent (examples/agents/solve_and_check.py) before and after training, per seed.

    python benchmarks/agent_task.py                       # seeds 0, 100 steps
    python benchmarks/agent_task.py --seeds 0 1 2 --steps 150

Each seed: `jobs/ppo.py --config examples/solve_and_check.yaml` trains for --steps
learner steps with the example agent (16 agents, its own process) playing every task;
then `jobs/collect.py --held-out --agent.enabled true` serves the trained policy (the
last checkpoint), and the base model, to the same agent on the task's held-out prompts.
Success is the share of held-out tasks where solver and checker agreed on the right
answer (the agent's `correct` component), with the agent's calls greedy (temperature
0, as held-out accuracy is measured) and sampled (temperature 1, as it trains). Prints
each run's success, its change in points, and the training run's wall time. Runs whose
output exists under --out are read, not re-run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlray.episodes.reader import read

REPO = Path(__file__).resolve().parent.parent
AGENT = REPO / "examples" / "agents" / "solve_and_check.py"
TOKEN = "benchmark-agent-token"


def with_agents(job: list[str], agents: int = 16, temperature: float = 1.0) -> None:
    """Runs a job and, once it prints its endpoint, the example agent against it."""
    env = {**os.environ, "RLRAY_AGENT_TOKEN": TOKEN}
    process = subprocess.Popen([sys.executable, *job], cwd=REPO, env=env, stdout=subprocess.PIPE)
    try:
        for line in process.stdout:
            if line.startswith(b"agent endpoint: "):
                url = line.split()[-1].decode()
                break
        else:
            raise SystemExit(f"no agent endpoint from {' '.join(job)}")
        agent = [str(AGENT), url, "--agents", str(agents), "--temperature", str(temperature)]
        played = subprocess.run([sys.executable, *agent], env=env, check=False)
        process.communicate(timeout=3600)
    finally:
        process.kill()
    if played.returncode or process.returncode:
        raise SystemExit(f"failed: {' '.join(job)}")


def held_out_success(model: str, out: Path, temperature: float) -> float:
    """Returns the held-out success of `model` served to the agent (collect-only), its
    calls at `temperature`."""
    if not (out / "summary.json").exists():
        job = [str(REPO / "jobs" / "collect.py"), "--held-out", "--agent.enabled", "true"]
        job += ["--model.path", model, "--run-dir", str(out), "--rollout.samples_per_prompt", "1"]
        job += ["--rollout.max_turns", "6"]
        with_agents(job, temperature=temperature)
    traces = {}
    for episode in read(str(out / "episodes")).to_pylist():
        columns = json.loads(episode["columns"])
        traces[columns["trace_id"]] = dict(episode["reward_components"])["correct"]
    return statistics.mean(traces.values())


def train(seed: int, steps: int, out: Path) -> float:
    """Trains one seed unless done; returns its wall seconds."""
    if not (out / "summary.json").exists():
        job = [
            str(REPO / "jobs" / "ppo.py"),
            "--config",
            str(REPO / "examples/solve_and_check.yaml"),
        ]
        job += ["--seed", str(seed), "--learner.steps", str(steps), "--run-dir", str(out)]
        job += ["--learner.eval_every", str(steps)]
        with_agents(job)
    return json.loads((out / "summary.json").read_text())["wall_seconds"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "agent-task")
    args = parser.parse_args()
    temperatures = {"greedy": 0.0, "sampled": 1.0}
    base = {
        name: held_out_success("builtin:tiny-arithmetic", args.out / f"held-out-base-{name}", t)
        for name, t in temperatures.items()
    }
    print(
        f"base model: held-out success greedy {base['greedy']:.3f}, sampled {base['sampled']:.3f}"
    )
    changes: dict[str, list[float]] = {name: [] for name in temperatures}
    for seed in args.seeds:
        run = args.out / f"seed{seed}"
        seconds = train(seed, args.steps, run)
        policy = run / "checkpoints" / f"step-{args.steps:06d}" / "policy"
        shown = []
        for name, temperature in temperatures.items():
            held_out = args.out / f"held-out-seed{seed}-{name}"
            after = held_out_success(str(policy), held_out, temperature)
            changes[name].append(100 * (after - base[name]))
            shown.append(
                f"{name} {base[name]:.3f} -> {after:.3f} ({changes[name][-1]:+.1f} points)"
            )
        print(
            f"seed {seed}: {args.steps} steps in {seconds:.0f} s, held-out success "
            + ", ".join(shown)
        )
    if len(args.seeds) > 1:
        for name, points in changes.items():
            mean = statistics.mean(points)
            print(f"{name}: mean change {mean:+.1f} points over {len(points)} seeds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
