"""Preference pairs from an episode store: the episodes of one prompt whose rewards differ
by at least a margin, the better one chosen, written as JSONL (prompt, chosen, rejected).

python jobs/pairs.py runs/exp1/episodes --out pairs.jsonl
python jobs/pairs.py runs/exp1/episodes --out pairs.jsonl --margin 0.5 --per-prompt 2
python jobs/pairs.py s3://bucket/prefix --endpoint-url http://127.0.0.1:9000 --out pairs.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rlray.driver.job import Job, run_job

JOB = Job("pairs.py", began="pairing", kept="the pair file may be incomplete")
JOB.stop_while_importing()  # the imports below take seconds

from rlray.config import ConfigError
from rlray.core.episode import Episode, from_table
from rlray.data.preferences import pairs_from_episodes
from rlray.episodes.reader import read


def main(argv: list[str] | None = None) -> int:
    return run_job(JOB, argv, check, write_pairs)


def check(argv: list[str]) -> tuple[argparse.Namespace, list[Episode]]:
    """Returns the arguments and the store's episodes; raises ConfigError for a bad
    argument or a store that cannot be read."""
    parser = argparse.ArgumentParser(prog="pairs.py", description=__doc__.splitlines()[0])
    parser.add_argument("source", help="episode store: a directory or an s3:// URI")
    parser.add_argument("--out", required=True, help="the JSONL file to write")
    parser.add_argument("--margin", type=float, default=1.0, help="least reward difference")
    parser.add_argument("--per-prompt", type=int, default=1, help="most pairs per prompt")
    parser.add_argument("--run", action="append", help="only this run id (repeatable)")
    parser.add_argument("--endpoint-url", help="S3-compatible endpoint (e.g. MinIO)")
    args = parser.parse_args(argv)
    if not args.margin > 0 or args.per_prompt < 1:
        raise ConfigError("--margin must be > 0 and --per-prompt >= 1")
    try:
        return args, from_table(read(args.source, runs=args.run, endpoint_url=args.endpoint_url))
    except (FileNotFoundError, OSError) as err:
        raise ConfigError(str(err)) from None


def write_pairs(store: tuple[argparse.Namespace, list[Episode]]) -> int:
    """Writes the pairs of the store's episodes as JSONL; returns the exit code."""
    args, episodes = store
    out = Path(args.out)
    with JOB.working():
        pairs, counts = pairs_from_episodes(episodes, args.margin, args.per_prompt)
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("w") as file:
            for pair in pairs:
                file.write(json.dumps(pair.to_json(), ensure_ascii=False) + "\n")
    print(
        f"{counts.pairs} pairs from {counts.prompts} prompts ({counts.prompts_without_pair} "
        f"without a pair at margin {args.margin}); left out: {counts.without_reward} "
        f"episodes without a reward, {counts.multi_turn} multi-turn, {counts.empty} empty "
        f"-> {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
