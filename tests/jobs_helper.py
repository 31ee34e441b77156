"""Runs `python jobs/ppo.py` as users do, joined to the test session's Ray cluster."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# A few fast steps: 32 episodes a step in two micro-batches, a small held-out set;
# strictly on-policy, so that runs repeat step for step (same seed, resume) and every
# generated batch is trained on. The default overlap (max_staleness 1) has tests of its
# own (test_job's overlap test, test_actors).
SHORT_RUN = [
    "--buffer.max_staleness",
    "0",
    "--learner.episodes_per_step",
    "32",
    "--rollout.prompts_per_batch",
    "8",
    "--learner.minibatch_size",
    "16",
    "--learner.micro_batch_size",
    "8",
    "--data.eval_size",
    "40",
    "--learner.eval_every",
    "5",
    "--learner.checkpoint_every",
    "3",
]


def run_job(
    args: list[str], env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """Returns the finished `python jobs/ppo.py ARGS` process (stdout and stderr text)."""
    return subprocess.run(
        [sys.executable, str(REPO / "jobs" / "ppo.py"), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def metrics(run_dir: Path) -> list[dict]:
    """Returns the learner-step lines of a run's metrics.jsonl (step 0 left out)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["step"] > 0]


SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)\{(?P<labels>[^}]*)\} (?P<value>\S+)$")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def scrape(url: str) -> list[tuple[str, dict[str, str], float]]:
    """Returns (series, labels, value) of every labelled sample at a Prometheus endpoint."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    samples = []
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if match:
            labels = dict(LABEL.findall(match["labels"]))
            samples.append((match["name"], labels, float(match["value"])))
    return samples


def series_name(name: str, kind: str) -> str:
    """Returns the Prometheus series under which Ray exports rlray's metric `name`."""
    return f"ray_{name}" + {"counter": "_total", "histogram": "_count"}.get(kind, "")
