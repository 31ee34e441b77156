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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlray.core.episode import from_table
from rlray.data.preferences import pairs_from_episodes
from rlray.episodes.reader import read


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pairs.py", description=__doc__.splitlines()[0])
    parser.add_argument("source", help="episode store: a directory or an s3:// URI")
    parser.add_argument("--out", required=True, help="the JSONL file to write")
    parser.add_argument("--margin", type=float, default=1.0, help="least reward difference")
    parser.add_argument("--per-prompt", type=int, default=1, help="most pairs per prompt")
    parser.add_argument("--run", action="append", help="only this run id (repeatable)")
    parser.add_argument("--endpoint-url", help="S3-compatible endpoint (e.g. MinIO)")
    args = parser.parse_args(argv)
    if not args.margin > 0 or args.per_prompt < 1:
        print("pairs.py: error: --margin must be > 0 and --per-prompt >= 1", file=sys.stderr)
        return 2
    try:
        episodes = from_table(read(args.source, runs=args.run, endpoint_url=args.endpoint_url))
    except (FileNotFoundError, OSError) as err:
        print(f"pairs.py: error: {err}", file=sys.stderr)
        return 2
    pairs, counts = pairs_from_episodes(episodes, args.margin, args.per_prompt)
    out = Path(args.out)
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
    sys.exit(main(sys.argv[1:]))
