"""Agents that know nothing of rlray, trained through the agent endpoint: the example
agent program (examples/agents/solve_and_check.py, the `openai` package alone) runs as a
process of its own against `python jobs/ppo.py --config examples/solve_and_check.yaml`,
then against `python jobs/collect.py --held-out` serving the trained checkpoint. Each job
start costs tens of seconds, so each run is checked for all it shows."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from rlray.episodes.reader import read
from tests.jobs_helper import REPO, kill, metrics
from tests.test_store_job import wait_until

pytestmark = pytest.mark.slow

TOKEN = "agent-job-secret"
AGENT = REPO / "examples" / "agents" / "solve_and_check.py"


def documented_loop(tmp_path: Path) -> Path:
    """Returns the agent loop docs/agents.md shows, as a program."""
    page = (REPO / "docs" / "agents.md").read_text()
    code = page.split("## The agent loop in 15 lines")[1].split("```python\n")[1]
    path = tmp_path / "agent_loop.py"
    path.write_text(code.split("```")[0])
    return path


def run_with_agents(
    job: list[str],
    env: dict[str, str],
    out: Path,
    agents: list[list[str]],
    while_running: Callable[[str], None] | None = None,
) -> tuple[str, list[str]]:
    """Runs a job and, once it prints its agent endpoint, each agent program against it
    (its arguments, then the URL), then `while_running(url)` if given; returns (the
    job's stdout, each agent's stdout), failing unless every one succeeded."""
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
            agent_env = {"PATH": env["PATH"], "RLRAY_AGENT_TOKEN": TOKEN}
            running = [
                subprocess.Popen(
                    [sys.executable, *agent[:1], url, *agent[1:]],
                    env=agent_env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                for agent in agents
            ]
            if while_running is not None:
                while_running(url)
            outputs = [agent.communicate(timeout=600) for agent in running]
            rest = process.communicate(timeout=600)[0].decode()
        finally:
            process.kill()
    for agent, (_, agent_errors) in zip(running, outputs, strict=True):
        assert agent.returncode == 0, agent_errors[-3000:]
    assert process.returncode == 0, errors.read_text()[-3000:]
    return "".join(lines) + rest, [stdout for stdout, _ in outputs]


def calls_served(url: str) -> int:
    request = urllib.request.Request(
        f"{url}/v1/health", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())["calls"]


def test_the_example_agent_trains_through_the_endpoint_and_collects_held_out(job_env, tmp_path):
    run_dir = tmp_path / "train"
    train = [str(REPO / "jobs" / "ppo.py"), "--config", str(REPO / "examples/solve_and_check.yaml")]
    train += ["--learner.steps", "2", "--learner.eval_every", "2", "--run-dir", str(run_dir)]
    train += ["--rollout.prompts_per_batch", "16"]
    agents = [[str(AGENT), "--agents", "8"], [str(documented_loop(tmp_path))]]

    def kill_the_engine_mid_batch(url: str) -> None:
        # The agents are playing the first batch: its worker dies under their calls,
        # which no call of the driver meets.
        wait_until(lambda: calls_served(url) >= 8, every_s=0.1)
        kill(run_dir, "rollout-0")

    output, _ = run_with_agents(
        train, job_env, tmp_path / "train.out", agents, kill_the_engine_mid_batch
    )
    # The driver found the restarted worker and gave it the weights; the agents' calls,
    # answered 503 meanwhile, went on within the same traces: none was dropped.
    steps = metrics(run_dir)
    assert steps[-1]["actor_restarts"] == {"rollout-0": 1}
    assert "rollout-0 died under the agents' calls" in (tmp_path / "train.err").read_text()
    assert [m["step"] for m in steps] == [1, 2]
    assert all(m["agent_traces_dropped"] == 0 for m in steps)
    assert all(m["logprob_parity_error"] < 1e-4 for m in steps)  # after every sync
    # A trace makes an episode a model call: batches hold more episodes than their
    # traces reserved, and the buffer splits them so that no step trains more than
    # learner.episodes_per_step (the example's 128).
    assert all(0 < m["episodes"] <= 128 for m in steps), [m["episodes"] for m in steps]
    episodes = read(str(run_dir / "episodes")).to_pylist()
    # Every trace handed out is in the store, once: one per prompt and sample.
    traces: dict[tuple[int, int], set[str]] = {}
    for e in episodes:
        key = (e["prompt_index"], e["sample_index"])
        traces.setdefault(key, set()).add(json.loads(e["columns"])["trace_id"])
    # Every trace of a batch is stored, once (one per prompt and sample), but those the
    # run's end dropped: batches started for steps that never came (counted in the log).
    queued = sum(m["prompts_generated"] for m in steps) * 4
    ended = re.search(
        r"at the run's end (\d+) traces not handed out and (\d+) not ended",
        (tmp_path / "train.err").read_text(),
    )
    dropped = int(ended[1]) + int(ended[2]) if ended else 0
    assert len(traces) + dropped == queued and all(len(ids) == 1 for ids in traces.values())
    # A trace's spans are stored once, with its first episode.
    with_spans = Counter(json.loads(e["columns"])["trace_id"] for e in episodes if e["spans"])
    assert set(with_spans.values()) == {1}
    assert len(with_spans) == len({json.loads(e["columns"])["trace_id"] for e in episodes})
    # Both agents played: the example's solver and checker, the documented loop's solver.
    roles = {json.loads(e["columns"])["agent_role"] for e in episodes}
    assert roles == {"solver", "checker"}
    assert any(all(s["kind"] != "event" for s in e["spans"]) for e in episodes)  # the loop's
    components = {name for e in episodes for name, _ in e["reward_components"]}
    assert {"quality", "coordination"} <= components
    # A solver's later rounds extend its first token for token: one loss-masked episode.
    merged = [e for e in episodes if e["completion_mask"] and 0 in e["completion_mask"]]
    assert merged
    kinds = {s["kind"] for e in episodes for s in e["spans"]}
    assert kinds == {"model_call", "event", "reward"}
    assert sum(e["trained_at"] is not None for e in episodes) > 0

    # Collect-only: the trained policy serves the agent on the held-out prompts, and
    # the endpoint dies under the agents' calls.
    policy = run_dir / "checkpoints" / "step-000002" / "policy"
    held_out = tmp_path / "held-out"
    collect = [str(REPO / "jobs" / "collect.py"), "--held-out", "--agent.enabled", "true"]
    collect += ["--model.path", str(policy), "--run-dir", str(held_out)]
    collect += ["--data.eval_size", "24", "--rollout.prompts_per_batch", "8"]
    collect += ["--rollout.samples_per_prompt", "1", "--rollout.max_turns", "6"]

    def kill_the_endpoint_mid_batch(url: str) -> None:
        wait_until(lambda: calls_served(url) >= 4, every_s=0.05)
        kill(held_out, "agent")

    _, (played,) = run_with_agents(
        collect,
        job_env,
        tmp_path / "collect.out",
        [[str(AGENT), "--agents", "8"]],
        kill_the_endpoint_mid_batch,
    )
    # Ray restarted it on the same URL; the traces it held were lost, their agents
    # left them on a 404, and the driver handed their tasks out again: each held-out
    # prompt is one stored trace (the agent may have finished a lost one, too).
    summary = json.loads((held_out / "summary.json").read_text())
    assert summary["actor_restarts"] == {"agent": 1}
    assert int(played.split()[1]) >= 24, played
    stored = read(str(held_out / "episodes")).to_pylist()
    traces = {json.loads(e["columns"])["trace_id"]: e["prompt_index"] for e in stored}
    assert sorted(traces.values()) == list(range(24))
    assert all(e["trained_at"] is None for e in stored)
    assert "agent endpoint: http://127.0.0.1:" in output


PLAY_AND_LEAVE = """
import json, os, sys
from urllib.error import HTTPError
from urllib.request import Request, urlopen

