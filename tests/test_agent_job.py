"""Agents that know nothing of rlray, trained through the agent endpoint: the example
agent program (examples/agents/solve_and_check.py, the `openai` package alone) runs as a
process of its own against `python jobs/ppo.py --config examples/solve_and_check.yaml`,
then against `python jobs/collect.py --held-out` serving the trained checkpoint. Each job
start costs tens of seconds, so each run is checked for all it shows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlray.episodes.reader import read
from tests.jobs_helper import REPO, metrics

pytestmark = pytest.mark.slow

TOKEN = "agent-job-secret"
AGENT = REPO / "examples" / "agents" / "solve_and_check.py"


def run_with_agents(job: list[str], env: dict[str, str], out: Path) -> tuple[str, str]:
    """Runs a job and, once it prints its agent endpoint, the example agent against it;
    returns (the job's stdout, the agent's stdout), failing unless both succeeded."""
    env = {**env, "RLRAY_AGENT_TOKEN": TOKEN}
    errors = out.with_suffix(".err")
    with errors.open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, *job], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=stderr
        )
        try:
            lines = []
            for line in process.stdout:
                lines.append(line.decode())
                if line.startswith(b"agent endpoint: "):
                    break
            assert lines and lines[-1].startswith("agent endpoint: "), errors.read_text()
            url = lines[-1].split()[-1]
            agents = subprocess.run(
                [sys.executable, str(AGENT), url, "--agents", "8"],
                env={"PATH": env["PATH"], "RLRAY_AGENT_TOKEN": TOKEN},
                capture_output=True,
                text=True,
                timeout=600,
            )
            rest = process.communicate(timeout=600)[0].decode()
        finally:
            process.kill()
    assert agents.returncode == 0, agents.stderr[-3000:]
    assert process.returncode == 0, errors.read_text()[-3000:]
    return "".join(lines) + rest, agents.stdout


def test_the_example_agent_trains_through_the_endpoint_and_collects_held_out(job_env, tmp_path):
    run_dir = tmp_path / "train"
    train = [str(REPO / "jobs" / "ppo.py"), "--config", str(REPO / "examples/solve_and_check.yaml")]
    train += ["--learner.steps", "3", "--learner.eval_every", "3", "--run-dir", str(run_dir)]
    train += ["--rollout.prompts_per_batch", "16"]
    output, played = run_with_agents(train, job_env, tmp_path / "train.out")

    tasks = int(played.split()[1])
    steps = metrics(run_dir)
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert all(m["agent_traces_dropped"] == 0 for m in steps)
    assert all(m["logprob_parity_error"] < 1e-4 for m in steps)  # after every sync
    assert all(set(m["reward_components"]) >= {"quality", "coordination"} for m in steps)
    episodes = read(str(run_dir / "episodes")).to_pylist()
    traces = {json.loads(e["columns"])["trace_id"] for e in episodes}
    assert len(traces) == tasks  # every trace an agent played is in the store, once
    assert {json.loads(e["columns"])["agent_role"] for e in episodes} == {"solver", "checker"}
    # A solver's later rounds extend its first token for token: one loss-masked episode.
    merged = [e for e in episodes if e["completion_mask"] and 0 in e["completion_mask"]]
    assert merged
    kinds = {s["kind"] for e in episodes for s in e["spans"]}
    assert kinds == {"model_call", "event", "reward"}
    assert sum(e["trained_at"] is not None for e in episodes) > 0

    # Collect-only: the trained policy serves the agent on the held-out prompts.
    policy = run_dir / "checkpoints" / "step-000003" / "policy"
    held_out = tmp_path / "held-out"
    collect = [str(REPO / "jobs" / "collect.py"), "--held-out", "--agent.enabled", "true"]
    collect += ["--model.path", str(policy), "--run-dir", str(held_out)]
    collect += ["--data.eval_size", "16", "--rollout.prompts_per_batch", "8"]
    collect += ["--rollout.samples_per_prompt", "1", "--rollout.max_turns", "6"]
    _, played = run_with_agents(collect, job_env, tmp_path / "collect.out")
    assert played.startswith("solve_and_check: 16 tasks")
    stored = read(str(held_out / "episodes")).to_pylist()
    assert len({json.loads(e["columns"])["trace_id"] for e in stored}) == 16
    assert all(e["trained_at"] is None for e in stored)
    assert "agent endpoint: http://127.0.0.1:" in output
