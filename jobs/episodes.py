"""Summarise an episode store: counts, reward by policy version, finish reasons, failures.

python jobs/episodes.py runs/exp1/episodes
python jobs/episodes.py s3://bucket/prefix --endpoint-url http://127.0.0.1:9000
python jobs/episodes.py runs/exp1/episodes --json     # machine-readable
python jobs/episodes.py runs/exp1/episodes --episode ID   # one episode, turn by turn
"""

from __future__ import annotations

import argparse
import json
import sys

from rlray.driver.job import Job, run_job

JOB = Job("episodes.py", began="the summary")
JOB.stop_while_importing()  # the imports below take seconds

import pyarrow as pa

from rlray.config import ConfigError
from rlray.episodes.reader import find_episode, format_trace, read, summarize


def main(argv: list[str] | None = None) -> int:
    return run_job(JOB, argv, check, show)


def check(argv: list[str]) -> tuple[argparse.Namespace, pa.Table]:
    """Returns the arguments and the store's episodes; raises ConfigError if the store
    cannot be read."""
    parser = argparse.ArgumentParser(prog="episodes.py", description=__doc__.splitlines()[0])
    parser.add_argument("source", help="episode store: a directory or an s3:// URI")
    parser.add_argument("--run", action="append", help="only this run id (repeatable)")
    parser.add_argument("--endpoint-url", help="S3-compatible endpoint (e.g. MinIO)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--episode", help="show this episode's trace, turn by turn")
    args = parser.parse_args(argv)
    try:
        return args, read(args.source, runs=args.run, endpoint_url=args.endpoint_url)
    except (FileNotFoundError, OSError) as err:
        raise ConfigError(str(err)) from None


def show(store: tuple[argparse.Namespace, pa.Table]) -> int:
    """Prints the store's summary, or one episode's trace; returns the exit code."""
    args, table = store
    if args.episode:
        return show_episode(table, args.episode)
    summary = summarize(table)
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    return 0


def show_episode(table: pa.Table, episode_id: str) -> int:
    """Prints one episode's trace; returns the exit code (2 if there is no such episode)."""
    episode = find_episode(table, episode_id)
    if episode is None:
        JOB.say(f"error: no episode {episode_id!r} in the store")
        return 2
    print(format_trace(episode))
    return 0


def format_summary(summary: dict) -> str:
    """Returns the summary as a few readable lines."""
    lines = [
        f"{summary['episodes']} episodes from {len(summary['runs'])} run(s): "
        f"{', '.join(summary['runs'])}",
        f"trained on: {summary['trained']}; without a reward: {summary['without_reward']}",
        "reward mean by policy version:",
    ]
    for version, mean in summary["reward_mean_by_policy_version"].items():
        lines.append(f"  v{version:<6} {mean:8.4f}")
    lines.append(
        "finish reasons: " + ", ".join(f"{k} {v}" for k, v in summary["finish_reasons"].items())
    )
    failures = summary["reward_failures"]
    lines.append(
        "reward failures: " + (", ".join(f"{k} {v}" for k, v in failures.items()) or "none")
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