from openai import OpenAI

URL, TOKEN, TASKS = sys.argv[1], os.environ["RLRAY_AGENT_TOKEN"], int(sys.argv[2])
HEADERS = {"Authorization": f"Bearer {TOKEN}"}


def call(method, path, body=None):
    request = Request(URL + path, body and json.dumps(body).encode(), HEADERS, method=method)
    with urlopen(request) as response:
        return response.status, json.loads(response.read() or b"null")


played = 0
while played < TASKS:
    try:
        status, work = call("GET", "/v1/tasks/next")
    except HTTPError as err:
        if err.code == 503:
            continue
        raise
    client = OpenAI(base_url=work["base_url"], api_key=TOKEN, max_retries=60)
    messages = [{"role": "user", "content": work["task"]["prompt"]}]
    client.chat.completions.create(model="solver", messages=messages, max_tokens=4)
    call("POST", f"/v1/traces/{work['trace_id']}/reward", {"reward": 0.5})
    played += 1
"""


def test_a_run_whose_agents_stopped_ends_on_sigterm_and_stores_every_rewarded_trace(
    job_env, tmp_path
):
    """Agents that played some tasks and went away leave the run waiting for traces
    nobody plays: a SIGTERM ends it at once (not after a call timeout), exit 130 with one
    line, and every trace whose reward was accepted is in the store."""
    run_dir, out = tmp_path / "left", tmp_path / "left.out"
    job = [str(REPO / "jobs" / "ppo.py"), "--agent.enabled", "true", "--learner.steps", "50"]
    job += ["--rollout.prompts_per_batch", "8", "--learner.episodes_per_step", "32"]
    # Long enough that a shutdown waiting on an absent agent's call could not pass.
    job += ["--ray.call_timeout_s", "600", "--run-dir", str(run_dir)]
    agent = tmp_path / "play_and_leave.py"
    agent.write_text(PLAY_AND_LEAVE)
    env = {**job_env, "RLRAY_AGENT_TOKEN": TOKEN}
    errors = out.with_suffix(".err")
    with errors.open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, *job], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=stderr
        )
        try:
            for line in process.stdout:
                if line.startswith(b"agent endpoint: "):
                    break
            url = line.decode().split()[-1]
            played = subprocess.run(
                [sys.executable, str(agent), url, "12"],
                env={"PATH": env["PATH"], "RLRAY_AGENT_TOKEN": TOKEN},
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert played.returncode == 0, played.stderr[-3000:]
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=120)  # a call timeout is 600 s
        finally:
            process.kill()
    err = errors.read_text()
    assert process.returncode == 130, err[-3000:]
    assert "\nppo.py: interrupted" in err, err[-3000:]
    assert "at the run's end" in err and "traces not handed out" in err, err[-3000:]
    stored = read(str(run_dir / "episodes")).to_pylist()
    rewarded = {json.loads(e["columns"])["trace_id"] for e in stored if e["reward"] == 0.5}
    assert len(rewarded) == 12
